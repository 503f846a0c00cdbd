"""One vLLM tensor-parallel engine rank for test_vllm_tp.py and bench_vllm.py:
vllm_tp_rank.py KINDS FP8 RANK WORLD PORT SOCKET MODEL [--bench 1].

KINDS: one model kind, or several separated by commas (a kind ending in "+fp8" is fp8
block-quantized; FP8 "1" makes every kind fp8), served one after the other by this one process:
vLLM is imported and its TP groups (gloo) are made once, and each model is built, checked and
dropped in turn (the test's cost is mostly vLLM's import and process start, paid once).

For each kind it builds vLLM's model class of the kind as TP rank RANK of WORLD, takes refit as
vLLM's weight-transfer backend `refit` (the entry point of client/python/pyproject.toml) for
model MODEL (several kinds: MODEL-<kind>), prints a "ready" JSON line, and for each version
number read from stdin updates through the four phases and prints one JSON line: the
parameters that differ, bit for bit, from vLLM's own load_weights of the same checkpoint into a
second instance of this rank's model, whether the parameters' storage stayed put, how many
times load_weights was called. A 0 ends the kind. With --bench 1 it times instead
(bench_vllm.py)."""

import json
import os
import sys
import time

import vllm_models as vm

import torch

from test_vllm import checkpoint_format, engine_checkpoint, entry_point_dist, same_bits

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    kinds, fp8_all, rank, world, port, socket, name = sys.argv[1:8]
    fp8_all, rank, world, port = fp8_all == "1", int(rank), int(world), int(port)
    bench = int(sys.argv[9]) if len(sys.argv) > 9 and sys.argv[8] == "--bench" else 0
    sys.path.insert(0, entry_point_dist(os.path.join(HERE, "..", "pyproject.toml")))
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    kinds = kinds.split(",")
    # vLLM makes its expert-parallel group only for a MoE config, and the groups once per
    # process: a MoE config first serves dense and MoE models alike.
    vm.init_tp(vm.vllm_config("qwen3_moe", tp=world), rank, world, port)
    for kind in kinds:
        fp8 = fp8_all or kind.endswith("+fp8")
        serve(kind.removesuffix("+fp8"), fp8, world, socket,
              name if len(kinds) == 1 else f"{name}-{kind.replace('+', '-')}", bench)


def serve(kind, fp8, world, socket, name, bench):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    config = vm.vllm_config(kind, fp8=fp8, tp=world)
    model = vm.build(config)
    ref = None if bench else vm.build(vm.vllm_config(kind, fp8=fp8, tp=world))
    state = checkpoint_format(vm.hf_state_dict(kind, 0))
    f8 = vm.fp8_names(state) if fp8 else []
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), config, torch.device("cpu"), model)
    engine.init_transfer_engine(engine.parse_init_info({
        "model": name, "socket": socket, "fp8": f8,
        "storage": "zero_copy",
        "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}}))
    bench_state = engine_checkpoint(state, f8) if bench else None
    loads = []
    real_load_weights = model.load_weights
    model.load_weights = lambda weights: loads.append(len(list(weights)))
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    print(json.dumps({"ready": True, "model": name, "zero_copy": engine.zero_copy,
                      "absent": len(engine.weights.absent),
                      "placed": sum(len(b.tensors) for b in engine.weights.buffers)}),
          flush=True)
    for line in sys.stdin:
        version = int(line)
        if version == 0:
            break
        if bench:
            print(json.dumps(timings(engine, real_load_weights, bench_state, model, version)),
                  flush=True)
            continue
        engine.start_weight_update()
        engine.update_weights({"version": version})
        engine.finish_weight_update()
        state = checkpoint_format(vm.hf_state_dict(kind, version))
        ref.load_weights(engine_checkpoint(state, f8))
        mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
        differ = [n for n in theirs if n not in mine or not same_bits(mine[n], theirs[n])]
        print(json.dumps({
            "version": version, "weight_version": engine.weight_version, "differ": differ,
            "params": len(theirs), "loads": len(loads),
            "pointers_stable": pointers == {n: p.data_ptr() for n, p in
                                            model.named_parameters()},
            "shapes": {n: list(p.shape) for n, p in mine.items()
                       if n.endswith(("qkv_proj.weight", "w13_weight", "o_proj.weight"))}}),
              flush=True)
    engine.shutdown()


def timings(engine, load_weights, state, model, version):
    """One version, in one process: zero copy (wait + Status + Apply into the parameters),
    vLLM's own load_weights of the same checkpoint (its tensors already in this process's
    memory), and a memcpy of the rank's parameter bytes (the floor)."""
    out = {"version": version}
    t = time.perf_counter()
    engine.weights.update(None, version, 60.0, True)
    out["zero_copy_s"] = time.perf_counter() - t
    t = time.perf_counter()
    load_weights(state)
    out["load_weights_s"] = time.perf_counter() - t
    params = [p for p in model.parameters()]
    copies = [torch.empty_like(p) for p in params]
    with torch.no_grad():  # touched once first: the timed copy writes faulted-in pages
        for c, p in zip(copies, params):
            c.copy_(p)
    t = time.perf_counter()
    with torch.no_grad():
        for c, p in zip(copies, params):
            c.copy_(p)
    out["memcpy_s"] = time.perf_counter() - t
    out["bytes"] = sum(p.numel() * p.element_size() for p in params)
    return out


if __name__ == "__main__":
    main()
