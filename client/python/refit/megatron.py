"""Megatron-core's layout, published under the Hugging Face names engines load:
`refit.torch.publisher(client, model, gpt_model, layout="megatron")`.

Each rank publishes the parameters it holds, as they lie in its memory: no rank gathers
anything, and nothing is copied into a staging buffer. A Megatron parameter becomes one or more
boxes of Hugging Face tensors, each a (possibly strided) view of the parameter's storage, so
refitd's plan on the engine's node picks the rows each engine tensor needs:

| Megatron (per rank)                                    | Hugging Face                         |
|--------------------------------------------------------|--------------------------------------|
| `embedding.word_embeddings.weight` (vocab rows / TP)   | `model.embed_tokens.weight`          |
| `output_layer.weight` (vocab rows / TP)                | `lm_head.weight`                     |
| `decoder.final_layernorm.weight`                       | `model.norm.weight`                  |
| `L.input_layernorm` / `linear_qkv.layer_norm_weight`   | `L.input_layernorm.weight`           |
| `L.self_attention.linear_qkv.{weight,bias}`: per query  | `L.self_attn.{q,k,v}_proj`: one box |
|   group q (heads/groups rows), k, v; groups / TP       |   per local group and part           |
| `L.self_attention.linear_proj.weight` (columns / TP)   | `L.self_attn.o_proj.weight`          |
| `L.self_attention.{q,k}_layernorm.weight`              | `L.self_attn.{q,k}_norm.weight`      |
| `L.pre_mlp_layernorm` / `linear_fc1.layer_norm_weight` | `L.post_attention_layernorm.weight`  |
| `L.mlp.linear_fc1.weight`: [gate / TP; up / TP]        | `L.mlp.{gate,up}_proj.weight`        |
| `L.mlp.linear_fc2.weight` (columns / TP)               | `L.mlp.down_proj.weight`             |
| `L.mlp.router.weight`                                  | `L.mlp.gate.weight`                  |
| SequentialMLP `L.mlp.experts.local_experts.i.linear_fc{1,2}.weight`, TEGroupedMLP          |
|   `L.mlp.experts.linear_fc{1,2}.weight<i>`: local expert i of EP rank r is expert           |
|   r * experts/EP + i; fc1/fc2 split over the expert-TP ranks as above                       |
|                                                        | `L.mlp.experts.<e>.{gate,up,down}_proj.weight` |
| GroupedMLP `L.mlp.experts.weight1` [H, E_local * 2F]: per local expert a [H, 2F] block     |
|   (Megatron's own sharded_state_dict: view(E_local, H, 2F), transposed), so gate and up are |
|   strided, transposed views; `weight2` [E_local * F, H]: view(E_local, F, H), transposed    |
| `L.mlp.shared_experts.linear_fc{1,2}.weight`, `.gate_weight`                                |
|                                                        | `L.mlp.shared_expert.{gate,up,down}_proj.weight`, `L.mlp.shared_expert_gate.weight` |

`L` is the global layer (`TransformerLayer.layer_number - 1`), so pipeline stages and virtual
pipeline chunks (pass the list of chunks) each publish their own layers under the right names.
A tied output layer on the last pipeline stage is the embedding's replica (published once).

Checked against megatron-core's own modules (client/python/tests/test_megatron.py): a
GPTModel built on the CPU gives the same logits as transformers' Qwen3 loaded with what refit
delivered (the q/k/v interleave and the gate/up order), and the GroupedMLP rule is its
`sharded_state_dict` rule. Tensor/expert parallel ranks are read from
`megatron.core.parallel_state` (the groups `initialize_model_parallel` made).
"""

import re
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from refit.entries import (Entry, View, check_tensor, default_name, dtensor_type, overlap, place,
                           rename_fn)

