"""refit as vLLM's weight-transfer backend `refit` (the engine side of vLLM's weight-transfer
API, `vllm.distributed.weight_transfer.base.WeightTransferEngine`, vLLM 0.33:
`init_transfer_engine(init_info)`, `start_weight_update()`, `update_weights(update_info)` ->
`receive_weights(...)`, `finish_weight_update()`, `shutdown()`), pulling by version from the
node's refitd. vLLM finds it through the `vllm.general_plugins` entry point of
client/python/pyproject.toml (`register()` adds "refit" to vLLM's WeightTransferEngineFactory;
`VllmRefitEngine` is this class as a subclass of vLLM's base, made on first use so importing
this module needs no vLLM).

Zero copy where the model's parameters allow it (`storage="auto"`, the default): the parameters
themselves are refit DESTINATION memory, so `update_weights` is an Apply and nothing else —
vLLM's "engines that apply weights in place" case, whose start/finish phases are no-ops. Inside
vLLM (no `mapping` given) each checkpoint tensor's place is asked of the model's own
`load_weights` (`layout="probe"`, refit.engine_probe): every TP rank finds its own shards of
fused qkv / gate_up, row-parallel columns, padded vocabulary rows, expert shards and fp8 scale
rows. Outside vLLM a `mapping` (refit.mapping.FusedMapping tables) does it. What cannot be placed,
or everything with `storage="load_weights"`, goes through the model's own `load_weights`
(refit.engine_storage, docs/engines.md). Tested against vLLM 0.33.0's own model classes on the
CPU (client/python/tests/test_vllm.py, test_vllm_tp.py).

    engine = RefitWeightTransferEngine(config=None, vllm_config=None, device="cpu", model=model)
    engine.init_transfer_engine(engine.parse_init_info({
        "model": "policy", "params": {...}, "fp8": [...],
        "mapping": {"stacked": [["qkv_proj", ["q_proj", "k_proj", "v_proj"]], ...],
                    "experts": [["experts.w13_weight", ["gate_proj", "up_proj"]], ...]}}))
    engine.start_weight_update(); engine.update_weights({"version": 7});
    engine.finish_weight_update()

`sync(...)` is the RL-framework side: pause generation, update, resume, and the weight version
string to tag rollouts with.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from refit import client as client_lib
from refit.engine_storage import MappingError
from refit.engine_sync import EngineWeights, NonFiniteVersionError, weight_version
from refit.mapping import FusedMapping

__all__ = ["RefitInitInfo", "RefitUpdateInfo", "RefitWeightTransferEngine", "sync", "register",
           "check_release", "TESTED_RELEASES",
           "MappingError", "NonFiniteVersionError", "weight_version", "adapter", "VllmAdapter"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class RefitInitInfo:
    """`params`: {checkpoint name: [shape, dtype name]}; `fp8`: names quantized with scales;
    `mapping`: {"stacked": [[fused, [parts]]], "experts": [[fused, [parts]]]} (FusedMapping);
    `storage`: "auto" | "zero_copy" | "load_weights"; `experts`: this rank's experts (EP)."""

    model: str
    params: Dict[str, List[Any]]
    fp8: List[str] = field(default_factory=list)
    fp8_block: List[int] = field(default_factory=lambda: [128, 128])
    socket: Optional[str] = None
    mapping: Optional[Dict[str, List[Any]]] = None
    storage: str = "auto"
    experts: Optional[List[int]] = None
    # "probe": ask the model's load_weights where each tensor lands (the default inside vLLM,
    # without a mapping: TP shards, padded vocabularies, any release's naming); "mapping":
    # the FusedMapping tables (the default elsewhere)
    layout: Optional[str] = None
    check_release: bool = True    # refuse a vLLM release this adapter was not tested with


@dataclass
class RefitUpdateInfo:
    version: int = 0  # 0: the next version after the one held
    timeout: float = 60.0
    refuse_nonfinite: bool = True


