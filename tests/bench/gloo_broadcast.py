#!/usr/bin/env python3
"""Reference for scripts/bench-two-node.sh: torch.distributed (gloo) broadcast of the same bytes
from one sender process to one receiver process over loopback TCP.

gloo in Debian's torch 1.13 refuses bf16, so the bytes travel as a uint8 tensor. Prints one row
per round and a machine-readable last line:
RESULT gloo_s=<median s> gloo_gbs=<median GB/s> gloo_times=<s,s,...>.

  /usr/bin/python3 tests/bench/gloo_broadcast.py [--mib 1024] [--rounds 5] [--warmup 1]
"""
import argparse
import os
import statistics
import sys
import time


def run(rank, args, port, queue):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    nbytes = args.mib << 20
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(rank + 1)  # touch every page before timing
    times = []
    for i in range(args.warmup + args.rounds):
        if rank == 0:
            t.fill_(i & 0xFF)
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(t, src=0)
        elapsed = time.perf_counter() - start
        if rank == 1:
            ok = int(t[0]) == (i & 0xFF) and int(t[-1]) == (i & 0xFF)
            if not ok:
                print("gloo_broadcast: WRONG bytes received", file=sys.stderr)
                sys.exit(1)
            if i >= args.warmup:
                times.append(elapsed)
    dist.destroy_process_group()
    if rank == 1:
        queue.put(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: pick a free one)")
    args = p.parse_args()

    import socket
    import torch.multiprocessing as mp

    port = args.port
    if port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, port, queue)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=600)
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            sys.exit(f"gloo_broadcast: rank exited with {proc.exitcode}")
    gb = (args.mib << 20) / 1e9
    print(f"gloo broadcast of {gb:.3f} GB (uint8), 1 sender -> 1 receiver on 127.0.0.1")
    for i, t in enumerate(times):
        print(f"  round {i + 1}: {t:.4f} s  {gb / t:.2f} GB/s")
    med = statistics.median(times)
    print(f"RESULT gloo_s={med:.6f} gloo_gbs={gb / med:.4f} "
          f"gloo_times={','.join(f'{t:.6f}' for t in times)}")


if __name__ == "__main__":
    main()
