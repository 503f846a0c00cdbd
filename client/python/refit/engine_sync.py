"""What the engine adapters (refit.vllm, refit.sglang) share: the engine's weights as refit
DESTINATION memory, and one update — wait for a version, refuse it if it holds inf/NaN values,
Apply it. Zero copy where the engine's parameters allow it (refit.engine_storage: Apply writes
into the parameters, fused `qkv_proj`, `gate_up_proj`, expert `w13`/`w2` and fp8 `weight` +
`weight_scale_inv` included); the rest goes through a buffer in the trainer's checkpoint layout
handed to the engine's own `load_weights(weights: Iterable[tuple[str, Tensor]])`.

fp8 parameters: names listed in `fp8` are registered as fp8 destinations with block scales; the
engine receives `<name>` (e4m3fn bytes, torch.uint8 storage where torch has no float8 dtype) and
`<name>_scale_inv` (FP32 scales), the checkpoint names of DeepSeek-V3-style fp8 weights.

Not thread-safe: one thread drives an EngineWeights.
"""

import logging
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from refit import client as client_lib
from refit import engine_storage
from refit import errors
from refit.mapping import FusedMapping
from refit.buffer import Slice
from refit.v1 import refit_pb2

DESTINATION = refit_pb2.DESTINATION
log = logging.getLogger("refit.engine")


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
    """The engine's weights as refit DESTINATION memory, for `params` {checkpoint name: (shape,
    torch dtype)}.

    `storage` chooses how a version reaches the engine's parameters:
    - "zero_copy": every checkpoint tensor is written by Apply into the engine's own parameter
      storage (`module`'s parameters, through `mapping`; see refit.engine_storage); a tensor
      that cannot be placed is an error (ValueError naming each and why);
    - "auto" (with a `module`): the same where the parameters allow it, the rest through
      `load_weights` (logged, with the reason for each);
    - "load_weights" (the default without a `module`): a buffer in checkpoint layout, handed to
      the engine's `load_weights` after each Apply.
    A mapping that disagrees with the parameters' shapes is refused (MappingError) in both
    zero-copy modes. `experts`: the experts this rank holds (expert parallelism; None: all).

    `layout` says how checkpoint tensors are found in the parameters: "mapping" (the
    FusedMapping tables; the default when a mapping is given) or "probe" (the engine's own
    `load_weights`, given here, is asked where each element lands: refit.engine_probe; needed
    for tensor-parallel shards, padded vocabularies and any engine release's naming). With
    "probe", checkpoint tensors the loader puts nowhere on this rank (another rank's experts)
    are not registered here.
    """

    def __init__(self, client: client_lib.Client, model: str,
                 params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                 fp8: Iterable[str] = (), fp8_block: Sequence[int] = (128, 128),
                 client_name: str = "engine", module: Optional[torch.nn.Module] = None,
                 mapping: Optional[FusedMapping] = None, storage: Optional[str] = None,
                 experts: Optional[Iterable[int]] = None, layout: Optional[str] = None,
                 load_weights=None):
        self.client = client
        self.model = model
        fp8 = set(fp8)
        self.fp8 = fp8
        f8 = getattr(torch, "float8_e4m3fn", None)
        self.fp8_view = f8 if f8 is not None and module is not None and any(
            p.dtype == f8 for p in module.parameters()) else None
        unknown = fp8 - set(params)
        if unknown:
            raise ValueError(f"fp8 names not among the params: {sorted(unknown)}")
        if storage is None:
            storage = "auto" if module is not None else "load_weights"
        if storage not in engine_storage.STORAGE_MODES:
            raise ValueError(f"storage must be one of {engine_storage.STORAGE_MODES}, "
                             f"not {storage!r}")
        if storage != "load_weights" and module is None:
            raise ValueError(f"storage={storage!r} needs the engine's module")
        self.storage = storage
        if layout is None:
            layout = "mapping" if mapping is not None or load_weights is None else "probe"
        if layout not in ("mapping", "probe"):
            raise ValueError(f"layout must be 'mapping' or 'probe', not {layout!r}")
        if layout == "probe" and storage != "load_weights" and load_weights is None:
            raise ValueError("layout='probe' needs the engine's load_weights")
        self.layout = layout
        self.absent: List[str] = []  # checkpoint names this rank's loader puts nowhere
        self.buffers: List = []  # zero-copy buffers: the engine's own parameter storage
        self.fallback = None     # the load_weights buffer, in checkpoint layout
        self.fallback_reasons: Dict[str, str] = {}
        self.version = 0
        self.run = ""            # the trainer's run of `version` (a new run restarts numbers)
        self.rollback = False    # `version` is a rollback target (newer ones held back)
        fp8_block = tuple(int(b) for b in fp8_block)
        try:
            fallback_names = set(params) | {n + "_scale_inv" for n in fp8}
            if storage != "load_weights":
                fallback_names = self._zero_copy(module, mapping or FusedMapping(), params, fp8,
                                                 fp8_block, experts, client_name,
                                                 load_weights)
            tensors: Dict[str, object] = {}
            for name, (shape, dtype) in params.items():
                shape = tuple(int(d) for d in shape)
                if name not in fallback_names:
                    continue
                if name in fp8:
                    grid = tuple(-(-d // b) for d, b in zip(shape, fp8_block))
                    tensors[name + "_scale_inv"] = Slice(sizes=grid, dtype=torch.float32)
                    tensors[name] = Slice(sizes=shape, dtype=torch.uint8,
                                          refit_dtype=refit_pb2.FP8_E4M3,
                                          scale_tensor=name + "_scale_inv",
                                          scale_block=fp8_block)
                else:
                    tensors[name] = Slice(sizes=shape, dtype=dtype)
            if tensors:
                self.fallback = client.register(model, DESTINATION, tensors,
                                                client_name=client_name)
        except BaseException:
            self.release()
            raise

    def _zero_copy(self, module, mapping, params, fp8, fp8_block, experts, client_name,
                   load_weights=None):
        """Registers the placed parameters' storage; returns the checkpoint names left over."""
        named = dict(module.named_parameters())
        if self.layout == "probe":
            result = engine_storage.plan_probed(named, load_weights, params, fp8, fp8_block)
            self.absent = list(result.absent)
            if result.absent:
                log.info("refit: model %s: %d checkpoint tensor(s) are not on this engine rank "
                         "(its loader puts them nowhere here): %s", self.model,
                         len(result.absent), ", ".join(sorted(result.absent)[:8])
                         + (" ..." if len(result.absent) > 8 else ""))
        else:
            result = engine_storage.plan(named, mapping, params, fp8, fp8_block, experts)
        self.fallback_reasons = dict(result.fallback)
        if result.fallback:
            text = engine_storage.describe_fallback(self.model, result.fallback)
            if self.storage == "zero_copy":
                raise ValueError(text.replace("go through the engine's load_weights, not in "
                                              "place", "cannot be written in place "
                                              "(storage='zero_copy')"))
            log.warning("%s", text)
        on_cpu = {t: p for t, p in result.placed.items() if named[t].device.type == "cpu"}
        on_cuda = {t: p for t, p in result.placed.items() if named[t].device.type == "cuda"}
        if on_cpu:
            region, layouts = engine_storage.rehome_cpu(self.model, named, on_cpu)
            self.buffers.append(self.client.register_region(
                self.model, DESTINATION, region, layouts, client_name=client_name))
        if on_cuda:  # only parameters that are on a CUDA device come here
            for region, layouts in engine_storage.cuda_regions(named, on_cuda):
                self.buffers.append(self.client.register_region(
                    self.model, DESTINATION, region, layouts, client_name=client_name))
        placed = sum(len(p) for p in result.placed.values())
        log.info("refit: model %s: %d checkpoint tensor(s) in place in %d engine parameter(s) "
                 "(%d CPU, %d CUDA), %d through load_weights", self.model, placed,
                 len(result.placed), len(on_cpu), len(on_cuda), len(result.fallback))
        # Which checkpoint names and their fp8 weights still need the load_weights buffer.
        return {n for n in result.fallback if n in params}

    def _nonfinite(self, version: int) -> int:
        for m in self.client.status().models:
            if m.model == self.model and m.latest_version == version:
                return m.latest_nonfinite_values
        return 0

    def update(self, load_weights, version: int = 0, timeout: Optional[float] = 60.0,
               refuse_nonfinite: bool = True) -> int:
        """Waits for `version` (0: the newest after the one held), applies it (into the
        engine's parameters where they are registered), and hands what is left to
        `load_weights`; a version holding inf/NaN values is refused before Apply.

        With version 0 it follows the fleet: a rollback (refit Rollback: an older version,
        newer ones held back until Resume) and a trainer's new run or resume from an older
        step (its numbers restart) are applied as they come, never waited past."""
        try:
            return self._update(load_weights, version, timeout, refuse_nonfinite)
        except errors.RefitError as e:  # the parameters hold what they held (atomic Apply)
            # Said in the error's own text (vLLM hands only str(e) back to its caller) and as
            # `held_version`: the engine keeps serving that version; the next update works.
            e.held_version = self.version
            wanted = getattr(e, "version", 0) or version or "the next"
            e.args = (f"{e.args[0] if e.args else e} [refit: model {self.model}: version "
                      f"{wanted} was not applied; the engine still holds version "
                      f"{self.version}]",) + tuple(e.args[1:])
            raise

    def _update(self, load_weights, version, timeout, refuse_nonfinite) -> int:
        wanted = version or self.version + 1
        got = self.client.wait_for_target(self.model, wanted, run=self.run,
                                          applied_version=self.version, timeout=timeout)
        target = version or got.version
        if not version and (got.rollback or got.run != self.run):
            log.info("refit: model %s: %s version %d (run %r)", self.model,
                     "rolling back to" if got.rollback else "following the new run at",
                     got.version, got.run)
        count = self._nonfinite(target)
        if refuse_nonfinite and count:
            raise NonFiniteVersionError(self.model, target, count)
        buffers = self.buffers + ([self.fallback] if self.fallback is not None else [])
        try:
            applied = self.client.apply(self.model, buffers, target)
        except errors.RefitError as e:
            e.version = target
            raise
        if self.fallback is not None:
            load_weights(self.weights())
        self.version = applied.version
        if not version:
            self.run, self.rollback = got.run, got.rollback
        return applied.version

    def weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor viewing the load_weights buffer) for each tensor that
        goes through load_weights (none in zero-copy mode)."""
        if self.fallback is None:
            return iter([])
        # fp8 weights are e4m3fn bytes in uint8 storage: handed over as float8_e4m3fn when the
        # engine holds float8 parameters (vLLM: a uint8 tensor would be converted by value by
        # its copy_), else as the bytes.
        f8 = self.fp8_view
        return iter([(n, t.view(f8) if f8 is not None and n in self.fp8 else t)
                     for n, t in self.fallback.tensors.items()])

    def release(self) -> None:
        """Releases the buffers. Re-homed CPU parameters keep their memory (the mapping lives
        as long as the parameters view it), so the engine keeps serving the last version."""
        buffers, self.buffers = self.buffers, []
        fallback, self.fallback = self.fallback, None
        for b in buffers + ([fallback] if fallback is not None else []):
            b.release()
