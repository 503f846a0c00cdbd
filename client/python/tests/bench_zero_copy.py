"""Update time of the engine adapters, zero copy against load_weights, in one run, beside a
memcpy of the same bytes: a bf16 model of N MiB (fused qkv_proj / gate_up_proj layers), a real
refitd, the median of `--reps` updates each. By hand (not a Bazel test; figures, no assertions):

    REFITD=bazel-bin/daemon/refitd PYTHONPATH=client/python:client/python/tests \\
        /usr/bin/python3 client/python/tests/bench_zero_copy.py --mib=256 --reps=5

`--device=cpu` (default): the engine's model on the CPU, versions published from a SOURCE
buffer, the reference a CPU memcpy. `--device=cuda` (a refitd built with --config=cuda, a GPU;
the GPU bundle's run.sh runs it): the trainer's checkpoint tensors are CUDA parameters
registered in place (refit.torch.publisher), the engine's model is on the GPU, the reference is
torch's device-to-device copy of the same bytes, and the publish (the snapshot into refitd's
slot) is timed too.
"""

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")

import torch  # noqa: E402

import refit  # noqa: E402
import refit.testing  # noqa: E402
import refit.torch  # noqa: E402
from refit import vllm as refit_vllm  # noqa: E402
from refit.mapping import FusedMapping  # noqa: E402

MAPPING = FusedMapping(stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                                ("gate_up_proj", ["gate_proj", "up_proj"])])


def set_param(module, name, value):
    """`value` as the parameter `name` (dotted) of `module`, making the submodules on the way."""
    *path, attr = name.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))


class Model(torch.nn.Module):
    def __init__(self, layers, h):
        super().__init__()
        self.shapes = {}
        for i in range(layers):
            p = f"model.layers.{i}."
            self.shapes[p + "self_attn.qkv_proj.weight"] = (3 * h, h)
            self.shapes[p + "mlp.gate_up_proj.weight"] = (2 * h, h)
        for name, shape in self.shapes.items():
            set_param(self, name, torch.zeros(shape, dtype=torch.bfloat16))

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


def start_nodes(stack, nodes, daemon_args):
    """(the trainer's refitd, the engine's refitd): the same one for nodes=1; for nodes=2 a
    second refitd peering with the first over loopback, connected before this returns."""
    trainer = stack.enter_context(refit.testing.Daemon(args=[*daemon_args, "--node=trainer"]))
    if nodes == 1:
        return trainer, trainer
    port = trainer.client().status().listen_port
    engine = stack.enter_context(refit.testing.Daemon(
        args=[*daemon_args, "--node=engine", f"--peers=127.0.0.1:{port}"]))
    deadline = time.monotonic() + 30
    while not all(p.connected for p in engine.client().status().peers):
        if time.monotonic() > deadline:
            raise RuntimeError("the two refitd did not connect")
        time.sleep(0.05)
    return trainer, engine


