"""One rank of a deliberately wrong trainer for test_torch.py: prints the PublisherError each
rank gets ("rank R: ERROR <message>") or what it published.

--case=overlap: every rank places its own random tensor on a mesh of its own rank only, so
each claims all of it, with other values (equal values would be replicas: published once). --case=versions: rank R publishes version 1 + R.
Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import refit
import refit.torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--case", required=True, choices=["overlap", "versions"])
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = torch.nn.Linear(8, 6, bias=False)
    torch.manual_seed(rank)
    if args.case == "overlap":
        own = DeviceMesh("cpu", [rank])  # a mesh of this rank alone: it holds the whole weight
        local = torch.randn(6, 8)
        module.weight = torch.nn.Parameter(DTensor.from_local(local, own, [Shard(0)]))
    else:
        mesh = DeviceMesh("cpu", list(range(world)))
        local = torch.randn(6 // world, 8)
        module.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    client = refit.Client(args.socket)
    try:
        pub = refit.torch.publisher(client, f"bad-{args.case}", module)
        pub.publish(1 + (rank if args.case == "versions" else 0))
        print(f"rank {rank}: published", flush=True)
    except refit.torch.PublisherError as e:
        print(f"rank {rank}: ERROR {e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
