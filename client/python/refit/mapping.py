"""Declarative name/shape mapping between a trainer's checkpoint tensors and an engine's fused
parameters, the way vLLM's and SGLang's `load_weights` map checkpoint names onto fused
parameters (their "stacked params" and "expert params" tables):

    mapping = refit.mapping.FusedMapping(
        stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                 ("gate_up_proj", ["gate_proj", "up_proj"])],
        experts=[("experts.w13_weight", ["gate_proj", "up_proj"]),
                 ("experts.w2_weight", ["down_proj"])])

`layout(checkpoint_shapes, dtype, experts=range(...))` gives the DESTINATION tensors in an order
where every fused parameter's parts lie back to back (q, k, v; per expert: gate, up), so that
after registering them `fused_views(buffer)` returns the engine's fused parameters as views of
the buffer — Apply writes them in place, no `load_weights` copy. Per-expert checkpoint tensors
(`...mlp.experts.<e>.gate_proj.weight`) map into a fused `[E, 2I, H]` `w13`; an expert-parallel
rank lists only its experts (`experts=`), and its fused tensor holds those, in order. (A trainer
holding fused `[E, ., .]` tensors instead registers them whole or sliced on dim 0; refit plans
between the two sides by name and box, so nothing here is needed on that side.)

Pure functions over names and shapes; thread-safe.
"""

import math
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from refit.buffer import Slice

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<part>[A-Za-z0-9_]+)\.weight$")


class FusedMapping:
    def __init__(self, stacked: Sequence[Tuple[str, Sequence[str]]] = (),
                 experts: Sequence[Tuple[str, Sequence[str]]] = ()):
        self.stacked = [(fused, list(parts)) for fused, parts in stacked]
        self.experts = [(fused, list(parts)) for fused, parts in experts]

    def _fused_of(self, name: str) -> Optional[Tuple[str, int]]:
        """(fused engine name, part index) of a stacked checkpoint name, or None."""
        for fused, parts in self.stacked:
            for i, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), i
        return None

    def _expert_of(self, name: str) -> Optional[Tuple[str, int, int]]:
        """(fused engine name, expert, part index) of a per-expert checkpoint name, or None."""
        m = _EXPERT.match(name)
        if not m:
            return None
        for fused, parts in self.experts:
            if m["part"] in parts:
                base = m["prefix"][: -len(".experts")]
                return f"{base}.{fused}", int(m["e"]), parts.index(m["part"])
        return None

    def layout(self, shapes: Dict[str, Sequence[int]], dtype: torch.dtype,
               experts: Optional[Iterable[int]] = None) -> Dict[str, Slice]:
        """Checkpoint tensors ordered so that each fused parameter's parts are consecutive;
        experts not in `experts` (None: all) are left out."""
        keep = None if experts is None else set(experts)
        groups: Dict[str, List[Tuple[Tuple[int, int], str]]] = {}
        order: List[str] = []
        for name in shapes:
            fused = self._fused_of(name)
            expert = self._expert_of(name)
            if expert is not None:
                target, e, i = expert
                if keep is not None and e not in keep:
                    continue
                key = (e, i)
            elif fused is not None:
                target, i = fused
                key = (0, i)
            else:
                target, key = name, (0, 0)
            if target not in groups:
                groups[target] = []
                order.append(target)
            groups[target].append((key, name))
        out: Dict[str, Slice] = {}
        for target in order:
            for _, name in sorted(groups[target]):
                out[name] = Slice(sizes=tuple(shapes[name]), dtype=dtype)
        return out

    def fused_views(self, buffer) -> Dict[str, torch.Tensor]:
        """Engine parameter name -> a view of the registered buffer (fused where mapped)."""
        parts: Dict[str, List[Tuple[Tuple[int, int], str]]] = {}
        for name in buffer.tensors:
            expert = self._expert_of(name)
            fused = self._fused_of(name)
            if expert is not None:
                target, e, i = expert
                parts.setdefault(target, []).append(((e, i), name))
            elif fused is not None:
                target, i = fused
                parts.setdefault(target, []).append(((0, i), name))
            else:
                parts.setdefault(name, []).append(((0, 0), name))
        views = {}
        for target, members in parts.items():
            members.sort()
            lays = [buffer.layouts[n] for _, n in members]
            expert = self._expert_of(members[0][1])
            if len(lays) == 1 and expert is None:
                views[target] = buffer.tensors[members[0][1]]
                continue
            at = lays[0].buffer_offset
            for lay in lays:
                if lay.buffer_offset != at or not lay.whole:
                    raise ValueError(f"{target}: its parts are not back to back in the buffer "
                                     "(a part whose size is not a multiple of the alignment?)")
                at += lay.nbytes
            flat = buffer.region.bytes.narrow(0, lays[0].buffer_offset,
                                              at - lays[0].buffer_offset).view(lays[0].dtype)
            inner = tuple(lays[0].sizes[1:])
            if expert is not None:
                count = len({key[0] for key, _ in members})
                views[target] = flat.view(count, -1, *inner)
            else:
                views[target] = flat.view(-1, *inner)
        return views