class Trainer(torch.nn.Module):
    """The checkpoint's tensors as a trainer's CUDA parameters (published in place)."""

    def __init__(self, ckpt):
        super().__init__()
        for name, value in ckpt.items():
            set_param(self, name, value.cuda())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3,
                        help="versions first published and applied untimed: refitd allocates "
                             "its version slots (--retain + 1 of them) in the first ones")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: the trainer's refitd and the engine's refitd (peering over "
                             "loopback, UCX_TLS as set): each version is also pulled")
    parser.add_argument("--daemon-arg", action="append", default=[],
                        help="a refitd flag, e.g. --daemon-arg=--slot-memory=cuda (repeatable)")
    args = parser.parse_args()
    cuda = args.device == "cuda"

    def sync_device():
        if cuda:
            torch.cuda.synchronize()
    h = 1024
    layers = max(1, args.mib * 2**20 // (5 * h * h * 2))
    ckpt = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):
            ckpt[p + n + ".weight"] = torch.randn(h, h).to(torch.bfloat16)
    nbytes = sum(t.numel() * 2 for t in ckpt.values())
    with contextlib.ExitStack() as stack:
        daemon, engine_daemon = start_nodes(stack, args.nodes, args.daemon_arg)
        client, engine_client = daemon.client(), engine_daemon.client()
        if cuda:
            trainer = Trainer(ckpt)
            src = refit.torch.publisher(client, "bench", trainer)
        else:
            src = client.register("bench", refit.SOURCE, ckpt)
        engines = {}
        for storage in ("zero_copy", "load_weights"):
            model = Model(layers, h).to(args.device)
            engine = refit_vllm.RefitWeightTransferEngine(model=model)
            engine.init_transfer_engine(engine.parse_init_info({
                "model": "bench", "socket": engine_daemon.socket, "mapping": MAPPING.to_dict(),
                "storage": storage,
                "params": {n: [list(t.shape), "bfloat16"] for n, t in ckpt.items()}}))
            engines[storage] = engine
        times = {s: [] for s in engines}
        publish, pull = [], []
        for version in range(1, args.warmup + 2 * args.reps + 1):
            # Every element changes each version (a full update, not an empty delta).
            with torch.no_grad():
                if cuda:
                    for param in trainer.parameters():
                        param.add_(1)
                    sync_device()
                else:
                    for t in ckpt.values():
                        t.add_(1)
                    src.copy_from(ckpt)
            t0 = time.perf_counter()
            if cuda:
                src.publish(version)
            else:
                client.publish("bench", version, [src])
            client.wait_for_version("bench", version, timeout=60)
            t1 = time.perf_counter()
            if args.nodes == 2:  # pulled onto the engine's node
                engine_client.wait_for_version("bench", version, timeout=120)
            if version > args.warmup:
                publish.append(t1 - t0)
                pull.append(time.perf_counter() - t1)
            order = list(engines) if version % 2 else list(reversed(engines))
            for storage in order:
                t0 = time.perf_counter()
                refit_vllm.sync(engines[storage], version)
                sync_device()
                if version > args.warmup:
                    times[storage].append(time.perf_counter() - t0)
        a = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        b = torch.empty(nbytes, dtype=torch.uint8, device=args.device).fill_(1)
        memcpy = []
        for _ in range(2 * args.reps):
            sync_device()
            t0 = time.perf_counter()
            a.copy_(b)
            sync_device()
            memcpy.append(time.perf_counter() - t0)
        last = args.warmup + 2 * args.reps
        log = [line for d in {id(daemon): daemon, id(engine_daemon): engine_daemon}.values()
               for line in d.log().splitlines()
               if f"version={last} " in line and "[delta]" not in line]
        for e in engines.values():
            e.shutdown()
        src.release()
        client.close()
        engine_client.close()
    ref = statistics.median(memcpy)
    print(f"{nbytes / 2**20:.0f} MiB bf16, {len(ckpt)} checkpoint tensors, on {args.device}, "
          f"{args.nodes} node(s), refitd {' '.join(args.daemon_arg) or '(defaults)'}, median of "
          f"{2 * args.reps} after {args.warmup} warm-up versions")
    what = "torch D2D copy" if cuda else "memcpy"
    print(f"  {what} of the same bytes{' ' * (14 - len(what))}{ref * 1e3:8.1f} ms  (reference)")
    m = statistics.median(publish)
    print(f"  publish (snapshot, complete)  {m * 1e3:8.1f} ms  = {m / ref:.2f}x {what}")
    if args.nodes == 2:
        m = statistics.median(pull)
        print(f"  pull to the engine's node     {m * 1e3:8.1f} ms  = {m / ref:.2f}x {what}  "
              f"({nbytes / m / 1e9:.2f} GB/s)")
    for storage, ts in times.items():
        m = statistics.median(ts)
        print(f"  update, storage={storage:<12} {m * 1e3:8.1f} ms  = {m / ref:.2f}x {what}")
    print(f"  refitd's log of version {last}:")
    for line in log[-12:]:
        print(f"    {line}")


if __name__ == "__main__":
    main()