class RefitWeightTransferEngine:
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    def __init__(self, config: Any = None, vllm_config: Any = None,
                 device: Any = "cpu", model: Optional[torch.nn.Module] = None):
        self.config = config
        self.vllm_config = vllm_config
        self.device = device
        self.model = model
        self.client: Optional[client_lib.Client] = None
        self.weights: Optional[EngineWeights] = None
        self.updating = False

    def parse_init_info(self, init_dict: Dict[str, Any]) -> RefitInitInfo:
        try:
            return RefitInitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def parse_update_info(self, update_dict: Dict[str, Any]) -> RefitUpdateInfo:
        try:
            return RefitUpdateInfo(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        if init_info.check_release:
            check_release()
        unknown = sorted({dtype for _, dtype in init_info.params.values()} - set(_DTYPES))
        if unknown:
            raise ValueError(f"init_info params: dtype(s) {unknown} are not among "
                             f"{sorted(_DTYPES)}")
        params = {name: (shape, _DTYPES[dtype]) for name, (shape, dtype) in
                  init_info.params.items()}
        storage = init_info.storage if self.model is not None else "load_weights"
        mapping = (FusedMapping.from_dict(init_info.mapping)
                   if init_info.mapping is not None else None)
        load_weights = getattr(self.model, "load_weights", None)
        layout = init_info.layout
        if layout is None:
            layout = "probe" if (self.vllm_config is not None and mapping is None
                                 and load_weights is not None) else "mapping"
        self.client = client_lib.Client(init_info.socket)
        try:
            self.weights = EngineWeights(
                self.client, init_info.model, params, init_info.fp8, init_info.fp8_block,
                client_name=f"vllm-tp{_tp_rank()}", module=self.model, mapping=mapping,
                storage=storage, experts=init_info.experts, layout=layout,
                load_weights=load_weights)
        except BaseException:
            self.client.close()
            self.client = None
            raise

    def start_weight_update(self) -> None:
        self.updating = True

    def update_weights(self, update_info) -> None:
        """vLLM's payload: one update_info dict, or a list of them (applied in order)."""
        for info in update_info if isinstance(update_info, list) else [update_info]:
            self.receive_weights(self.parse_update_info(info))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        if self.weights is None or self.model is None:
            raise RuntimeError("init_transfer_engine first, with a model")
        self.weights.update(getattr(self.model, "load_weights", None), update_info.version,
                            update_info.timeout, update_info.refuse_nonfinite)

    def finish_weight_update(self) -> None:
        self.updating = False

    @property
    def zero_copy(self) -> bool:
        """True when every tensor is written in place (no load_weights call per update)."""
        return bool(self.weights and self.weights.buffers and self.weights.fallback is None)

    @property
    def weight_version(self) -> str:
        return weight_version(self.weights.model, self.weights.version) if self.weights else ""

    def shutdown(self) -> None:
        if self.weights:
            self.weights.release()
            self.weights = None
        if self.client:
            self.client.close()
            self.client = None


# vLLM releases this adapter was run against (docs/engines.md): its weight-transfer API,
# plugin entry points and the model classes its tests build.
TESTED_RELEASES = ("0.33",)


def check_release(version: Optional[str] = None) -> None:
    """Refuses a vLLM release this adapter was not tested with (ValueError naming it)."""
    if version is None:
        try:
            import vllm
        except ImportError:
            return  # not inside vLLM (a model of vLLM's layout driven directly)
        version = vllm.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_RELEASES:
        raise ValueError(f"vLLM {version} is not a release refit.vllm was tested with "
                         f"({', '.join(v + '.x' for v in TESTED_RELEASES)}): its parameter "
                         "layout and weight-transfer API are unverified; pass "
                         "check_release=False in init_info to use it anyway")


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # not inside a vLLM worker with model parallel state
        return 0


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point (client/python/pyproject.toml): registers
    this engine as the weight-transfer backend `refit` in vLLM's WeightTransferEngineFactory.
    vLLM loads general plugins in every process, possibly more than once: idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    try:
        WeightTransferEngineFactory.register_engine("refit", __name__, "VllmRefitEngine")
    except ValueError:  # already registered (plugins load once per process, or again)
        pass


_vllm_engine_class = None


def __getattr__(name: str):
    """`VllmRefitEngine`: RefitWeightTransferEngine as a subclass of vLLM's own
    WeightTransferEngine, made on first use so that importing refit.vllm needs no vLLM."""
    global _vllm_engine_class
    if name in ("adapter", "VllmAdapter"):  # LoRA adapters as refit models (refit.vllm_lora)
        from refit import vllm_lora
        return getattr(vllm_lora, name)
    if name != "VllmRefitEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _vllm_engine_class is None:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
        _vllm_engine_class = type("VllmRefitEngine",
                                  (RefitWeightTransferEngine, WeightTransferEngine),
                                  {"__module__": __name__,
                                   "__doc__": RefitWeightTransferEngine.__doc__})
    return _vllm_engine_class


def sync(engine: RefitWeightTransferEngine, version: int = 0,
         pause: Optional[Callable[[], None]] = None,
         resume: Optional[Callable[[], None]] = None) -> str:
    """One RL step's weight sync: pause generation, the four phases, resume; returns the
    weight version string. Resumes even when the update fails."""
    if pause:
        pause()
    try:
        engine.start_weight_update()
        engine.update_weights({"version": version})
        engine.finish_weight_update()
    finally:
        if resume:
            resume()
    return engine.weight_version
