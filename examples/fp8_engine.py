#!/usr/bin/python3
"""An fp8 inference-engine loop: the trainer publishes bf16, refitd quantizes on this node.

Builds tiny_lm.TinyLM and registers, for every linear weight, an fp8 destination slice
(e4m3fn bytes in torch.uint8 storage: Debian's torch 1.13 has no float8 dtypes) with
[128, 128] block scales written as FP32 into `<name>_scale_inv` (the DeepSeek-V3 / vLLM
naming), the way an fp8 engine holds them; the other tensors stay bf16. A second, bf16 copy of
the linear weights is registered as a check: after each Apply the loop prints the largest
|q * s - x| / s over every weight, which the rule bounds by 16 (half the e4m3 step at 448).
A version with inf/NaN values (ModelStatus.latest_nonfinite_values) is refused, as an RL
framework's engine would.

    PYTHONPATH=client/python python3 examples/fp8_engine.py --socket=/tmp/refit/refitd.sock
"""

import argparse
import signal
import sys

import torch

import refit
import tiny_lm
from refit.v1 import refit_pb2

BLOCK = (128, 128)

# e4m3fn code -> value (0x7f / 0xff: NaN).
_DECODE = torch.tensor(
    [float("nan") if (c & 0x7f) == 0x7f else
     (-1.0 if c & 0x80 else 1.0) * ((c & 7) / 8 * 2.0 ** -6 if (c >> 3) & 15 == 0
                                    else (1 + (c & 7) / 8) * 2.0 ** (((c >> 3) & 15) - 7))
     for c in range(256)], dtype=torch.float32)


def is_fp8(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(("_proj.weight", "lm_head.weight"))


def grid(shape):
    return tuple(-(-d // b) for d, b in zip(shape, BLOCK))


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = _DECODE[codes.long()]
    expanded = scales.repeat_interleave(BLOCK[0], 0)[:codes.shape[0]]
    expanded = expanded.repeat_interleave(BLOCK[1], 1)[:, :codes.shape[1]]
    return values * expanded, expanded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--socket", default=None)
    parser.add_argument("--model", default="tiny-lm")
    parser.add_argument("--until-version", type=int, default=0)
    args = parser.parse_args()

    state = tiny_lm.TinyLM().to(torch.bfloat16).state_dict()
    fp8, check = {}, {}
    for name, t in state.items():
        if is_fp8(name, t):
            fp8[name + "_scale_inv"] = refit.Slice(sizes=grid(t.shape), dtype=torch.float32)
            fp8[name] = refit.Slice(sizes=tuple(t.shape), dtype=torch.uint8,
                                    refit_dtype=refit_pb2.FP8_E4M3,
                                    scale_tensor=name + "_scale_inv", scale_block=BLOCK)
            check[name] = torch.zeros(t.shape, dtype=torch.float32)  # any source exactly
        else:
            fp8[name] = torch.zeros_like(t)
    client = refit.Client(args.socket)
    with client.register(args.model, refit.DESTINATION, fp8, client_name="fp8-engine") as buf, \
            client.register(args.model, refit.DESTINATION, check, client_name="check") as ref:
        print(f"fp8-engine: registered {buf.nbytes} bytes, waiting for model={args.model}",
              flush=True)
        version = 0
        with client.watch(args.model, after_version=0) as versions:
            for event in versions:
                if event.version <= version:
                    continue
                version = event.version
                status = [m for m in client.status().models if m.model == args.model][0]
                if status.latest_version == version and status.latest_nonfinite_values:
                    print(f"fp8-engine: refused version {version}: "
                          f"{status.latest_nonfinite_values} inf/NaN values", flush=True)
                    continue
                try:
                    applied = client.apply(args.model, [buf, ref], version)
                except refit.NotFoundError:
                    continue  # dropped by --retain before we got to it
                worst = 0.0
                for name, x in ref.tensors.items():
                    values, scales = dequantize(buf.tensors[name], buf.tensors[name + "_scale_inv"])
                    err = ((values - x.float()).abs() / scales).max().item()
                    worst = max(worst, err)
                print(f"fp8-engine: applied version {applied.version} "
                      f"bytes={applied.bytes_written} max_err_over_scale={worst:.3f}", flush=True)
                if args.until_version and version >= args.until_version:
                    break
    client.close()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    except refit.RefitError as e:
        sys.exit(f"fp8-engine: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
