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
each worker pulls the version from its node's refitd.

Inside SGLang (the model is one of SGLang's model classes and no `mapping` is given) the
receiver finds where each checkpoint tensor lands by asking the model's own `load_weights`
(`layout="probe"`, refit.engine_probe: TP shards, padded vocabularies, fused experts, fp8 block
scales), registers as client `sglang-tp<rank>`, refuses an SGLang release it was not tested
with (`TESTED_RELEASES`; `check_release=False` overrides), and after each version calls the
model's `post_load_weights()` where it has one (SGLang's DeepSeek-V2/V3 derive the MLA
`w_kc`/`w_vc` from `kv_b_proj` there; its `load_weights` calls it too). Tested against SGLang
0.5.23's own model classes on the CPU, driven through its WeightUpdater
(client/python/tests/test_sglang.py, docs/engines.md).
"""

import json
import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from refit import client as client_lib
from refit.engine_storage import MappingError
from refit.engine_sync import EngineWeights, NonFiniteVersionError, weight_version
from refit.mapping import FusedMapping
from refit.v1 import refit_pb2

__all__ = ["RefitWeightReceiver", "MappingError", "NonFiniteVersionError",
           "custom_weight_loader", "init_tensors", "version_tensors", "check_release",
           "last_error", "held_versions",
           "TESTED_RELEASES"]

# SGLang releases whose model classes, weight loaders and WeightUpdater this adapter was tested
# with (a prefix of sglang.__version__).
TESTED_RELEASES = ("0.5.23",)

INIT_NAME = "refit.init"        # uint8 tensor: the receiver's settings as UTF-8 JSON
VERSION_NAME = "refit.version"  # int64 [1]: the version to receive (0: the next one)
_ATTRIBUTE = "_refit_receiver"  # where the custom loader keeps a model's receiver
_ERROR_ATTRIBUTE = "_refit_last_error"  # the custom loader's last failure (None: none)
log = logging.getLogger("refit.engine")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class RefitWeightReceiver:
    def __init__(self, model: torch.nn.Module, model_name: str,
                 params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                 fp8: Iterable[str] = (), fp8_block: Sequence[int] = (128, 128),
                 socket: Optional[str] = None, mapping: Optional[FusedMapping] = None,
                 storage: str = "auto", experts: Optional[Iterable[int]] = None,
                 layout: Optional[str] = None, check_release: bool = True,
                 timeout: Optional[float] = 60.0):
        inside = _is_sglang_model(model)
        if inside and check_release:
            globals()["check_release"]()
        load_weights = getattr(model, "load_weights", None)
        if layout is None:
            layout = "probe" if inside and mapping is None and load_weights else "mapping"
        self.model = model
        self.timeout = timeout  # the custom loader's wait for a version (None: no limit)
        self.client = client_lib.Client(socket)
        try:
            self.weights = EngineWeights(
                self.client, model_name, params, fp8, fp8_block,
                client_name=f"sglang-tp{_tp_rank()}" if inside else "sglang", module=model,
                mapping=mapping, storage=storage, experts=experts, layout=layout,
                load_weights=load_weights if layout == "probe" else None)
            self._post_load()  # a probe ran the loader: derived tensors follow the weights
        except BaseException:
            self.client.close()
            raise

    @property
    def zero_copy(self) -> bool:
        """True when every tensor is written in place (no load_weights call per receive)."""
        return bool(self.weights.buffers) and self.weights.fallback is None

    def receive(self, version: int = 0, timeout: Optional[float] = 60.0,
                refuse_nonfinite: bool = True) -> str:
        """Applies `version` (0: the next one) and returns its weight version string.

        A failed update (a refitd error: no such version by the deadline, a refused or failed
        Apply; or NonFiniteVersionError) raises with the parameters as they were: its
        `held_version` is the version the engine still holds (also `self.version`), and the
        next receive works."""
        applied = self.weights.update(getattr(self.model, "load_weights", None), version,
                                      timeout, refuse_nonfinite)
        self._post_load()
        return weight_version(self.weights.model, applied)

    @property
    def version(self) -> int:
        """The refit version the model holds (0: none received)."""
        return self.weights.version

    def _post_load(self) -> None:
        """The model's own post-processing of written weights (SGLang's DeepSeek: MLA
        `w_kc`/`w_vc` from `kv_b_proj`), after Apply wrote parameters in place."""
        post = getattr(self.model, "post_load_weights", None)
        if self.weights.buffers and callable(post):
            post()

    def destroy(self) -> None:
        """Releases the buffers and the connection; re-homed parameters keep their values."""
        self.weights.release()
        self.client.close()


def check_release(version: Optional[str] = None) -> None:
    """Refuses an SGLang release outside TESTED_RELEASES (ValueError naming it)."""
    if version is None:
        import sglang
        version = sglang.__version__
    if not any(version == v or version.startswith(v + ".") for v in TESTED_RELEASES):
        raise ValueError(f"refit.sglang: SGLang {version} is not a tested release "
                         f"({', '.join(TESTED_RELEASES)}): its parameter layout and weight "
                         "loaders are unverified; pass check_release=False to use it anyway")


def _is_sglang_model(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("sglang.")


def _tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel
        return int(get_parallel().tp_rank)
    except Exception:  # not inside an SGLang worker with its parallel state
        return 0


def init_tensors(settings: Dict[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """Named tensors carrying the receiver's settings: {"model", "params": {name: [shape,
    dtype name]}, "fp8", "fp8_block", "mapping": {"stacked", "experts"}, "storage", "experts",
    "socket", "layout", "check_release", "timeout" (s to wait for a version; default 60)}."""
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
    mapping = settings.pop("mapping", None)  # none: the probe inside SGLang
    mapping = FusedMapping.from_dict(mapping) if mapping is not None else None
    known = {"fp8", "fp8_block", "socket", "storage", "experts", "layout", "check_release",
             "timeout"}
    unknown = set(settings) - known
    if unknown:
        raise ValueError(f"{INIT_NAME}: unknown settings {sorted(unknown)}")
    return RefitWeightReceiver(model, name, params, mapping=mapping, **settings)


def custom_weight_loader(model: torch.nn.Module,
                         named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader signature, `loader(model, named_tensors)`: `refit.init`
    creates the model's receiver (replacing one held), `refit.version` receives a version into
    the model.

    It never raises: SGLang 0.5.23 calls a custom loader inside its scheduler's event loop with
    no handler (ModelRunner's WeightUpdater.update_weights_from_tensor), so an exception there
    ends the scheduler and takes the engine down. A failure — bad settings (one MappingError
    listing every mismatch), a version that does not arrive, a failed Apply, an inf/NaN
    version — is logged (logger `refit.engine`, ERROR, with the version the engine still
    holds) and kept: `last_error(model)`; the parameters hold what they held, the receiver
    (if any) stays, and the next update works. The version each engine rank holds is also in
    its node's refitd: `held_versions(client, model_name)`."""
    try:
        _load(model, named_tensors)
        setattr(model, _ERROR_ATTRIBUTE, None)
    except Exception as e:  # noqa: BLE001 (see above: never into SGLang's event loop)
        receiver = getattr(model, _ATTRIBUTE, None)
        held = receiver.version if receiver is not None else 0
        setattr(model, _ERROR_ATTRIBUTE, e)
        log.error("refit.sglang: weight update failed; the engine keeps serving the weights it "
                  "holds (refit version %d): %s: %s", held, type(e).__name__, e)


def last_error(model: torch.nn.Module) -> Optional[Exception]:
    """The error of the model's last custom_weight_loader call (None: it succeeded)."""
    return getattr(model, _ERROR_ATTRIBUTE, None)


def held_versions(client: client_lib.Client, model_name: str) -> Dict[str, int]:
    """{engine client name ("sglang-tp0", ...): the version its DESTINATION buffers hold
    entirely} on the node `client` talks to (refitd's Status: a failed Apply leaves it as it
    was). From the RL framework, after an update: every rank should hold the version sent."""
    held: Dict[str, int] = {}
    for m in client.status().models:
        if m.model != model_name:
            continue
        for b in m.buffers:
            if b.role == refit_pb2.DESTINATION and b.client.startswith("sglang"):
                held[b.client] = min(held.get(b.client, b.applied_version), b.applied_version)
    return held


def _load(model: torch.nn.Module, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
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
            receiver.receive(int(tensor.reshape(-1)[0].item()), receiver.timeout)
        else:
            raise ValueError(f"refit.sglang.custom_weight_loader takes {INIT_NAME} and "
                             f"{VERSION_NAME}, not {name!r} (weights come from refitd)")