# The per-layer table: Megatron suffix -> (kind, Hugging Face suffix(es)).
_LAYER = {
    "input_layernorm.weight": ("whole", "input_layernorm.weight"),
    "input_layernorm.bias": ("whole", "input_layernorm.bias"),
    "self_attention.linear_qkv.layer_norm_weight": ("whole", "input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_bias": ("whole", "input_layernorm.bias"),
    "self_attention.linear_qkv.weight": ("qkv", "self_attn.{}_proj.weight"),
    "self_attention.linear_qkv.bias": ("qkv", "self_attn.{}_proj.bias"),
    "self_attention.linear_proj.weight": ("tp", "self_attn.o_proj.weight"),
    "self_attention.linear_proj.bias": ("whole", "self_attn.o_proj.bias"),
    "self_attention.q_layernorm.weight": ("whole", "self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": ("whole", "self_attn.k_norm.weight"),
    "pre_mlp_layernorm.weight": ("whole", "post_attention_layernorm.weight"),
    "pre_mlp_layernorm.bias": ("whole", "post_attention_layernorm.bias"),
    "mlp.linear_fc1.layer_norm_weight": ("whole", "post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_bias": ("whole", "post_attention_layernorm.bias"),
    "mlp.linear_fc1.weight": ("glu", "mlp.{}_proj.weight"),
    "mlp.linear_fc2.weight": ("tp", "mlp.down_proj.weight"),
    "mlp.router.weight": ("whole", "mlp.gate.weight"),
    "mlp.shared_experts.linear_fc1.weight": ("glu", "mlp.shared_expert.{}_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": ("tp", "mlp.shared_expert.down_proj.weight"),
    "mlp.shared_experts.gate_weight": ("whole", "mlp.shared_expert_gate.weight"),
}
_TOP = {
    "embedding.word_embeddings.weight": ("tp", "model.embed_tokens.weight"),
    "output_layer.weight": ("tp", "lm_head.weight"),
    "decoder.final_layernorm.weight": ("whole", "model.norm.weight"),
    "decoder.final_layernorm.bias": ("whole", "model.norm.bias"),
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(?P<e>\d+)\.linear_fc(?P<fc>[12])\.weight$")
_TE_GROUPED = re.compile(r"^mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<e>\d+)$")
_GROUPED = re.compile(r"^mlp\.experts\.weight(?P<fc>[12])$")


class Groups:
    """This rank's coordinates in Megatron's parallel groups."""

    def __init__(self, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, etp_rank=0, etp_size=1):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.etp_rank, self.etp_size = etp_rank, etp_size

    @classmethod
    def from_parallel_state(cls) -> "Groups":
        # A Megatron model's process has megatron.core imported already; importing it here for
        # anything else would be slow, and can fail (it imports flashinfer where installed).
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            return cls()

        def get(fn, default):
            try:
                value = getattr(ps, fn)()
            except (AssertionError, AttributeError, RuntimeError):
                return default
            return default if value is None else int(value)

        tp_rank = get("get_tensor_model_parallel_rank", 0)
        tp_size = get("get_tensor_model_parallel_world_size", 1)
        return cls(tp_rank, tp_size,
                   get("get_expert_model_parallel_rank", 0),
                   get("get_expert_model_parallel_world_size", 1),
                   get("get_expert_tensor_parallel_rank", tp_rank),
                   get("get_expert_tensor_parallel_world_size", tp_size))


def _unwrap(module: nn.Module) -> nn.Module:
    """The GPTModel inside Megatron's wrappers (DistributedDataParallel, Float16Module)."""
    while (type(module).__name__ in ("DistributedDataParallel", "Float16Module",
                                     "TorchFullyShardedDataParallel")
           and isinstance(getattr(module, "module", None), nn.Module)):
        module = module.module
    return module


def _tp_views(name, local, tp_rank, tp_size, dim, keep_rows=None) -> List[View]:
    """A tensor split over the TP ranks on `dim`: this rank's part (the padded vocabulary rows
    past `keep_rows` left out)."""
    shape = tuple(local.shape)
    whole = list(shape)
    whole[dim] = shape[dim] * tp_size
    offsets = [0] * len(shape)
    offsets[dim] = shape[dim] * tp_rank
    sizes = list(shape)
    if keep_rows is not None and dim == 0 and keep_rows < whole[0]:
        whole[0] = keep_rows
        sizes[0] = max(0, min(shape[0], keep_rows - offsets[0]))
        if sizes[0] == 0:
            return []
    return [View(name, whole, offsets, sizes)]


def _qkv_views(pattern, local, config, tp_rank, tp_size) -> List[View]:
    """linear_qkv: per local query group, q (heads per group x head dim rows), k, v."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or config.hidden_size // heads
    if heads % groups or groups % tp_size:
        raise ValueError(f"{heads} heads in {groups} query groups over {tp_size} TP ranks")
    per_group = heads // groups
    local_groups = groups // tp_size
    inner = tuple(local.shape[1:])
    row = 1
    for d in inner:
        row *= d
    block = (per_group + 2) * head_dim
    if local.shape[0] != local_groups * block:
        raise ValueError(f"{local.shape[0]} rows, not {local_groups} groups x {block} rows "
                         f"({per_group} heads per group of {head_dim})")
    views = []
    for j in range(local_groups):
        g = tp_rank * local_groups + j
        base = j * block
        views.append(View(pattern.format("q"), (heads * head_dim, *inner),
                          (g * per_group * head_dim,) + (0,) * len(inner),
                          (per_group * head_dim, *inner), base * row))
        views.append(View(pattern.format("k"), (groups * head_dim, *inner),
                          (g * head_dim,) + (0,) * len(inner), (head_dim, *inner),
                          (base + per_group * head_dim) * row))
        views.append(View(pattern.format("v"), (groups * head_dim, *inner),
                          (g * head_dim,) + (0,) * len(inner), (head_dim, *inner),
                          (base + (per_group + 1) * head_dim) * row))
    return views


def _glu_views(pattern, local, tp_rank, tp_size, gated: bool) -> List[View]:
    """linear_fc1 of a gated MLP: this rank's gate rows, then its up rows."""
    if not gated:
        return _tp_views(pattern.format("up"), local, tp_rank, tp_size, 0)
    rows = local.shape[0]
    if rows % 2:
        raise ValueError(f"a gated linear_fc1 has an even number of rows, not {rows}")
    half = rows // 2
    inner = tuple(local.shape[1:])
    row = 1
    for d in inner:
        row *= d
    whole = (half * tp_size, *inner)
    at = (half * tp_rank,) + (0,) * len(inner)
    return [View(pattern.format("gate"), whole, at, (half, *inner), 0),
            View(pattern.format("up"), whole, at, (half, *inner), half * row)]


def _grouped_views(prefix, fc, local, config, groups: Groups, gated: bool) -> List[View]:
    """GroupedMLP's weight1 [H, E_local * 2F] / weight2 [E_local * F, H] (Megatron's
    sharded_state_dict rule: view(E_local, H, 2F) and view(E_local, F, H), each transposed)."""
    hidden = config.hidden_size
    n = local.numel()
    experts = getattr(config, "num_moe_experts", None) or 0
    if not experts or experts % groups.ep_size:
        raise ValueError(f"{experts} experts over {groups.ep_size} EP ranks")
    local_experts = experts // groups.ep_size
    if fc == "1":
        width = n // (local_experts * hidden)  # 2F (gated) or F
        if width * local_experts * hidden != n:
            raise ValueError(f"weight1 of {n} elements is not {local_experts} x {hidden} x F")
        ffn = width // 2 if gated else width
    else:
        ffn = n // (local_experts * hidden)
        width = ffn
    views = []
    for le in range(local_experts):
        e = groups.ep_rank * local_experts + le
        at = (ffn * groups.etp_rank, 0)
        whole = (ffn * groups.etp_size, hidden)
        if fc == "1":
            # [F, H] of expert e: element (f, h) at le*H*width + h*width + f.
            base = le * hidden * width
            parts = (("gate", 0), ("up", ffn)) if gated else (("up", 0),)
            for part, shift in parts:
                views.append(View(f"{prefix}.mlp.experts.{e}.{part}_proj.weight", whole, at,
                                  (ffn, hidden), base + shift, (1, width)))
        else:
            # down_proj [H, F]: element (h, f) at le*F*H + f*H + h.
            views.append(View(f"{prefix}.mlp.experts.{e}.down_proj.weight",
                              (hidden, ffn * groups.etp_size), (0, ffn * groups.etp_rank),
                              (hidden, ffn), le * ffn * hidden, (1, hidden)))
    return views


def views_of(mname: str, local: torch.Tensor, chunk: nn.Module, config, groups: Groups,
             vocab_size: Optional[int] = None) -> Optional[List[View]]:
    """The Hugging Face boxes of one Megatron parameter of `chunk` (None: no rule for it).
    Raises ValueError where the parameter's shape contradicts the config."""
    gated = bool(getattr(config, "gated_linear_unit", False))
    tp, tps = groups.tp_rank, groups.tp_size
    if mname in _TOP:
        kind, hf = _TOP[mname]
        if mname == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights",
                                                      False):
            hf = "model.embed_tokens.weight"  # the tied copy on the last stage: a replica
        if kind == "whole":
            return [View(hf, local.shape, (0,) * local.dim(), local.shape)]
        return _tp_views(hf, local, tp, tps, 0, keep_rows=vocab_size)
    m = _LAYER_NAME.match(mname)
    if not m:
        return None
    index, rest = int(m["i"]), m["rest"]
    layer = chunk.decoder.layers[index]
    prefix = f"model.layers.{int(getattr(layer, 'layer_number', index + 1)) - 1}"
    if rest in _LAYER:
        kind, hf = _LAYER[rest]
        hf = f"{prefix}.{hf}"
        if kind == "whole":
            return [View(hf, local.shape, (0,) * local.dim(), local.shape)]
        if kind == "qkv":
            return _qkv_views(hf, local, config, tp, tps)
        if kind == "glu":
            return _glu_views(hf, local, tp, tps, gated)
        return _tp_views(hf, local, tp, tps, 1 if local.dim() == 2 else 0)
    expert = _SEQUENTIAL.match(rest) or _TE_GROUPED.match(rest)
    if expert:
        experts = getattr(config, "num_moe_experts", None) or 0
        if not experts or experts % groups.ep_size:
            raise ValueError(f"{experts} experts over {groups.ep_size} EP ranks")
        e = groups.ep_rank * (experts // groups.ep_size) + int(expert["e"])
        if expert["fc"] == "1":
            return _glu_views(f"{prefix}.mlp.experts.{e}.{{}}_proj.weight", local,
                              groups.etp_rank, groups.etp_size, gated)
        return _tp_views(f"{prefix}.mlp.experts.{e}.down_proj.weight", local,
                         groups.etp_rank, groups.etp_size, 1)
    grouped = _GROUPED.match(rest)
    if grouped:
        return _grouped_views(prefix, grouped["fc"], local, config, groups, gated)
    return None


def chunks_of(module) -> List[nn.Module]:
    """The model chunks: one GPTModel, or a list of them (virtual pipeline)."""
    if isinstance(module, (list, tuple, nn.ModuleList)):
        return [_unwrap(m) for m in module]
    return [_unwrap(module)]


def collect(module, rename, rank: int, errors: List[str], vocab_size: Optional[int]) -> List:
    """Megatron-core's parameters (one GPTModel or the chunks of a virtual pipeline), each
    with the Hugging Face boxes it holds; refit.entries' entries (the checks of
    refit.torch.publisher). Problems go to `errors`, each naming the parameter and the rank."""
    groups = Groups.from_parallel_state()
    renamed = rename_fn(rename)
    DTensor = dtensor_type()
    chunks = chunks_of(module)
    seen = set()
    boxes: Dict[str, List[Tuple[str, View]]] = {}
    out: List = []
    for index, chunk in enumerate(chunks):
        config = getattr(chunk, "config", None)
        where = f"chunk {index} " if len(chunks) > 1 else ""
        if config is None:
            errors.append(f"rank {rank}: {where}{type(chunk).__name__} has no Megatron "
                          "TransformerConfig (.config); layout='megatron' takes megatron-core "
                          "models (GPTModel)")
            continue
        for prefix, m in chunk.named_modules():
            for attr, tensor in m._parameters.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                fqn = f"{prefix}.{attr}" if prefix else attr
                label = f"{where}{fqn}"
                e = Entry(label, label, m, attr, True, tensor)
                if DTensor is not None and isinstance(tensor, DTensor):
                    e.dtensor = True
                    problem = place(e, rank) or (
                        f"rank {rank}: parameter {label} is a DTensor "
                        f"({tensor._spec.placements}); layout='megatron' takes Megatron's "
                        "own sharding (plain tensors); use layout='hf' for DTensors")
                    errors.append(problem)
                    continue
                problem = check_tensor(e, rank)
                if problem:
                    errors.append(problem)
                    continue
                try:
                    views = views_of(default_name(fqn), tensor, chunk, config, groups,
                                     vocab_size)
                except ValueError as err:
                    errors.append(f"rank {rank}: parameter {label}: {err}")
                    continue
                if views is None:
                    name = renamed(fqn)
                    if name is None:
                        continue
                    if name == fqn or getattr(tensor, "tensor_model_parallel", False):
                        errors.append(
                            f"rank {rank}: parameter {label}: refit has no Hugging Face name "
                            "for this Megatron parameter; name it (whole, not split by tensor "
                            f"parallelism) or leave it out with rename={{{fqn!r}: None}}")
                        continue
                    views = [View(name, tensor.shape, (0,) * tensor.dim(), tensor.shape)]
                else:
                    kept = []
                    for v in views:
                        name = renamed(v.name)
                        if name is None:
                            continue
                        if not isinstance(name, str) or not name:
                            errors.append(f"rank {rank}: rename gave {name!r} for {v.name} "
                                          f"(parameter {label})")
                            continue
                        v.name = name
                        kept.append(v)
                    views = kept
                for v in views:
                    for other, w in boxes.get(v.name, []):
                        if w.global_shape != v.global_shape or overlap(
                                (w.offsets, w.sizes), (v.offsets, v.sizes)):
                            errors.append(
                                f"rank {rank}: parameters {other} and {label} both give "
                                f"{v.name} (offsets {list(w.offsets)} sizes {list(w.sizes)} of "
                                f"{list(w.global_shape)}, and offsets {list(v.offsets)} sizes "
                                f"{list(v.sizes)} of {list(v.global_shape)}); a rename maps "
                                "two parameters to one name?")
                    boxes.setdefault(v.name, []).append((label, v))
                if not views:
                    continue
                e.views = views
                e.local_shape = tuple(tensor.shape)
                e.publishes = True
                e.global_shape, e.offsets, e.sizes = (views[0].global_shape, views[0].offsets,
                                                      views[0].sizes)
                out.append(e)
    return out
