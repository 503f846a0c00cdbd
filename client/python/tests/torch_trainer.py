"""One rank of a torch 2.x trainer for test_torch.py (and bench_torch.py): a tiny Qwen3 (or
Qwen3-MoE) built by transformers from a config with seeded random weights, sharded with FSDP2,
tensor parallel 2 (parallelize_module), or FSDP2 x TP on a 2-D mesh, trained a few AdamW steps on
the CPU over gloo, publishing every step through refit.torch.publisher.

Before publishing version N, rank 0 writes the unsharded model's state_dict (torch's own
get_model_state_dict(full_state_dict=True): DTensor all-gathers, nothing of refit's) to
OUT/v<N>.safetensors: the reference the engine's weights are compared with.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them).
Usage: torch_trainer.py --socket=S --mode={fsdp,tp,fsdp_tp,hf_tp,hf_fsdp_tp,plain} --steps=N
    --out=DIR
"""

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import refit
import refit.torch

VOCAB = 101  # odd: FSDP2's dim-0 shards of the embedding and lm_head are uneven
# transformers' own tensor parallelism gathers lm_head's colwise output: an even vocabulary.
HF_TP_VOCAB = 102
HF_TP_MODES = ("hf_tp", "hf_fsdp_tp")


def vocab_of(mode: str) -> int:
    return HF_TP_VOCAB if mode in HF_TP_MODES else VOCAB


def tiny_config(arch: str, vocab: int = VOCAB):
    if arch == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, tie_word_embeddings=False, max_position_embeddings=64)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, tie_word_embeddings=False, max_position_embeddings=64,
                          decoder_sparse_step=1, mlp_only_layers=[])


def build(arch: str, vocab: int = VOCAB):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab), dtype=torch.float32)
    return model


def build_hf_tp(arch: str, mode: str, world: int, out: str):
    """transformers' own tensor parallelism (`from_pretrained(tp_plan="auto")`, DTensors on
    the TP mesh: Qwen3-MoE's fused experts `gate_up_proj` as _StridedShard(1, sf=2), gate and
    up rows of each rank packed, `down_proj` Shard(2)); hf_fsdp_tp adds FSDP2 over a
    data-parallel mesh dimension. Returns (model, dp_rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    path = os.path.join(out, "checkpoint")
    if dist.get_rank() == 0:
        build(arch, HF_TP_VOCAB).save_pretrained(path)
    dist.barrier()
    if mode == "hf_tp":
        model = AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", device_mesh=init_device_mesh("cpu", (world,)),
            dtype=torch.float32)
        return model, 0
    from transformers.distributed import DistributedConfig
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        distributed_config=DistributedConfig(tp_size=2, fsdp_size=world // 2, tp_plan="auto"))
    return model, model._mesh_manager.get_mesh("fsdp").get_local_rank()


def tp_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i, _ in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        if hasattr(model.model.layers[i].mlp, "gate_proj"):
            plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def shard(model, mode: str, world: int):
    """Returns the data-parallel rank and size (which batches this rank trains on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    rank = dist.get_rank()
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return rank, world
    if mode == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, tp_plan(model))
        return 0, 1
    if mode == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"].get_local_rank(), world // 2
    if mode == "plain":  # every rank holds the whole model (data parallel by hand)
        return rank, world
    raise SystemExit(f"unknown mode {mode}")


def vllm_expert_names(name: str) -> str:
    """transformers 5 keeps a Qwen3-MoE layer's experts fused, `experts.gate_up_proj` [E, 2I, H]
    (gate rows first) and `experts.down_proj` [E, H, I]: vLLM's `w13_weight` and `w2_weight`."""
    return (name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w13_weight")
            .replace(".mlp.experts.down_proj", ".mlp.experts.w2_weight"))


def full_state_dict(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=False))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_moe"])
    ap.add_argument("--mode", default="fsdp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode in HF_TP_MODES:
        model, dp_rank = build_hf_tp(args.arch, args.mode, world, args.out)
    else:
        model = build(args.arch)
        dp_rank, _ = shard(model, args.mode, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = refit.Client(args.socket)
    # Made before the first forward: FSDP2's lazy init (reset_sharded_param) runs after the
    # shards were re-homed, and must leave them where they are (rehomes=0 in the output).
    rename = vllm_expert_names if args.arch == "qwen3_moe" else None
    pub = refit.torch.publisher(client, args.model, model, rename=rename)
    print(f"rank {rank}: publishing {len(pub.names)} tensors", flush=True)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        x = torch.randint(0, vocab_of(args.mode), (2, 12), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = full_state_dict(model)
        if rank == 0:
            from safetensors.torch import save_file
            path = os.path.join(args.out, f"v{step}.safetensors")
            save_file({vllm_expert_names(k): v.detach().contiguous() for k, v in full.items()},
                      path + ".tmp")
            os.rename(path + ".tmp", path)
        dist.barrier()
        response = pub.publish(step)
        print(f"rank {rank}: published version {step} "
              f"bytes={response.bytes if response else 0} loss={loss.item():.4f} "
              f"rehomes={pub.rehomes}", flush=True)
    # Held until the engine has applied the last version (OUT/done), as a trainer that goes on
    # training would: the engine's node pulls the last version's bytes from these ranks'
    # node, and a version whose every SOURCE buffer is released before a node with
    # DESTINATION buffers learnt of it may never complete there.
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
