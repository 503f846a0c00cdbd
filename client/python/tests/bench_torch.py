"""refit.torch.publisher on an FSDP2 trainer: publish() time per rank beside a memcpy of that
rank's shard bytes in the same run, and the trainer process's resident memory growth from
refit (docs/benchmarks.md, "Trainers: torch 2.x publisher"). A bf16 model of --mib MiB
(Llama-shaped linear layers), fully_shard over --ranks ranks on the CPU (gloo), a real refitd.
By hand (figures, no assertions):

    REFITD=bazel-bin/daemon/refitd PYTHONPATH=client/python \\
        /var/cache/refit-python/venv-current/bin/python client/python/tests/bench_torch.py \\
        --mib=1024 --ranks=2 --reps=5
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Model(torch.nn.Module):
    """`layers` blocks of q/k/v/o (h x h) and gate/up/down (h x 3h) bf16 linear weights."""

    def __init__(self, layers: int, h: int):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            for name, shape in (("q_proj", (h, h)), ("k_proj", (h, h)), ("v_proj", (h, h)),
                                ("o_proj", (h, h)), ("gate_proj", (3 * h, h)),
                                ("up_proj", (3 * h, h)), ("down_proj", (h, 3 * h))):
                lin = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
                torch.nn.init.normal_(lin.weight, std=0.02)
                block.add_module(name, lin)
            self.layers.append(block)


def worker(args) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import refit
    import refit.torch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    h = 1024
    per_layer = (4 * h * h + 9 * h * h) * 2
    layers = max(1, args.mib * 2**20 // per_layer)
    torch.manual_seed(0)
    model = Model(layers, h)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(p._local_tensor.numel() * p._local_tensor.element_size()
                      for p in model.parameters())
    dist.barrier()
    rss_before = rss_mib()
    client = refit.Client(args.socket)
    t0 = time.perf_counter()
    pub = refit.torch.publisher(client, "bench", model)
    setup = time.perf_counter() - t0
    dist.barrier()
    rss_registered = rss_mib()

    # Reference in the same run: a memcpy of this rank's shard bytes.
    src = torch.empty(shard_bytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)
    copies = []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    del src, dst

    publishes = []
    for version in range(1, args.reps + 1):
        with torch.no_grad():  # an "optimizer step": every shard written in place
            for p in model.parameters():
                p._local_tensor.add_(1e-3)
        dist.barrier()
        t0 = time.perf_counter()
        pub.publish(version)
        publishes.append(time.perf_counter() - t0)
    dist.barrier()
    rss_after = rss_mib()
    growth = rss_after - rss_before
    med_pub, med_copy = statistics.median(publishes), statistics.median(copies)
    print(f"rank {rank}: model {layers * per_layer / 2**20:.0f} MiB bf16, shard "
          f"{shard_bytes / 2**20:.1f} MiB | publish median {med_pub * 1e3:.1f} ms "
          f"(min {min(publishes) * 1e3:.1f}) | memcpy of the shard median "
          f"{med_copy * 1e3:.1f} ms (min {min(copies) * 1e3:.1f}) | ratio "
          f"{med_pub / med_copy:.2f}x | publisher() {setup * 1e3:.0f} ms ("
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in pub.timings.items())
          + f") | RSS "
          f"{rss_before:.0f} -> {rss_registered:.0f} (registered) -> {rss_after:.0f} MiB "
          f"(after {args.reps} publishes): growth {growth:.1f} MiB = "
          f"{100 * growth / (shard_bytes / 2**20):.1f}% of the shard | rehomes "
          f"{pub.rehomes}", flush=True)
    pub.release()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--socket", default=None, help="(worker) refitd socket")
    args = parser.parse_args()
    if args.socket:
        return worker(args)
    import socket as socket_lib

    import refit.testing
    with refit.testing.Daemon(args=["--retain=2"], log_level="info") as daemon:
        with socket_lib.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(args.ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, f"--socket={daemon.socket}", f"--mib={args.mib}",
                 f"--reps={args.reps}"], env=env))
        codes = [p.wait() for p in procs]
    print(f"torch {torch.__version__}, {args.ranks} ranks, {os.cpu_count()} CPUs")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
