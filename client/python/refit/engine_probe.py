"""Where the engine's own loader puts each checkpoint tensor, asked of the loader itself.

`probe(named_parameters, load_weights, tensors)` feeds the engine's `load_weights(weights: Iterable[
tuple[str, Tensor]])` (vLLM's and SGLang's model method) probe tensors of the checkpoint's
names, shapes and dtypes whose values encode each element's index, and reads back where each
element landed in the engine's parameters. Whatever the release does — fused `qkv_proj` with
tensor-parallel heads and replicated KV heads, `gate_up_proj`, vocabulary padding, expert
parallelism, fused experts (`w13_weight`, `w2_weight`, whatever they are called in this
release), fp8 `weight_scale_inv` blocks — the answer is the loader's: nothing here knows a
layer class or a parameter name. A checkpoint tensor whose elements land in a parameter as one
box of the tensor, back to back in the parameter's storage (row-major), is placed there
(`engine_storage.Part` with its box and offset): refit then writes that box in place on every
Apply. Anything else — a loader that transforms values (the probe values come back changed),
permutes or transposes them, writes an element twice — is reported with the reason, and the
tensor goes through `load_weights` per update.

The values are base-16 digits + 1 (1..16: exact in fp8 e4m3fn, bf16, fp16 and fp32, so the
loader's own dtype conversion keeps them); 0 is "not written". One pass per digit, each pass a
`load_weights` call per tensor (so an unknown name or a wrong shape is pinned on that tensor,
and every such mismatch is listed in one error). The parameters' values are saved first and
put back after. Cost: ceil(log16(elements + 1)) passes over the model (7 for a 100 M parameter
model) and an int64 per parameter element while probing; once, at setup.

Not thread-safe; the adapter's thread drives it.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from refit.engine_parts import Part, MappingError

BASE = 16


@dataclass
class Probe:
    """Engine parameter -> the checkpoint boxes in it; checkpoint name -> why not in place;
    names the loader put nowhere on this rank (another rank's experts, or ignored)."""

    placed: Dict[str, List[Part]] = field(default_factory=dict)
    fallback: Dict[str, str] = field(default_factory=dict)
    absent: List[str] = field(default_factory=list)
    touched: List[str] = field(default_factory=list)  # parameters the loader wrote into


def _digits(numel: int) -> int:
    return max(1, math.ceil(math.log(numel + 1, BASE)))


def expert_tensor(name: str) -> bool:
    """A MoE expert's checkpoint tensor: on an expert-parallel rank, the loader may rightly put
    it nowhere (another rank holds that expert)."""
    return ".experts." in name


def probe(named: Dict[str, torch.nn.Parameter], load_weights: Callable,
          tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Probe:
    """Asks `load_weights` where each of `tensors` ({checkpoint name: (shape, dtype)}) lands in
    the parameters `named` ({name: parameter}, the module's named_parameters()). Raises
    MappingError listing every tensor the loader refused (unknown name, wrong shape) before
    returning; the parameters keep their values."""
    names = list(tensors)
    bases: List[int] = []
    total = 0
    for n in names:
        bases.append(total)
        total += math.prod(tensors[n][0])
    passes = _digits(total)
    saved = {n: p.detach().clone() for n, p in named.items()}
    codes = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in named.items()}
    unwritten = {n: torch.zeros(p.numel(), dtype=torch.bool) for n, p in named.items()}
    transformed: Dict[str, str] = {}
    refused: Dict[str, str] = {}
    try:
        for k in range(passes):
            with torch.no_grad():
                for p in named.values():
                    p.data.zero_()
            def values(name, base):
                shape, dtype = tensors[name]
                index = torch.arange(base + 1, base + 1 + math.prod(shape), dtype=torch.int64)
                digit = (index // BASE ** k) % BASE + 1
                return digit.to(torch.float32).reshape(shape).to(dtype)

            batch_ok = False
            try:  # one call with every tensor: the loader's usual pass
                load_weights([(n, values(n, b)) for n, b in zip(names, bases)])
                batch_ok = True
            except Exception:  # tensor by tensor, to pin each refusal on its tensor
                with torch.no_grad():
                    for p in named.values():
                        p.data.zero_()
                for name, base in zip(names, bases):
                    try:
                        load_weights([(name, values(name, base))])
                        why = None
                    except Exception as e:  # the loader's own words, per tensor
                        why = f"{type(e).__name__}: {e}".strip()
                    # A loader that skips names it does not know (SGLang's logs "not found in
                    # params_dict") writes nothing: as much a mismatch, said in the same error.
                    # (Experts may be another rank's: expert parallelism.)
                    with torch.no_grad():
                        wrote = False
                        for p in named.values():
                            if not wrote and bool(p.detach().ne(0).any()):
                                wrote = True
                            p.data.zero_()
                    if why is None and not wrote and not expert_tensor(name):
                        why = "given alone, its loader puts it nowhere (an unknown name?)"
                    if why is not None:
                        refused[name] = why
            if refused:
                break
            if not batch_ok:  # a refusal that did not recur alone: the batch is what failed
                raise MappingError("the engine's load_weights refuses the trainer's checkpoint "
                                   "tensors together but takes each alone")
            for n, p in named.items():
                v = p.detach().reshape(-1).to("cpu", torch.float64)
                bad = (v != v.round()) | (v < 0) | (v > BASE)
                if bool(bad.any()) and n not in transformed:
                    transformed[n] = ("its loader changes the values it is given (a probe "
                                      "value came back as " f"{v[bad][0].item()!r})")
                digit = v.clamp(0, BASE).round().to(torch.int64)
                unwritten[n] |= digit == 0
                codes[n] += (digit - 1).clamp(min=0) * BASE ** k
    finally:
        with torch.no_grad():
            for n, p in named.items():
                p.data.copy_(saved[n])
    if refused:
        raise MappingError(
            f"the engine's load_weights refuses {len(refused)} of the trainer's "
            f"{len(names)} checkpoint tensor(s) (names or shapes that don't match the "
            "engine's model): " + "; ".join(f"{n}: {why}" for n, why in sorted(refused.items())))
    found = _boxes(named, tensors, names, bases, codes, unwritten, transformed)
    if names and not found.touched:
        raise MappingError("the engine's load_weights writes none of the module's parameters "
                           "(probe a module whose parameters it fills, or use a mapping)")
    return found


def _boxes(named, tensors, names, bases, codes, unwritten, transformed) -> Probe:
    out = Probe()
    base_t = torch.tensor(bases, dtype=torch.int64)
    landed: Dict[str, List[Tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for pname, code in codes.items():
        written = ~unwritten[pname]
        if not bool(written.any()):
            continue
        out.touched.append(pname)
        pos = written.nonzero().reshape(-1)
        flat = code[pos] - 1  # the probe's codes are 1-based global element indices
        which = torch.searchsorted(base_t, flat, right=True) - 1
        for t in torch.bincount(which).nonzero().reshape(-1).tolist():
            sel = which == t
            landed.setdefault(names[t], []).append(
                (pname, pos[sel], flat[sel] - bases[t]))
    for name in names:
        where = landed.get(name)
        if not where:
            out.absent.append(name)
            continue
        if len(where) > 1:
            out.fallback[name] = ("its loader writes it into several parameters "
                                  f"({sorted(p for p, _, _ in where)})")
            continue
        pname, pos, idx = where[0]
        if pname in transformed:
            out.fallback[name] = f"engine parameter {pname!r}: {transformed[pname]}"
            continue
        box = _box(tuple(tensors[name][0]), pos, idx)
        if isinstance(box, str):
            out.fallback[name] = f"engine parameter {pname!r}: {box}"
            continue
        offsets, sizes, at = box
        out.placed.setdefault(pname, []).append(
            Part(name, sizes, None, 0, global_shape=tuple(tensors[name][0]), offsets=offsets,
                 element_offset=at))
    return out


def _box(shape: Tuple[int, ...], pos: torch.Tensor, idx: torch.Tensor):
    """(offsets, sizes, first element in the parameter) when the elements `idx` of a tensor of
    `shape` lie at `pos` (ascending) as one box, row-major and back to back; else why not.
    (`idx` equal to the box's enumeration also rules out an element written twice.)"""
    n = pos.numel()
    if int(pos[-1] - pos[0]) + 1 != n:
        return "its elements are not back to back in the parameter (a layout refit can't write)"
    if not shape:
        return ((), (), int(pos[0])) if n == 1 else "a scalar written more than once"
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    multi = torch.stack([(idx // s) % d for s, d in zip(strides, shape)], dim=1)
    lo = multi.min(dim=0).values
    hi = multi.max(dim=0).values
    sizes = tuple(int(h - l + 1) for l, h in zip(lo, hi))
    if math.prod(sizes) != n:
        return "its elements there are not one box of the checkpoint tensor"
    inner = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    k = torch.arange(n, dtype=torch.int64)
    expect = torch.zeros(n, dtype=torch.int64)
    for d in range(len(shape)):
        expect += ((k // inner[d]) % sizes[d] + lo[d]) * strides[d]
    if not torch.equal(expect, idx):
        return "its elements are permuted or transposed in the parameter"
    return tuple(int(x) for x in lo), sizes, int(pos[0])
