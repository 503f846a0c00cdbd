#!/usr/bin/python3
"""A minimal RL-style trainer loop that publishes its policy weights through refit.

Trains tiny_lm.TinyLM for --steps optimizer steps; after each step copies the parameters into
shared-memory SOURCE buffers and publishes them as the next version. With --shards N it acts
as N tensor-parallel ranks: each 2-D weight is split by rows over N buffers.

    PYTHONPATH=client/python python3 examples/trainer.py --socket=/tmp/refit/refitd.sock
"""

import argparse
import signal
import sys
import time

import torch

import refit
import tiny_lm


def shard_state(state, rank: int, count: int):
    """Rank `rank`'s tensors: rows of 2-D weights split `count` ways, the rest replicated."""
    if count == 1:
        return dict(state)
    return {name: refit.Slice.shard(t, 0, rank, count) if t.dim() == 2 else t
            for name, t in state.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--socket", default=None, help="refitd socket (default $REFIT_SOCKET, "
                        "else /run/refit/refitd.sock)")
    parser.add_argument("--model", default="tiny-lm", help="model name in refit")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (= versions)")
    parser.add_argument("--shards", type=int, default=1, help="tensor-parallel ranks to mimic")
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-ahead", type=int, default=None,
                        help="staleness control: before publishing version N, wait until "
                        "N - MAX_AHEAD is complete on --quorum engine nodes (WaitForReplicas)")
    parser.add_argument("--quorum", type=int, default=0,
                        help="engine nodes that must hold it (0: every one with DESTINATION "
                        "buffers for the model)")
    parser.add_argument("--replica-timeout", type=float, default=60.0,
                        help="seconds to wait for the quorum before giving up")
    parser.add_argument("--publish-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the published weights (bfloat16: a bf16 trainer, as "
                        "fp8 engines with block scales expect; examples/fp8_engine.py)")
    args = parser.parse_args()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.publish_dtype]

    def published_state():
        return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}

    torch.manual_seed(args.seed)
    model = tiny_lm.TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = tiny_lm.encode(tiny_lm.TEXT)

    client = refit.Client(args.socket)
    # Versions increase per model: continue after whatever this daemon already holds.
    held = [m.latest_version for m in client.status().models if m.model == args.model]
    first = (held[0] if held else 0) + 1
    state = published_state()
    buffers = [client.register(args.model, refit.SOURCE, shard_state(state, rank, args.shards),
                               client_name=f"trainer-rank{rank}")
               for rank in range(args.shards)]
    print(f"trainer: registered {len(buffers)} source buffer(s), "
          f"{sum(b.nbytes for b in buffers)} bytes, model={args.model}", flush=True)
    try:
        for i in range(args.steps):
            optimizer.zero_grad()
            logits = model(data[None, :-1])
            loss = torch.nn.functional.cross_entropy(logits[0], data[1:])
            loss.backward()
            optimizer.step()

            state = published_state()
            for buf in buffers:
                buf.copy_from(state)  # each buffer takes its own slices
            version = first + i
            if args.max_ahead is not None and version - args.max_ahead >= first:
                # Don't run more than --max-ahead steps ahead of the engines: the rollouts
                # they generate would be too stale for on-policy RL.
                reached = client.wait_for_replicas(args.model, version - args.max_ahead,
                                                   min_nodes=args.quorum,
                                                   timeout=args.replica_timeout)
                print(f"trainer: version {reached.version} is on {len(reached.nodes)} "
                      f"engine node(s) ({', '.join(reached.nodes)})", flush=True)
            published = client.publish(args.model, version, buffers)
            print(f"trainer: published version {version} bytes={published.bytes} "
                  f"loss={loss.item():.4f} digest={tiny_lm.digest(state)}", flush=True)
            if args.interval:
                time.sleep(args.interval)
    finally:
        for buf in buffers:
            buf.release()
        client.close()
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C would: buffers are released and shm objects unlinked.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    except refit.RefitError as e:
        sys.exit(f"trainer: {e}")
