#!/usr/bin/python3
"""A minimal inference-engine loop that receives policy weights through refit.

Builds the same tiny_lm.TinyLM (randomly initialised), registers its weights as one
DESTINATION buffer and binds the model to it, so each Apply writes straight into the live
model. Applies the newest version the daemon holds, then every version that completes.

    PYTHONPATH=client/python python3 examples/engine.py --socket=/tmp/refit/refitd.sock
"""

import argparse
import signal
import sys

import torch

import refit
import tiny_lm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--socket", default=None, help="refitd socket (default $REFIT_SOCKET, "
                        "else /run/refit/refitd.sock)")
    parser.add_argument("--model", default="tiny-lm", help="model name in refit")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="the engine's weight dtype (refitd converts)")
    parser.add_argument("--until-version", type=int, default=0,
                        help="exit after applying this version (0: run until interrupted)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the first version (default: for ever)")
    args = parser.parse_args()

    torch.manual_seed(1234)  # not the trainer's weights: they arrive through refit
    model = tiny_lm.TinyLM().to(DTYPES[args.dtype]).eval()
    probe = tiny_lm.encode("the engine ")[None, :]

    client = refit.Client(args.socket)
    with client.register(args.model, refit.DESTINATION, model.state_dict(),
                         client_name="engine") as buf:
        buf.bind(model)
        previous = {k: v.clone() for k, v in model.state_dict().items()}

        def apply(version: int) -> int:
            try:
                applied = client.apply(args.model, [buf], version)
            except refit.NotFoundError:  # dropped by --retain before we got to it
                print(f"engine: version {version} no longer held; skipped", flush=True)
                return version
            state = model.state_dict()
            change = max((state[k].float() - previous[k].float()).abs().max().item()
                         for k in state)
            for k, v in state.items():
                previous[k].copy_(v)
            with torch.no_grad():
                token = model(probe)[0, -1].argmax().item()
            print(f"engine: applied version {applied.version} bytes={applied.bytes_written} "
                  f"max_abs_change={change:.6f} next_token={token} "
                  f"digest={tiny_lm.digest(state)}", flush=True)
            return applied.version

        def newest() -> int:
            held = [m.latest_version for m in client.status().models if m.model == args.model]
            return held[0] if held else 0

        def done(version: int) -> bool:
            return bool(args.until_version) and version >= args.until_version

        applied = newest()
        if applied:
            applied = apply(applied)  # start from the newest version the daemon holds
        # In place once watch() returns: every version completing from now on is an event
        # (after_version > 0 also replays the retained ones newer than it).
        with client.watch(args.model, after_version=applied) as versions:
            if not applied and newest():  # one completed between status() and watch()
                applied = apply(newest())
            print(f"engine: registered {buf.nbytes} bytes ({args.dtype}), waiting for "
                  f"model={args.model}", flush=True)
            if not applied:  # bounds the wait for a trainer to show up
                client.wait_for_version(args.model, 1, timeout=args.timeout)
            if not done(applied):
                for event in versions:
                    if event.version > applied:
                        applied = apply(event.version)
                    if done(applied):
                        break
    client.close()
    if args.until_version and not done(applied):
        print(f"engine: the watch ended at version {applied}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C would: buffers are released and shm objects unlinked.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    except refit.RefitError as e:
        sys.exit(f"engine: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
