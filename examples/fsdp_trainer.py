"""An FSDP2 training loop that publishes its weights to refit after every optimizer step.

Every rank shards a transformers Qwen3 with `fully_shard` (torch 2.x) and hands the sharded
model to `refit.torch.publisher`, which registers each rank's own shard (no copy, no gather,
no hand-written slices); `publish(step)` makes that step's weights the next version.

    torchrun --nproc_per_node=2 examples/fsdp_trainer.py --socket=/tmp/refit/trainer.sock

CPU and gloo here; on GPUs the same code with `init_process_group("nccl")` and the model on
`cuda:LOCAL_RANK` (refit then registers the shards where they are, through CUDA IPC).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import refit
import refit.torch
import qwen3_tiny


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", default=None, help="refitd socket (default $REFIT_SOCKET, "
                        "else /run/refit/refitd.sock)")
    parser.add_argument("--model", default="qwen3-tiny", help="model name in refit")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (= versions)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--digest", action="store_true",
                        help="rank 0 prints a digest of the whole model per version (gathers "
                        "it: for checking, not for training)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = qwen3_tiny.build(seed=0, layers=args.layers, hidden=args.hidden)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # Once, after sharding, on every rank: this rank's shards become SOURCE slices.
    publisher = refit.torch.publisher(refit.Client(args.socket), args.model, model)

    vocab = model.config.vocab_size
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, vocab, (4, 32), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        response = publisher.publish(step)   # refitd snapshots this rank's shards
        line = f"rank {rank}: published version {step} bytes={response.bytes} " \
               f"loss={loss.item():.4f}"
        if args.digest:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if rank == 0:
                line += f" digest={qwen3_tiny.digest(full)}"
        print(line, flush=True)
    if os.environ.get("REFIT_EXAMPLE_HOLD"):  # the test: keep serving until the engine has it
        while not os.path.exists(os.environ["REFIT_EXAMPLE_HOLD"]):
            import time
            time.sleep(0.1)
    publisher.release()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
