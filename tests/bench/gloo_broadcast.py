#!/usr/bin/env python3
"""Reference for scripts/bench/bench-two-node.sh and scripts/bench/bench-fanout.sh: torch.distributed (gloo)
broadcast of the same bytes from one sender to one or more receivers.

gloo in Debian's torch 1.13 refuses bf16, so the bytes travel as a uint8 tensor. Prints one row
per round and a machine-readable last line:
RESULT gloo_s=<median s> gloo_gbs=<median GB/s> gloo_times=<s,s,...>.

Two processes on loopback (what bench-two-node.sh runs; this script starts both):
  /usr/bin/python3 tests/bench/gloo_broadcast.py [--mib 1024] [--rounds 5] [--warmup 1]

One process per rank, each started by the caller where it should run (bench-fanout.sh: rank 0
in the trainer's network namespace, rank r in engine r's), all with the same --world-size,
--master-addr (rank 0's address) and --port; --ifname is the interface gloo uses on that rank.
A round's time runs from rank 0 entering the broadcast (after a barrier) to the LAST receiver
leaving it (time.monotonic, CLOCK_MONOTONIC, comparable across processes on one machine);
rank 0 prints the rows and the RESULT line. Every receiver checks every byte of every round.
  /usr/bin/python3 tests/bench/gloo_broadcast.py --rank R --world-size N --master-addr A \
      --port P --ifname eth0 [--mib 256] [--rounds 5] [--warmup 1]
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


def run_rank(args):
    """One rank of a broadcast over the network (--rank given)."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.port)
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    rank, world = args.rank, args.world_size
    dist.init_process_group("gloo", rank=rank, world_size=world)
    nbytes = args.mib << 20
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(rank + 1)  # touch every page before timing
    times = []
    for i in range(args.warmup + args.rounds):
        value = (i * 37 + 1) & 0xFF
        if rank == 0:
            t.fill_(value)
        dist.barrier()
        start = time.monotonic()
        dist.broadcast(t, src=0)
        end = time.monotonic()
        ok = rank == 0 or bool(torch.all(t == value))
        # [the latest end of any rank, any rank's wrong bytes], gathered outside the timing.
        gathered = torch.tensor([end, 0.0 if ok else 1.0], dtype=torch.float64)
        dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
        if gathered[1] > 0:
            if rank == 0:
                print(f"gloo_broadcast: round {i + 1}: a receiver got WRONG bytes",
                      file=sys.stderr)
            sys.exit(1)
        if i >= args.warmup:
            times.append(float(gathered[0]) - start)
    dist.destroy_process_group()
    if rank != 0:
        return
    gb = nbytes / 1e9
    print(f"gloo broadcast of {gb:.3f} GB (uint8), rank 0 -> {world - 1} receiver(s) via "
          f"{args.master_addr} (torch {torch.__version__}); {args.warmup} warm-up round(s) "
          f"not counted")
    for i, t_s in enumerate(times):
        print(f"  round {i + 1}: {t_s:.4f} s  {gb / t_s:.2f} GB/s per receiver")
    med = statistics.median(times)
    print(f"RESULT gloo_s={med:.6f} gloo_gbs={gb / med:.4f} "
          f"gloo_times={','.join(f'{t_s:.6f}' for t_s in times)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: pick a free one)")
    p.add_argument("--rank", type=int, help="run only this rank (with --world-size etc.)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address")
    p.add_argument("--ifname", default="", help="GLOO_SOCKET_IFNAME for this rank")
    args = p.parse_args()
    if args.rank is not None:
        if args.port == 0:
            sys.exit("gloo_broadcast: --rank needs --port (the same on every rank)")
        run_rank(args)
        return

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
