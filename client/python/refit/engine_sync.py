"""What the engine adapters (refit.vllm, refit.sglang) share: the engine node's DESTINATION
buffer in the trainer's checkpoint layout, and one update — wait for a version, refuse it if
it holds inf/NaN values, Apply it, hand the tensors to the engine's own
`load_weights(weights: Iterable[tuple[str, Tensor]])`, which maps checkpoint names onto its
(possibly fused: `qkv_proj`, `gate_up_proj`, expert `w13`/`w2`) parameters.

fp8 parameters: names listed in `fp8` are registered as fp8 destinations with block scales; the
engine receives `<name>` (e4m3fn bytes, torch.uint8 storage where torch has no float8 dtype) and
`<name>_scale_inv` (FP32 scales), the checkpoint names of DeepSeek-V3-style fp8 weights.

Not thread-safe: one thread drives an EngineWeights.
"""

from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch

from refit import client as client_lib
from refit import errors
from refit.buffer import Slice
from refit.v1 import refit_pb2

DESTINATION = refit_pb2.DESTINATION


class NonFiniteVersionError(errors.RefitError):
    """The version holds inf/NaN values (a diverged trainer); it was not applied."""

    def __init__(self, model: str, version: int, count: int):
        super().__init__(f"model {model}: version {version} holds {count} inf/NaN values")
        self.version = version
        self.count = count


def weight_version(model: str, version: int) -> str:
    """The weight version string engines report for a refit version ("<model>@<version>")."""
    return f"{model}@{version}"


class EngineWeights:
    """A DESTINATION buffer holding `params` {checkpoint name: (shape, torch dtype)}."""

    def __init__(self, client: client_lib.Client, model: str,
                 params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                 fp8: Iterable[str] = (), fp8_block: Sequence[int] = (128, 128),
                 client_name: str = "engine"):
        self.client = client
        self.model = model
        fp8 = set(fp8)
        unknown = fp8 - set(params)
        if unknown:
            raise ValueError(f"fp8 names not among the params: {sorted(unknown)}")
        tensors: Dict[str, object] = {}
        for name, (shape, dtype) in params.items():
            shape = tuple(int(d) for d in shape)
            if name in fp8:
                grid = tuple(-(-d // b) for d, b in zip(shape, fp8_block))
                tensors[name + "_scale_inv"] = Slice(sizes=grid, dtype=torch.float32)
                tensors[name] = Slice(sizes=shape, dtype=torch.uint8,
                                      refit_dtype=refit_pb2.FP8_E4M3,
                                      scale_tensor=name + "_scale_inv", scale_block=fp8_block)
            else:
                tensors[name] = Slice(sizes=shape, dtype=dtype)
        self.buffer = client.register(model, DESTINATION, tensors, client_name=client_name)
        self.version = 0

    def _nonfinite(self, version: int) -> int:
        for m in self.client.status().models:
            if m.model == self.model and m.latest_version == version:
                return m.latest_nonfinite_values
        return 0

    def update(self, load_weights, version: int = 0, timeout: Optional[float] = 60.0,
               refuse_nonfinite: bool = True) -> int:
        """Waits for `version` (0: the newest after the one held), applies it, loads it."""
        wanted = version or self.version + 1
        got = self.client.wait_for_version(self.model, wanted, timeout=timeout)
        target = version or got
        count = self._nonfinite(target)
        if refuse_nonfinite and count:
            raise NonFiniteVersionError(self.model, target, count)
        applied = self.client.apply(self.model, [self.buffer], target)
        load_weights(self.weights())
        self.version = applied.version
        return applied.version

    def weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor viewing the buffer) for every tensor held."""
        return iter(list(self.buffer.tensors.items()))

    def release(self) -> None:
        self.buffer.release()
