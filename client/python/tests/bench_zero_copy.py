"""Update time of the engine adapters, zero copy against load_weights, in one run, beside a
memcpy of the same bytes: a bf16 model of N MiB (fused qkv_proj / gate_up_proj layers) on the
CPU, a real refitd, versions published from a SOURCE buffer; the median of `--reps` updates
each. By hand (not a Bazel test; figures, no assertions):

    REFITD=bazel-bin/daemon/refitd PYTHONPATH=client/python:client/python/tests \\
        /usr/bin/python3 client/python/tests/bench_zero_copy.py --mib=256 --reps=5
"""

import argparse
import statistics
import time

import torch

import refit
import refit.testing
from refit import vllm as refit_vllm
from refit.mapping import FusedMapping

MAPPING = FusedMapping(stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                                ("gate_up_proj", ["gate_proj", "up_proj"])])


class Model(torch.nn.Module):
    def __init__(self, layers, h):
        super().__init__()
        self.shapes = {}
        for i in range(layers):
            p = f"model.layers.{i}."
            self.shapes[p + "self_attn.qkv_proj.weight"] = (3 * h, h)
            self.shapes[p + "mlp.gate_up_proj.weight"] = (2 * h, h)
        for name, shape in self.shapes.items():
            owner = self
            *path, attr = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(attr, torch.nn.Parameter(
                torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False))

    @torch.no_grad()
    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            for fused, parts in (("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                                 ("gate_up_proj", ["gate_proj", "up_proj"])):
                for i, part in enumerate(parts):
                    if f".{part}." in name:
                        target = params[name.replace(part, fused)]
                        target[i * t.shape[0]:(i + 1) * t.shape[0]].copy_(t)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    h = 1024
    layers = max(1, args.mib * 2**20 // (5 * h * h * 2))
    ckpt = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):
            ckpt[p + n + ".weight"] = torch.randn(h, h).to(torch.bfloat16)
    nbytes = sum(t.numel() * 2 for t in ckpt.values())
    with refit.testing.Daemon() as daemon:
        client = daemon.client()
        src = client.register("bench", refit.SOURCE, ckpt)
        engines = {}
        for storage in ("zero_copy", "load_weights"):
            model = Model(layers, h)
            engine = refit_vllm.RefitWeightTransferEngine(model=model)
            engine.init_transfer_engine(engine.parse_init_info({
                "model": "bench", "socket": daemon.socket, "mapping": MAPPING.to_dict(),
                "storage": storage,
                "params": {n: [list(t.shape), "bfloat16"] for n, t in ckpt.items()}}))
            engines[storage] = engine
        times = {s: [] for s in engines}
        for version in range(1, 2 * args.reps + 1):
            client.publish("bench", version, [src])
            client.wait_for_version("bench", version, timeout=60)
            order = list(engines) if version % 2 else list(reversed(engines))
            for storage in order:
                t0 = time.perf_counter()
                refit_vllm.sync(engines[storage], version)
                times[storage].append(time.perf_counter() - t0)
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        memcpy = []
        for _ in range(2 * args.reps):
            t0 = time.perf_counter()
            a.copy_(b)
            memcpy.append(time.perf_counter() - t0)
        for e in engines.values():
            e.shutdown()
        src.release()
        client.close()
    ref = statistics.median(memcpy)
    print(f"{nbytes / 2**20:.0f} MiB bf16, {len(ckpt)} checkpoint tensors, median of "
          f"{2 * args.reps}")
    print(f"  memcpy of the same bytes      {ref * 1e3:8.1f} ms  (reference)")
    for storage, ts in times.items():
        m = statistics.median(ts)
        print(f"  update, storage={storage:<12} {m * 1e3:8.1f} ms  = {m / ref:.2f}x memcpy")


if __name__ == "__main__":
    main()
