"""torch dtype <-> refit.v1.DType."""

from typing import Dict

import torch

from refit.v1 import refit_pb2

_PAIRS = [
    ("bfloat16", refit_pb2.BF16),
    ("float16", refit_pb2.FP16),
    ("float32", refit_pb2.FP32),
    ("float8_e4m3fn", refit_pb2.FP8_E4M3),  # torch >= 2.1 only
    ("float8_e5m2", refit_pb2.FP8_E5M2),
    ("int8", refit_pb2.INT8),
    ("uint8", refit_pb2.UINT8),
    ("int32", refit_pb2.INT32),
    ("int64", refit_pb2.INT64),
]

TORCH_TO_REFIT: Dict[torch.dtype, int] = {
    getattr(torch, name): dtype for name, dtype in _PAIRS if hasattr(torch, name)
}
REFIT_TO_TORCH: Dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_REFIT.items()}


def to_refit(dtype: torch.dtype) -> int:
    """The refit.v1.DType of a torch dtype; ValueError for dtypes refit does not carry."""
    try:
        return TORCH_TO_REFIT[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in TORCH_TO_REFIT)
        raise ValueError(
            f"refit cannot carry {dtype}; supported: {supported} "
            f"(pass dtype= to store another dtype in the buffer)") from None


def to_torch(dtype: int) -> torch.dtype:
    """The torch dtype of a refit.v1.DType; ValueError where this torch lacks it."""
    try:
        return REFIT_TO_TORCH[dtype]
    except KeyError:
        name = refit_pb2.DType.Name(dtype) if dtype in refit_pb2.DType.values() else dtype
        raise ValueError(
            f"refit dtype {name} has no torch dtype in torch {torch.__version__}") from None
