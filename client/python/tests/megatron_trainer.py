"""One rank of a megatron-core trainer for test_megatron.py: a tiny GPTModel (Qwen3-like: RMSNorm,
q/k norms, SwiGLU, grouped-query attention; or MoE with 4 experts) built on the CPU by
megatron-core itself (use_cpu_initialization, parallel_state on gloo), sharded by Megatron's own
tensor / pipeline / expert parallelism, stepped a few times with AdamW, and published every step
through refit.torch.publisher(layout="megatron").

Before publishing version N, rank 0 writes OUT/v<N>.safetensors: the unsharded model under the
Hugging Face names, made here without refit: every rank's parameters all-gathered, joined along
Megatron's partition dimension, then converted by Megatron's rules (qkv rows per query group
[q heads, k, v]; fc1 per TP rank [gate; up]; GroupedMLP weight1.view(E, H, 2F) transposed).

Modes: tp (TP 2, 2 query groups per rank), pp (2 stages), ep (EP 2, SequentialMLP), grouped
(EP 2, GroupedMLP's weight1/weight2), tp_ep (TP 2 x EP 2 on 4 ranks, experts split by expert TP).
Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import argparse
import os
import re
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import refit
import refit.torch

VOCAB, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, EXPERTS, MOE_FFN, LAYERS = (
    96, 64, 8, 4, 8, 96, 4, 32, 2)
MODES = {  # mode: (tp, pp, ep, moe, grouped, world)
    "tp": (2, 1, 1, False, False, 2),
    "pp": (1, 2, 1, False, False, 2),
    "vpp": (1, 2, 1, False, False, 2),  # and 2 virtual stages: 4 layers, 2 chunks per rank
    "ep": (1, 1, 2, True, False, 2),
    "grouped": (1, 1, 2, True, True, 2),
    "tp_ep": (2, 1, 2, True, False, 4),
}
VIRTUAL = {"vpp": 2}


def layers_of(mode: str) -> int:
    return LAYERS * VIRTUAL.get(mode, 1)


def config(moe: bool, grouped: bool = False, tp: int = 1, pp: int = 1, ep: int = 1,
           vpp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig
    extra = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                 expert_model_parallel_size=ep, pipeline_dtype=torch.float32)
    if moe:
        extra.update(num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=2,
                     moe_grouped_gemm=grouped)
    return TransformerConfig(
        num_layers=LAYERS * vpp, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True,
        params_dtype=torch.float32, layernorm_epsilon=1e-6, init_method_std=0.2, **extra)


def build(moe: bool, grouped: bool, pre_process: bool = True, post_process: bool = True,
          tp: int = 1, pp: int = 1, ep: int = 1, vpp: int = 1, vp_stage=None,
          vocab: int = VOCAB):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    if grouped:  # GroupedMLP's kernels are for GPUs; its parameters are built on the CPU
        from megatron.core.transformer.moe import grouped_gemm_util
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None,
                                    moe_grouped_gemm=grouped, qk_layernorm=True,
                                    normalization="RMSNorm")
    return GPTModel(config=config(moe, grouped, tp, pp, ep, vpp), transformer_layer_spec=spec, vocab_size=vocab,
                    max_sequence_length=64, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    vp_stage=vp_stage)


def hf_shapes(moe: bool, layers: int = LAYERS):
    """The Hugging Face tensors of the model (what the engine loads)."""
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
           "model.norm.weight": (HIDDEN,)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (HIDDEN,),
                    p + "post_attention_layernorm.weight": (HIDDEN,),
                    p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.k_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
                    p + "self_attn.v_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                    p + "self_attn.q_norm.weight": (HEAD_DIM,),
                    p + "self_attn.k_norm.weight": (HEAD_DIM,)})
        if moe:
            out[p + "mlp.gate.weight"] = (EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (MOE_FFN, HIDDEN)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (MOE_FFN, HIDDEN)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (HIDDEN, MOE_FFN)
        else:
            out[p + "mlp.gate_proj.weight"] = (FFN, HIDDEN)
            out[p + "mlp.up_proj.weight"] = (FFN, HIDDEN)
            out[p + "mlp.down_proj.weight"] = (HIDDEN, FFN)
    return out


# ---- the reference: Megatron's shards joined and converted, no refit code ----

def rank_state(chunks, groups):
    """What this rank holds: {megatron name with global layer / expert: (tensor, dim)}, where
    dim is Megatron's partition dimension (None: not split by tensor parallelism)."""
    from megatron.core import parallel_state as ps
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    etp = ps.get_expert_tensor_parallel_rank()
    out = {}
    for model, name, p in [(c, n, p) for c in chunks for n, p in c.named_parameters()]:
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            layer = model.decoder.layers[int(m[1])].layer_number - 1
            name = f"decoder.layers.{layer}.{m[2]}"
        e = re.search(r"local_experts\.(\d+)\.", name)
        split_rank = tp
        if e:
            name = name.replace(f"local_experts.{e[1]}.",
                                f"local_experts.{ep * EXPERTS // groups['ep'] + int(e[1])}.")
            split_rank = etp
        if name.endswith("experts.weight1") or name.endswith("experts.weight2"):
            name = f"{name}@ep{ep}"
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        out[name] = (p.detach().clone(), dim, split_rank)
    return out


