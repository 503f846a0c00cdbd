"""Each version of a refit LoRA adapter model (refit.lora) loaded into vLLM's LoRA slots,
through vLLM 0.33's own adapter machinery, without a file and without a restart:

    adapter = refit.vllm.adapter(client, "policy-lora", lora_manager, lora_id=1)
    adapter.update()                         # newest version: Apply, then into a LoRA slot
    llm_request_lora = adapter.lora_request()   # vllm.lora.request.LoRARequest for requests

`lora_manager` is the engine's LoRA model manager (vllm.lora.model_manager.LoRAModelManager,
made by vLLM for a model served with `enable_lora=True`), or the worker's WorkerLoRAManager
(`model_runner.lora_manager`), whose `_adapter_manager` it is; call it in the worker process
that holds the model (as refit.vllm's weight-transfer engine runs there), e.g. through
`collective_rpc`.

Per version:
1. (below, 2. first) wait for the version on this node; read its labels (refit.lora.AdapterConfig: rank, alpha,
   targets, dtype);
2. the first time (from the metadata of the newest version announced to this node: a node
   pulls a model for its DESTINATION buffers), register one DESTINATION buffer holding every A and B the targets give on
   the engine's model (the LoRA-wrapped layers vLLM made: q/k/v inside `qkv_proj`, gate/up
   inside `gate_up_proj`, their sizes from the base layers), named as peft saves them;
3. Apply the version into it (refitd: deltas, verification, relays as for any model);
4. vLLM's `LoRAModel.from_lora_tensors` over those tensors (A zero-copy; B copied, because
   vLLM folds alpha / r into B in place when it packs qkv / gate_up), then the manager's
   `remove_adapter` (when an older version is loaded) + `add_adapter` + `activate_adapter`
   (`set_lora` copies each layer's A and B into its stacked slot tensors) and `pin_adapter`
   (an LRU manager never evicts it: it has no path to reload from).

Requests name the adapter with `lora_request()` (LoRARequest(lora_int_id=lora_id,
lora_path="refit://MODEL")): the worker finds the id loaded and never reads the path.

Refused, nothing loaded: a version without LoRA metadata, a target naming no LoRA layer of the
engine's model (refit.InvalidArgumentError), a version whose rank, targets or dtype differ from
the buffer registered for the adapter (refit.FailedPreconditionError: a new adapter model), a
rank above the engine's max_lora_rank.
"""

import time
from typing import Dict, List, Optional, Tuple

import torch

from refit import DESTINATION, errors
from refit.lora import PEFT_PREFIX, AdapterConfig, newest_labels

_WHAT = "refit.vllm.adapter"


def layer_shapes(manager) -> Dict[str, Tuple[int, List[Tuple[str, int]]]]:
    """Each LoRA-wrapped layer of vLLM's model: module path -> (input size, [(HF module name,
    output size), ...]) (packed layers: one entry per packed member)."""
    packed = getattr(manager, "packed_modules_mapping", {}) or {}
    out = {}
    for path, module in manager.modules.items():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(base, "input_size"):
            continue  # embeddings, heads: refit.lora publishes linear layers
        prefix, _, leaf = path.rpartition(".")
        members = packed.get(leaf, [leaf])
        sizes = list(getattr(base, "output_sizes", None) or [base.output_size])
        if len(sizes) != len(members):
            continue
        out[path] = (int(base.input_size),
                     [((prefix + "." if prefix else "") + m, int(s))
                      for m, s in zip(members, sizes)])
    return out


