#!/usr/bin/python3
"""An fp8 inference-engine loop: the trainer publishes bf16, refitd quantizes on this node, and
Apply writes straight into the engine's parameters (refit.vllm, zero copy).

The engine model holds, for every linear weight of tiny_lm.TinyLM, an fp8 parameter (e4m3fn
bytes in torch.uint8 storage: Debian's torch 1.13 has no float8 dtypes) and its FP32
`<name>_scale_inv` block scales of [128, 128] blocks (the DeepSeek-V3 / vLLM naming); the other
parameters are bf16. `refit.vllm.RefitWeightTransferEngine` with `storage="zero_copy"` registers
those parameters themselves as DESTINATION memory, so each update is an Apply: no load_weights,
no copy, and the parameters' data_ptr() never moves (printed per version). A second, float32
copy of the linear weights is registered as a check: after each version the loop prints the
largest |q * s - x| / s over every weight, which the rule bounds by 16 (half the e4m3 step at
448). A version with inf/NaN values is refused before Apply, as an RL framework's engine would.

    PYTHONPATH=client/python python3 examples/fp8_engine.py --socket=/tmp/refit/refitd.sock
"""

import argparse
import signal
import sys

import torch

import refit
import tiny_lm
from refit import vllm as refit_vllm

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


class Fp8EngineModel(torch.nn.Module):
    """TinyLM's parameters as an fp8 engine holds them (fp8 weight + weight_scale_inv)."""

    def __init__(self, state):
        super().__init__()
        for name, t in state.items():
            if is_fp8(name, t):
                self._add(name, torch.zeros(t.shape, dtype=torch.uint8))
                self._add(name + "_scale_inv", torch.zeros(grid(t.shape), dtype=torch.float32))
            else:
                self._add(name, torch.zeros_like(t))

    def _add(self, name, value):
        owner = self
        *path, attr = name.split(".")
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        owner.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))

    def load_weights(self, weights):
        raise AssertionError("zero copy: load_weights must not be called")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--socket", default=None)
    parser.add_argument("--model", default="tiny-lm")
    parser.add_argument("--until-version", type=int, default=0)
    args = parser.parse_args()

    state = tiny_lm.TinyLM().to(torch.bfloat16).state_dict()
    fp8_names = [name for name, t in state.items() if is_fp8(name, t)]
    check = {name: torch.zeros(state[name].shape, dtype=torch.float32)  # any source exactly
             for name in fp8_names}
    model = Fp8EngineModel(state)
    engine = refit_vllm.RefitWeightTransferEngine(model=model)
    engine.init_transfer_engine(engine.parse_init_info({
        "model": args.model, "socket": args.socket, "fp8": fp8_names, "fp8_block": list(BLOCK),
        "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()},
        "storage": "zero_copy"}))
    params = dict(model.named_parameters())
    pointers = {n: p.data_ptr() for n, p in params.items()}
    held = sum(p.numel() * p.element_size() for p in params.values())
    client = refit.Client(args.socket)
    with client.register(args.model, refit.DESTINATION, check, client_name="check") as ref:
        print(f"fp8-engine: {len(params)} parameters ({held} bytes) registered in place, "
              f"waiting for model={args.model}", flush=True)
        version = 0
        with client.watch(args.model, after_version=0) as versions:
            for event in versions:
                if event.version <= version:
                    continue
                version = event.version
                try:
                    tag = refit_vllm.sync(engine, version)
                    client.apply(args.model, [ref], version)
                except refit_vllm.NonFiniteVersionError as e:
                    print(f"fp8-engine: refused version {version}: {e.count} inf/NaN values",
                          flush=True)
                    continue
                except refit.NotFoundError:
                    continue  # dropped by --retain before we got to it
                worst = 0.0
                for name, x in ref.tensors.items():
                    values, scales = dequantize(params[name].detach(),
                                                params[name + "_scale_inv"].detach())
                    err = ((values - x.float()).abs() / scales).max().item()
                    worst = max(worst, err)
                moved = sum(p.data_ptr() != pointers[n] for n, p in params.items())
                print(f"fp8-engine: applied version {version} bytes={held} "
                      f"max_err_over_scale={worst:.3f} tag={tag} data_ptr_moved={moved}",
                      flush=True)
                if args.until_version and version >= args.until_version:
                    break
    engine.shutdown()
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