def reference(states, moe: bool):
    """The unsharded Hugging Face state_dict from every rank's rank_state()."""
    joined = {}
    for state in states:
        for name, (t, dim, split_rank) in state.items():
            joined.setdefault(name, {})[split_rank] = (t, dim)
    full = {}
    for name, parts in joined.items():
        ranks = sorted(parts)
        dim = parts[ranks[0]][1]
        if dim is None or len(ranks) == 1:
            full[name] = (parts[ranks[0]][0], [parts[ranks[0]][0]])
        else:
            full[name] = (torch.cat([parts[r][0] for r in ranks], dim),
                          [parts[r][0] for r in ranks])
    hf = {}
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "output_layer.weight": "lm_head.weight",
           "decoder.final_layernorm.weight": "model.norm.weight"}
    per_group = HEADS // GROUPS
    for name, (t, shards) in full.items():
        if name in top:
            hf[top[name]] = t
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        p, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "self_attention.linear_qkv.weight":
            qkv = t.view(GROUPS, per_group + 2, HEAD_DIM, HIDDEN)
            hf[p + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, HIDDEN)
            hf[p + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, HIDDEN)
            hf[p + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, HIDDEN)
        elif rest.endswith("linear_fc1.weight"):  # each TP rank's rows: [gate; up]
            gate = torch.cat([s.chunk(2)[0] for s in shards])
            up = torch.cat([s.chunk(2)[1] for s in shards])
            e = re.search(r"local_experts\.(\d+)\.", rest)
            q = p + (f"mlp.experts.{e[1]}." if e else "mlp.")
            hf[q + "gate_proj.weight"], hf[q + "up_proj.weight"] = gate, up
        elif rest.endswith("linear_fc2.weight"):
            e = re.search(r"local_experts\.(\d+)\.", rest)
            hf[p + (f"mlp.experts.{e[1]}." if e else "mlp.") + "down_proj.weight"] = t
        elif "experts.weight1@ep" in rest or "experts.weight2@ep" in rest:
            ep = int(rest.rsplit("@ep", 1)[1])
            local = EXPERTS // 2
            if "weight1" in rest:  # Megatron's GroupedMLP.sharded_state_dict: [E, H, 2F]^T
                w = t.view(local, HIDDEN, -1).transpose(1, 2)
                for i in range(local):
                    gate, up = w[i].chunk(2)
                    hf[p + f"mlp.experts.{ep * local + i}.gate_proj.weight"] = gate
                    hf[p + f"mlp.experts.{ep * local + i}.up_proj.weight"] = up
            else:  # [E, F, H]^T
                w = t.view(local, -1, HIDDEN).transpose(1, 2)
                for i in range(local):
                    hf[p + f"mlp.experts.{ep * local + i}.down_proj.weight"] = w[i]
        else:
            table = {"input_layernorm.weight": "input_layernorm.weight",
                     "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                     "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                     "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                     "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                     "mlp.router.weight": "mlp.gate.weight"}
            hf[p + table[rest]] = t
    return {k: v.contiguous() for k, v in hf.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", default="megatron-tiny")
    ap.add_argument("--mode", default="tp", choices=sorted(MODES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tp, pp, ep, moe, grouped, _ = MODES[args.mode]

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from megatron.core import parallel_state as ps
    vpp = VIRTUAL.get(args.mode, 1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    torch.manual_seed(1234)
    if vpp > 1:  # a virtual pipeline: this rank's chunks, published as one list
        chunks = [build(moe, grouped, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                        ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), tp=tp,
                        pp=pp, ep=ep, vpp=vpp, vp_stage=v) for v in range(vpp)]
        model = torch.nn.ModuleList(chunks)
    else:
        chunks = [build(moe, grouped, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), tp=tp, pp=pp, ep=ep)]
        model = chunks[0]
    with torch.no_grad():  # distinct experts and norms (CPU init makes every EP rank's alike)
        ep_rank = ps.get_expert_model_parallel_rank()
        for name, p in model.named_parameters():
            if "experts" in name:
                g = torch.Generator().manual_seed(7 + 1000 * ep_rank + len(name))
                p.add_(torch.randn(p.shape, generator=g))
            elif "layernorm" in name:
                p.add_(0.1 * torch.arange(p.numel(), dtype=p.dtype).view(p.shape))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = refit.Client(args.socket)
    pub = refit.torch.publisher(client, args.model, chunks if vpp > 1 else model,
                                layout="megatron")
    layers = sorted({int(n.split(".")[2]) for n in pub.names if n.startswith("model.layers.")})
    print(f"rank {rank}: publishing {len(pub.slices())} slices of {len(pub.names)} tensors, "
          f"layers {layers}", flush=True)
    for step in range(1, args.steps + 1):
        # An AdamW step on a gradient that is a function of the weights (replicas stay equal).
        for p in model.parameters():
            p.grad = torch.sin(3.0 * p.detach() + step)
        opt.step()
        opt.zero_grad()
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, rank_state(chunks, {"ep": ep}))
        if rank == 0:
            from safetensors.torch import save_file
            path = os.path.join(args.out, f"v{step}.safetensors")
            save_file(reference(states, moe), path + ".tmp")
            os.rename(path + ".tmp", path)
        dist.barrier()
        response = pub.publish(step)
        print(f"rank {rank}: published version {step} "
              f"bytes={response.bytes if response else 0} rehomes={pub.rehomes}", flush=True)
    done = os.path.join(args.out, "done")
    for _ in range(1200):
        if os.path.exists(done):
            break
        time.sleep(0.1)
    pub.release()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
