"""refit as the weight-update path of an SGLang engine.

`RefitWeightReceiver(model, ...)`: `receive(version)` pulls a version by number from the node's
refitd into the model; `destroy()` releases what it registered. Zero copy where the model's
parameters allow it (`storage="auto"`, the default): the parameters themselves are refit
DESTINATION memory (fused `qkv_proj` / `gate_up_proj` / expert `w13` / `w2` through `mapping`,
fp8 `weight` + `weight_scale_inv`), so a receive is an Apply and nothing else; the rest, or
everything with `storage="load_weights"`, goes through the model's own
`load_weights(weights: Iterable[tuple[str, Tensor]])` (refit.engine_storage, docs/engines.md).

Inside SGLang, the receiver runs as a custom weight loader, SGLang's documented hook for
third-party weight updates (`ModelRunner.update_weights_from_tensor(named_tensors,
load_format)`: a `load_format` listed in the server's `--custom-weight-loader` is imported and
called as `loader(model, named_tensors)` in every TP worker; added by sgl-project/sglang PR
#7122, June 2025). Start the server with
`--custom-weight-loader refit.sglang.custom_weight_loader`, then from the RL framework:

    engine.update_weights_from_tensor(refit.sglang.init_tensors({"model": "policy", ...}),
                                      load_format="refit.sglang.custom_weight_loader")
    engine.update_weights_from_tensor(refit.sglang.version_tensors(7),
                                      load_format="refit.sglang.custom_weight_loader")

The named tensors carry no weights, only the receiver's settings (once) and a version number;
each worker pulls the version from its node's refitd. SGLang itself was not run (not
installed: sglang 0.5.23's pins conflict with vllm 0.33's; docs/engines.md): this was tested
against a torch model with SGLang's `load_weights` signature
and parameter naming, calling the loader the way ModelRunner does
(client/python/tests/test_zero_copy.py).
"""

import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from refit import client as client_lib
from refit.engine_storage import MappingError
from refit.engine_sync import EngineWeights, NonFiniteVersionError, weight_version
from refit.mapping import FusedMapping

__all__ = ["RefitWeightReceiver", "MappingError", "NonFiniteVersionError",
           "custom_weight_loader", "init_tensors", "version_tensors"]

INIT_NAME = "refit.init"        # uint8 tensor: the receiver's settings as UTF-8 JSON
VERSION_NAME = "refit.version"  # int64 [1]: the version to receive (0: the next one)
_ATTRIBUTE = "_refit_receiver"  # where the custom loader keeps a model's receiver
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class RefitWeightReceiver:
    def __init__(self, model: torch.nn.Module, model_name: str,
                 params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                 fp8: Iterable[str] = (), fp8_block: Sequence[int] = (128, 128),
                 socket: Optional[str] = None, mapping: Optional[FusedMapping] = None,
                 storage: str = "auto", experts: Optional[Iterable[int]] = None):
        self.model = model
        self.client = client_lib.Client(socket)
        try:
            self.weights = EngineWeights(self.client, model_name, params, fp8, fp8_block,
                                         client_name="sglang", module=model, mapping=mapping,
                                         storage=storage, experts=experts)
        except BaseException:
            self.client.close()
            raise

    @property
    def zero_copy(self) -> bool:
        """True when every tensor is written in place (no load_weights call per receive)."""
        return bool(self.weights.buffers) and self.weights.fallback is None

    def receive(self, version: int = 0, timeout: Optional[float] = 60.0,
                refuse_nonfinite: bool = True) -> str:
        """Applies `version` (0: the next one) and returns its weight version string."""
        applied = self.weights.update(getattr(self.model, "load_weights", None), version,
                                      timeout, refuse_nonfinite)
        return weight_version(self.weights.model, applied)

    def destroy(self) -> None:
        """Releases the buffers and the connection; re-homed parameters keep their values."""
        self.weights.release()
        self.client.close()


def init_tensors(settings: Dict[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """Named tensors carrying the receiver's settings: {"model", "params": {name: [shape,
    dtype name]}, "fp8", "fp8_block", "mapping": {"stacked", "experts"}, "storage", "experts",
    "socket"}."""
    data = json.dumps(settings, sort_keys=True).encode()
    return [(INIT_NAME, torch.tensor(list(data), dtype=torch.uint8))]


def version_tensors(version: int = 0) -> List[Tuple[str, torch.Tensor]]:
    """Named tensors asking for `version` (0: the next after the one held)."""
    return [(VERSION_NAME, torch.tensor([int(version)], dtype=torch.int64))]


def _receiver_from(model: torch.nn.Module, data: torch.Tensor) -> RefitWeightReceiver:
    try:
        settings = json.loads(bytes(data.to("cpu", torch.uint8).tolist()).decode())
        params = {n: (shape, _DTYPES[dtype]) for n, (shape, dtype) in
                  settings.pop("params").items()}
        name = settings.pop("model")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{INIT_NAME}: not the receiver's settings ({e!r}); build them with "
                         "refit.sglang.init_tensors") from None
    mapping = FusedMapping.from_dict(settings.pop("mapping", None))
    known = {"fp8", "fp8_block", "socket", "storage", "experts"}
    unknown = set(settings) - known
    if unknown:
        raise ValueError(f"{INIT_NAME}: unknown settings {sorted(unknown)}")
    return RefitWeightReceiver(model, name, params, mapping=mapping, **settings)


def custom_weight_loader(model: torch.nn.Module,
                         named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader signature, `loader(model, named_tensors)`: `refit.init`
    creates the model's receiver (replacing one held), `refit.version` receives a version into
    the model."""
    for name, tensor in named_tensors:
        if name == INIT_NAME:  # bad settings raise and leave the receiver held as it was
            new = _receiver_from(model, tensor)
            old = getattr(model, _ATTRIBUTE, None)
            setattr(model, _ATTRIBUTE, new)
            if old is not None:
                old.destroy()
        elif name == VERSION_NAME:
            receiver = getattr(model, _ATTRIBUTE, None)
            if receiver is None:
                raise RuntimeError(f"{VERSION_NAME} before {INIT_NAME}: send "
                                   "refit.sglang.init_tensors(...) first")
            receiver.receive(int(tensor.reshape(-1)[0].item()))
        else:
            raise ValueError(f"refit.sglang.custom_weight_loader takes {INIT_NAME} and "
                             f"{VERSION_NAME}, not {name!r} (weights come from refitd)")
