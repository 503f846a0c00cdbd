"""Zero copy for the engine adapters: the engine's own parameter storage registered as refit
DESTINATION memory, so that Apply writes each version straight into the parameters the engine
serves from — no `load_weights` call, no Python-side copy.

`plan(...)` places every checkpoint tensor (`q_proj`, `experts.3.up_proj`, an fp8 `weight` and
its `weight_scale_inv`) at its rows of the engine parameter it is fused into, through a
`refit.mapping.FusedMapping`; a tensor whose parameter cannot take it in place (no such
parameter, not contiguous, a dtype refit does not carry, a device that is neither CPU nor CUDA)
is left to the engine's `load_weights`, with the reason. A mapping whose parts do not add up to
the parameter's shape is refused (MappingError): that is a wrong table, not a storage limit.

Where the storage lives:
- CPU parameters: torch's CPU storage is ordinary heap memory refitd cannot map, so
  `rehome_cpu(...)` moves the placed parameters, once, into one sealed memfd (one per model and
  engine rank): the current values are copied in and each `param.data` becomes a view of the
  mapping. The parameter objects stay the same (the engine's modules keep holding them); their
  `data_ptr()` changes once, here, and never again.
- CUDA parameters: registered where they are, through a CUDA IPC handle of the cudaMalloc block
  holding them (one buffer per block; `cuda_regions(...)`). This path is only taken for
  parameters on a CUDA device, and it was not run here (no GPU): only its handle building is
  tested, with fakes (client/python/tests/test_zero_copy.py).

Not thread-safe; the adapter's thread drives it.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from refit import dtypes
from refit import engine_probe
from refit import memory
from refit.buffer import SliceLayout
from refit.engine_parts import MappingError, Part  # noqa: F401 (re-exported)
from refit.mapping import FusedMapping
from refit.v1 import refit_pb2

log = logging.getLogger("refit.engine")

STORAGE_MODES = ("auto", "zero_copy", "load_weights")
ALIGNMENT = 64  # where each re-homed CPU parameter starts in the memfd


@dataclass
class Plan:
    """Engine parameter name -> its parts (zero copy); checkpoint name -> why not (fallback)."""

    placed: Dict[str, List[Part]] = field(default_factory=dict)
    fallback: Dict[str, str] = field(default_factory=dict)
    absent: List[str] = field(default_factory=list)  # not on this engine rank (probe)


def checkpoint_tensors(params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                       fp8: Sequence[str], fp8_block: Sequence[int]
                       ) -> Dict[str, Tuple[Tuple[int, ...], bool, str]]:
    """{checkpoint name: (shape, is an fp8 weight, its scale tensor)}, with the fp8 weights'
    `<name>_scale_inv` FP32 scale tensors added (shape: the block grid)."""
    out: Dict[str, Tuple[Tuple[int, ...], bool, str]] = {}
    for name, (shape, _) in params.items():
        shape = tuple(int(d) for d in shape)
        if name in fp8:
            grid = tuple(-(-d // b) for d, b in zip(shape, fp8_block))
            out[name + "_scale_inv"] = (grid, False, "")
            out[name] = (shape, True, name + "_scale_inv")
        else:
            out[name] = (shape, False, "")
    return out


def _float8_dtypes() -> Tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n))


def _storage_problem(param, fp8_weight: bool, scale: bool) -> Optional[str]:
    """Why `param` cannot be refit DESTINATION memory, or None."""
    if param.device.type not in ("cpu", "cuda"):
        return f"it lives on {param.device}, neither CPU nor CUDA memory"
    if not param.is_contiguous():
        return "it is not contiguous"
    if fp8_weight:
        if param.dtype not in (torch.uint8,) + _float8_dtypes():
            return f"an fp8 weight held as {param.dtype}, not e4m3fn bytes (uint8/float8_e4m3fn)"
        return None
    if scale and param.dtype != torch.float32:
        return f"a block-scale tensor held as {param.dtype}, not float32"
    try:
        dtypes.to_refit(param.dtype)
    except (KeyError, ValueError, TypeError):
        return f"refit does not carry its dtype {param.dtype}"
    if not param.dtype.is_floating_point:
        return f"its dtype {param.dtype} is not a float type refit converts into"
    return None


def plan(params_of_module: Dict[str, torch.Tensor], mapping: FusedMapping,
         params: Dict[str, Tuple[Sequence[int], torch.dtype]], fp8: Sequence[str] = (),
         fp8_block: Sequence[int] = (128, 128), experts=None) -> Plan:
    """Places each checkpoint tensor in the engine parameter the mapping fuses it into."""
    fp8 = set(fp8)
    tensors = checkpoint_tensors(params, fp8, fp8_block)
    groups = mapping.parts(tensors, experts)
    result = Plan()
    mismatches: List[str] = []
    for target, members in groups.items():
        names = [n for n, _ in members]
        param = params_of_module.get(target)
        if param is None:
            for n in names:
                result.fallback[n] = (f"no engine parameter {target!r} (the mapping does not "
                                      "cover it)")
            continue
        fp8_weight = any(tensors[n][1] for n in names)
        scale = any(n.endswith("_scale_inv") for n in names)
        problem = _storage_problem(param, fp8_weight, scale)
        if problem:
            for n in names:
                result.fallback[n] = f"engine parameter {target!r}: {problem}"
            continue
        try:
            result.placed[target] = _parts(target, tuple(param.shape), members, tensors,
                                           fp8_block)
        except MappingError as e:
            mismatches.append(str(e))
    if mismatches:
        raise MappingError("the mapping does not fit the engine's parameters: "
                           + "; ".join(mismatches))
    _pair_scales(result)
    return result


def _pair_scales(result) -> None:
    """A weight and its scale tensor go together (the scale lives in the weight's buffer):
    when one of them goes through load_weights, so does the other."""
    moved = True
    while moved:
        moved = False
        for target, parts in list(result.placed.items()):
            for p in parts:
                if p.scale_tensor and p.scale_tensor in result.fallback:
                    why = f"its scale tensor {p.scale_tensor!r} goes through load_weights"
                elif p.name.endswith("_scale_inv") and p.name[:-len("_scale_inv")] in \
                        result.fallback:
                    why = "its fp8 weight goes through load_weights"
                else:
                    continue
                for q in result.placed.pop(target):
                    result.fallback[q.name] = f"engine parameter {target!r}: {why}"
                moved = True
                break


def plan_probed(params_of_module: Dict[str, torch.Tensor], load_weights,
                params: Dict[str, Tuple[Sequence[int], torch.dtype]], fp8: Sequence[str] = (),
                fp8_block: Sequence[int] = (128, 128)):
    """Places each checkpoint tensor where the engine's own `load_weights` puts it
    (refit.engine_probe): TP shards, padded vocabularies, fused experts of any naming. Raises
    MappingError listing every checkpoint tensor the loader refuses and every engine parameter
    no checkpoint tensor reaches, before anything is registered."""

    fp8 = set(fp8)
    tensors = checkpoint_tensors(params, fp8, fp8_block)
    f8 = _float8_dtypes()
    kinds = {}
    for name, (shape, is_fp8, _) in tensors.items():
        if is_fp8:
            kinds[name] = (shape, f8[0] if f8 else torch.uint8)
        elif name.endswith("_scale_inv") and name[:-len("_scale_inv")] in fp8:
            kinds[name] = (shape, torch.float32)
        else:
            kinds[name] = (shape, params[name][1])
    found = engine_probe.probe(params_of_module, load_weights, kinds)
    result = Plan(fallback=dict(found.fallback))
    result.absent = list(found.absent)
    reached = set(found.touched)
    # Scalars no checkpoint holds (vLLM's attention q/k/v/prob_scale of an fp8 model, 1.0 by
    # default) keep their values; a tensor parameter nothing reaches is a model mismatch.
    missing = sorted(n for n, p in params_of_module.items()
                     if n not in reached and p.numel() > 1)
    unset = sorted(n for n, p in params_of_module.items() if n not in reached and p.numel() <= 1)
    if unset:
        log.info("refit: %d scalar engine parameter(s) no checkpoint tensor sets keep their "
                 "values: %s", len(unset), ", ".join(unset[:8]) + (" ..." if len(unset) > 8
                                                                   else ""))
    # A loader that skips names it does not know (SGLang) puts a misspelt one nowhere; only an
    # expert may rightly be elsewhere (expert parallelism).
    nowhere = sorted(n for n in found.absent if not engine_probe.expert_tensor(n))
    problems = []
    if nowhere:
        problems.append(f"{len(nowhere)} of the trainer's {len(params)} checkpoint tensor(s) "
                        "land in no engine parameter (names the engine's loader skips): "
                        + ", ".join(nowhere))
    if missing:
        problems.append(
            f"{len(missing)} engine parameter(s) get no value from any of the trainer's "
            f"{len(params)} checkpoint tensor(s) (names that don't match the engine's model): "
            + ", ".join(missing))
    if problems:
        raise MappingError("; ".join(problems))
    for target, parts in found.placed.items():
        param = params_of_module[target]
        names = [p.name for p in parts]
        is_fp8 = any(tensors[n][1] for n in names)
        scale = any(n.endswith("_scale_inv") and n[:-len("_scale_inv")] in fp8 for n in names)
        problem = _storage_problem(param, is_fp8, scale)
        if problem:
            for n in names:
                result.fallback[n] = f"engine parameter {target!r}: {problem}"
            continue
        result.placed[target] = [
            dataclasses.replace(p, refit_dtype=refit_pb2.FP8_E4M3, scale_tensor=tensors[p.name][2],
                                scale_block=tuple(int(b) for b in fp8_block))
            if tensors[p.name][1] else p for p in parts]
    _pair_scales(result)
    return result


def _parts(target: str, shape: Tuple[int, ...], members, tensors, fp8_block) -> List[Part]:
    """The parts of `target` with their rows; MappingError where they don't add up."""
    out: List[Part] = []
    per_expert = members[0][1] is not None
    rows: Dict[Optional[int], int] = {}
    for name, expert in members:
        sizes, is_fp8, scale = tensors[name]
        inner = shape[1:] if per_expert else shape
        if tuple(sizes[1:]) != tuple(inner[1:]) or len(sizes) != len(inner):
            raise MappingError(
                f"engine parameter {target!r} {list(shape)}: its part {name!r} {list(sizes)} "
                f"does not fit (trailing dimensions differ)")
        row = rows.get(expert, 0)
        out.append(Part(name, tuple(sizes), expert, row,
                        refit_pb2.FP8_E4M3 if is_fp8 else None, scale,
                        tuple(int(b) for b in fp8_block) if is_fp8 else ()))
        rows[expert] = row + sizes[0]
    if per_expert:
        if len(rows) != shape[0] or any(r != shape[1] for r in rows.values()):
            raise MappingError(
                f"engine parameter {target!r} {list(shape)}: the mapping gives it {len(rows)} "
                f"expert(s) of {sorted(set(rows.values()))} rows "
                f"({[n for n, _ in members]}), not {shape[0]} of {shape[1]}")
    elif rows[None] != shape[0]:
        hint = (" (fused block scales need every part's rows to be a multiple of the block)"
                if target.endswith("_scale_inv") else "")
        raise MappingError(
            f"engine parameter {target!r} {list(shape)}: its parts "
            f"{[n for n, _ in members]} add up to {rows[None]} rows, not {shape[0]}{hint}")
    return out


def _byte_offset(shape: Sequence[int], element_size: int, part: Part) -> int:
    """Bytes from a contiguous parameter's start to the part's first element."""
    if part.element_offset is not None:
        return part.element_offset * element_size
    if part.expert is not None:
        index = part.expert * math.prod(shape[1:]) + part.row * math.prod(shape[2:])
    else:
        index = part.row * math.prod(shape[1:])
    return index * element_size


def _layout(part: Part, param, buffer_offset: int) -> SliceLayout:
    nbytes = math.prod(part.sizes) * param.element_size()
    whole = part.global_shape or part.sizes
    offsets = part.offsets or (0,) * len(part.sizes)
    return SliceLayout(part.name, param.dtype, tuple(whole), tuple(offsets), part.sizes,
                       buffer_offset, nbytes, part.refit_dtype, part.scale_tensor,
                       part.scale_block)


def rehome_cpu(model: str, params_of_module: Dict[str, torch.Tensor],
               placed: Dict[str, List[Part]]) -> Tuple[memory.MemfdRegion, List[SliceLayout]]:
    """Moves the placed CPU parameters into one new memfd (values kept, `param.data` pointed at
    it) and returns the region and the checkpoint tensors' layouts in it."""
    slots, end = {}, 0
    for target in placed:
        param = params_of_module[target]
        start = -(-end // ALIGNMENT) * ALIGNMENT
        slots[target] = start
        end = start + param.numel() * param.element_size()
    region = memory.MemfdRegion(end, label=f"refit-{model}-engine")
    layouts: List[SliceLayout] = []
    with torch.no_grad():
        for target, parts in placed.items():
            param = params_of_module[target]
            nbytes = param.numel() * param.element_size()
            view = region.bytes.narrow(0, slots[target], nbytes).view(param.dtype)
            view = view.view(param.shape)
            view.copy_(param.data)
            param.data = view
            for part in parts:
                offset = slots[target] + _byte_offset(param.shape, param.element_size(), part)
                layouts.append(_layout(part, param, offset))
    return region, layouts


class EngineCudaRegion(memory.CudaIpcBlock):
    """Part of a cudaMalloc block the engine owns, holding parameters refit writes in place.
    Nothing is allocated or freed here: the engine's allocator owns the memory."""

    bytes = None  # no byte view: the parameters themselves are the tensors

    def __init__(self, device: int, handle: bytes, offset: int, size: int, device_uuid: str):
        self._set_block(device, handle, offset, size, device_uuid)

    def close(self) -> None:
        pass  # the engine's parameters: theirs to free

    def describe(self) -> str:
        return (f"cuda:{self.device} engine parameters ({self.size} bytes at offset "
                f"{self.offset} of an IPC block)")


def cuda_regions(params_of_module: Dict[str, torch.Tensor], placed: Dict[str, List[Part]],
                 block_of: Optional[Callable] = None,
                 uuid_of: Optional[Callable[[int], str]] = None
                 ) -> List[Tuple[EngineCudaRegion, List[SliceLayout]]]:
    """One region per cudaMalloc block holding placed CUDA parameters, spanning them, with the
    checkpoint tensors' layouts relative to it. `block_of(param)` -> (device, handle, block
    address); the default asks torch (memory.torch_cuda_block), tests pass fakes."""
    block_of = block_of or memory.torch_cuda_block  # looked up now: tests patch it
    if uuid_of is None:
        def uuid_of(device: int) -> str:
            return memory.gpu_uuid(torch.cuda.get_device_properties(device))
    blocks: Dict[Tuple[int, bytes], List[Tuple[int, Part, torch.Tensor]]] = {}
    for target, parts in placed.items():
        param = params_of_module[target]
        device, handle, base = block_of(param)
        start = param.data_ptr() - base
        for part in parts:
            at = start + _byte_offset(param.shape, param.element_size(), part)
            blocks.setdefault((device, handle), []).append((at, part, param))
    out = []
    for (device, handle), members in blocks.items():
        lo = min(at for at, _, _ in members)
        hi = max(at + math.prod(p.sizes) * t.element_size() for at, p, t in members)
        region = EngineCudaRegion(device, handle, lo, hi - lo, uuid_of(device))
        out.append((region, [_layout(p, t, at - lo) for at, p, t in members]))
    return out


def describe_fallback(model: str, fallback: Dict[str, str]) -> str:
    lines = [f"refit: model {model}: {len(fallback)} checkpoint tensor(s) go through the "
             "engine's load_weights, not in place:"]
    lines += [f"  {name}: {why}" for name, why in sorted(fallback.items())]
    return "\n".join(lines)