def adapter_tensors(manager, config: AdapterConfig) -> Dict[str, Tuple[int, ...]]:
    """The A and B tensors (peft names -> shape) the adapter `config` has on this engine."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    matched = set()
    for _path, (in_size, members) in layer_shapes(manager).items():
        for name, out_size in members:
            for t in config.targets:
                if name == t or name.endswith("." + t):
                    matched.add(t)
                    shapes[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (config.rank, in_size)
                    shapes[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (out_size, config.rank)
    unknown = [t for t in config.targets if t not in matched]
    if unknown:
        raise errors.InvalidArgumentError(
            f"target(s) {unknown} name no LoRA layer of the engine's model "
            f"({sorted({m.rsplit('.', 1)[-1] for _, ms in layer_shapes(manager).values() for m, _ in ms})})",
            what=_WHAT)
    return shapes


class VllmAdapter:
    """The versions of adapter model `model` in slot `lora_id` of vLLM's LoRA manager."""

    def __init__(self, client, model: str, lora_manager, *, lora_id: int = 1,
                 client_name: Optional[str] = None, pin: bool = True):
        if lora_id < 1:
            raise ValueError(f"lora_id {lora_id}: vLLM's LoRA ids start at 1")
        self.client = client
        self.model = model
        self.manager = getattr(lora_manager, "_adapter_manager", lora_manager)
        self.lora_id = lora_id
        self.client_name = client_name or "vllm-lora"
        self.pin = pin
        self.config: Optional[AdapterConfig] = None
        self.buffer = None
        self.version = 0          # the version loaded (0: none yet)
        self.labels: Dict[str, str] = {}
        # Seconds of the last update: "wait", "register" (first version), "apply", "load".
        self.timings: Dict[str, float] = {}

    def _labels(self, version: int) -> Dict[str, str]:
        for m in self.client.status().models:
            if m.model == self.model:
                for v in m.version_labels:
                    if v.version == version:
                        return dict(v.labels)
        return {}

    def update(self, version: int = 0, timeout: Optional[float] = 60.0) -> int:
        """Loads `version` (0: the newest complete on this node, waiting for one) into the
        adapter's LoRA slot; returns the version loaded."""
        clock = time.perf_counter
        t0 = clock()
        if self.buffer is None:
            self._register_first(timeout)
        t1 = clock()
        newest = self.client.wait_for_version(self.model, max(1, version), timeout=timeout)
        version = version or newest
        t2 = clock()
        labels = self._labels(version)
        config = AdapterConfig.from_labels(labels, f"adapter model {self.model} version "
                                                   f"{version}")
        self._check_rank(config, version)
        if (config.rank, config.targets, config.dtype) != (
                self.config.rank, self.config.targets, self.config.dtype):
            raise errors.FailedPreconditionError(
                f"adapter model {self.model} version {version}: rank {config.rank}, targets "
                f"{list(config.targets)}, dtype {config.dtype}, but its earlier versions have "
                f"rank {self.config.rank}, targets {list(self.config.targets)}, dtype "
                f"{self.config.dtype}: a new adapter model; nothing loaded", what=_WHAT)
        self.client.apply(self.model, [self.buffer], version)
        t3 = clock()
        self._load(config)
        t4 = clock()
        self.version, self.labels = version, labels
        self.timings = {"register": t1 - t0, "wait": t2 - t1, "apply": t3 - t2, "load": t4 - t3}
        return version

    def _check_rank(self, config: AdapterConfig, version: int) -> None:
        max_rank = getattr(getattr(self.manager, "lora_config", None), "max_lora_rank", None)
        if max_rank is not None and config.rank > max_rank:
            raise errors.FailedPreconditionError(
                f"adapter model {self.model} version {version}: rank {config.rank} is above "
                f"the engine's max_lora_rank {max_rank}; nothing loaded", what=_WHAT)

    def _register_first(self, timeout: Optional[float]) -> None:
        """The DESTINATION buffer, shaped by the metadata of the newest version this node
        heard announced (a node pulls a model only for its DESTINATION buffers)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            version, labels = newest_labels(self.client, self.model)
            if version:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise errors.DeadlineExceededError(
                    f"adapter model {self.model}: no version announced on this node within "
                    f"{timeout} s", what=_WHAT)
            time.sleep(0.05)
        config = AdapterConfig.from_labels(labels, f"adapter model {self.model} version "
                                                   f"{version}")
        self._check_rank(config, version)
        shapes = adapter_tensors(self.manager, config)
        self.buffer = self.client.register(
            self.model, DESTINATION,
            {n: torch.zeros(s, dtype=config.torch_dtype()) for n, s in shapes.items()},
            client_name=self.client_name)
        self.config = config

    def _load(self, config: AdapterConfig) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        # vLLM folds alpha / r into B in place (LoRALayerWeights.optimize) when it packs
        # q/k/v or gate/up: B goes as a copy, so the DESTINATION buffer keeps the version's
        # bytes (refitd verifies them, and may use them as the next delta's base).
        tensors = {n: (t.clone() if n.endswith(".lora_B.weight") else t)
                   for n, t in self.buffer.tensors.items()}
        peft = PEFTHelper.from_dict({"r": config.rank, "lora_alpha": config.alpha,
                                     "target_modules": list(config.targets)})
        lora_dtype = getattr(getattr(self.manager, "lora_config", None), "lora_dtype", None)
        lora = LoRAModel.from_lora_tensors(
            self.lora_id, tensors, peft, device=str(self.manager.device),
            dtype=lora_dtype if isinstance(lora_dtype, torch.dtype) else None)
        if self.lora_id in self.manager.list_adapters():
            self.manager.remove_adapter(self.lora_id)
        self.manager.add_adapter(lora)
        self.manager.activate_adapter(self.lora_id)
        if self.pin and hasattr(self.manager, "_pin_lora_in_cpu_cache"):
            self.manager.pin_adapter(self.lora_id)

    def lora_request(self):
        """vLLM's LoRARequest naming this adapter (its int id; the path is never read)."""
        from vllm.lora.request import LoRARequest
        return LoRARequest(lora_name=self.model, lora_int_id=self.lora_id,
                           lora_path=f"refit://{self.model}")

    def release(self) -> None:
        """Releases the DESTINATION buffer (the adapter stays loaded in vLLM)."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


def adapter(client, model: str, lora_manager, *, lora_id: int = 1,
            client_name: Optional[str] = None) -> VllmAdapter:
    """A VllmAdapter (see the module docstring)."""
    return VllmAdapter(client, model, lora_manager, lora_id=lora_id, client_name=client_name)
