"""The engine beside fsdp_trainer.py: keeps a Qwen3 in vLLM's fused layout (qkv_proj,
gate_up_proj) in a refit DESTINATION buffer and applies every version the trainer publishes.

    python3 examples/fsdp_engine.py --socket=/tmp/refit/engine.sock

Each version arrives already fused and resharded (the trainer's ranks published their FSDP2
shards under the checkpoint names; refitd places q, k and v one after another in qkv_proj).
"""

import argparse
import signal
import sys

import torch

import refit
import qwen3_tiny


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", default=None)
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--until-version", type=int, default=0, help="exit after this one")
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    shapes = {name: tuple(t.shape) for name, t in
              qwen3_tiny.build(seed=1, layers=args.layers, hidden=args.hidden)
              .state_dict().items()}
    client = refit.Client(args.socket)
    with client.register(args.model, refit.DESTINATION,
                         qwen3_tiny.VLLM_QWEN3.layout(shapes, torch.float32)) as weights:
        params = qwen3_tiny.VLLM_QWEN3.fused_views(weights)   # what a vLLM model would hold
        qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
        print(f"engine: waiting for model={args.model}; {len(params)} engine parameters, "
              f"layer 0 qkv_proj {tuple(qkv.shape)}", flush=True)
        with client.watch(args.model, timeout=args.timeout) as versions:
            for event in versions:
                response = client.apply(args.model, [weights], event.version)
                print(f"engine: applied version {response.version} "
                      f"bytes={response.bytes_written} "
                      f"digest={qwen3_tiny.digest(weights.tensors)}", flush=True)
                if args.until_version and response.version >= args.until_version:
                    break
    return 0


if __name__ == "__main__":
    sys.exit(main())
