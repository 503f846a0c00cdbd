"""Wrong Megatron trainers across 2 ranks for test_megatron.py (BadInputTest): each rank prints
"rank R: ERROR <message>" when refit.torch.publisher(layout="megatron") refuses.

Cases:
- duplicate: parallel_state says TP 1 (both ranks data-parallel replicas) but the ranks hold
  different values: two ranks claiming one shard.
- partial: rank 0's final norm is a DTensor with a Partial placement; rank 1 renames layer 0's
  input norm onto the final norm's name and holds a parameter refit has no name for.
"""

import argparse
import sys

import torch
import torch.distributed as dist

import refit
import refit.torch
import megatron_trainer as mt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--case", required=True, choices=["duplicate", "partial"])
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(rank if args.case == "duplicate" else 0)
    model = mt.build(moe=False, grouped=False)
    rename = None
    if args.case == "partial":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Partial
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if rank == 0:
            norm = model.decoder.final_layernorm
            norm.weight = torch.nn.Parameter(DTensor.from_local(
                norm.weight.detach().clone(), mesh, [Partial()], run_check=False))
        else:
            rename = {"model.layers.0.input_layernorm.weight": "model.norm.weight"}
            model.decoder.layers[1].register_parameter(
                "extra_scale", torch.nn.Parameter(torch.ones(4)))
    client = refit.Client(args.socket)
    try:
        pub = refit.torch.publisher(client, f"bad-{args.case}", model, layout="megatron",
                                    rename=rename)
        pub.publish(1)
        print(f"rank {rank}: published", flush=True)
    except refit.torch.PublisherError as e:
        print(f"rank {rank}: ERROR {e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
