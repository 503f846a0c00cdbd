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

# Per-expert checkpoint names: "<prefix>.experts.<e>.<part>.weight" and, for fp8 checkpoints,
# its "...weight_scale_inv" (into the fused "<fused>_scale_inv", vLLM's `w13_weight_scale_inv`).
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<part>[A-Za-z0-9_]+)"
                     r"\.weight(?P<suffix>_scale_inv)?$")


class FusedMapping:
    def __init__(self, stacked: Sequence[Tuple[str, Sequence[str]]] = (),
                 experts: Sequence[Tuple[str, Sequence[str]]] = ()):
        self.stacked = [(fused, list(parts)) for fused, parts in stacked]
        self.experts = [(fused, list(parts)) for fused, parts in experts]

    @classmethod
    def from_dict(cls, spec: Optional[Dict[str, Sequence]]) -> "FusedMapping":
        """From JSON-able tables: {"stacked": [[fused, [parts...]], ...], "experts": [...]}
        (None or {}: no fused parameters, every checkpoint name is a parameter name)."""
        spec = dict(spec or {})
        unknown = set(spec) - {"stacked", "experts"}
        if unknown:
            raise ValueError(f"a mapping has 'stacked' and 'experts' tables, not {sorted(unknown)}")
        try:
            return cls(stacked=[(str(f), [str(p) for p in parts])
                                for f, parts in spec.get("stacked", ())],
                       experts=[(str(f), [str(p) for p in parts])
                                for f, parts in spec.get("experts", ())])
        except (TypeError, ValueError) as e:
            raise ValueError(f"a mapping table row is [fused name, [part names]]: {e}") from None

    def to_dict(self) -> Dict[str, List]:
        return {"stacked": [[f, list(p)] for f, p in self.stacked],
                "experts": [[f, list(p)] for f, p in self.experts]}

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
                return (f"{base}.{fused}{m['suffix'] or ''}", int(m["e"]),
                        parts.index(m["part"]))
        return None

    def parts(self, names: Iterable[str], experts: Optional[Iterable[int]] = None
              ) -> Dict[str, List[Tuple[str, Optional[int]]]]:
        """Engine parameter name -> its checkpoint parts in storage order, each with the index of
        its expert inside the fused parameter (None where the parameter is not per expert):
        stacked parts in the table's order (q, k, v), expert parts by expert and then in the
        table's order (gate, up). Experts not in `experts` (None: all) are left out; a kept
        expert's index counts only kept experts (an expert-parallel rank's local index)."""
        keep = None if experts is None else set(experts)
        groups: Dict[str, List[Tuple[Tuple[int, int], str]]] = {}
        is_expert: Dict[str, bool] = {}
        for name in names:
            expert = self._expert_of(name)
            if expert is not None:
                target, e, i = expert
                if keep is not None and e not in keep:
                    continue
                key = (e, i)
            else:
                fused = self._fused_of(name)
                target, key = (fused[0], (0, fused[1])) if fused else (name, (0, 0))
            groups.setdefault(target, []).append((key, name))
            is_expert[target] = expert is not None
        out: Dict[str, List[Tuple[str, Optional[int]]]] = {}
        for target, members in groups.items():
            members.sort()
            if is_expert[target]:
                local = {e: i for i, e in enumerate(sorted({key[0] for key, _ in members}))}
                out[target] = [(name, local[key[0]]) for key, name in members]
            else:
                out[target] = [(name, None) for _, name in members]
        return out

    def layout(self, shapes: Dict[str, Sequence[int]], dtype: torch.dtype,
               experts: Optional[Iterable[int]] = None) -> Dict[str, Slice]:
        """Checkpoint tensors ordered so that each fused parameter's parts are consecutive;
        experts not in `experts` (None: all) are left out."""
        out: Dict[str, Slice] = {}
        for members in self.parts(shapes, experts).values():
            for name, _ in members:
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
