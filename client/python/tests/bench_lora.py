"""An adapter update on the engine beside a full update of the merged weights, in one run
(docs/benchmarks.md, issue 35):

- adapter: rank-16 LoRA on every linear layer (q/k/v/o, gate/up/down) of a tiny Llama
  (tests/vllm_models.py's llama_bench: 4 layers, hidden 1024, ~66 M parameters, bf16), published
  by refit.lora on the trainer's refitd, loaded on the engine's node by refit.vllm.adapter into
  vLLM 0.33's LoRA slots (wait + Apply + from_lora_tensors / add / activate);
- merged: the trainer merges W + alpha/r * B A into every adapted weight (timed apart), publishes
  the whole model (refit.torch.publisher), and the engine applies it zero-copy into vLLM's own
  parameters (refit as vLLM's weight-transfer backend, RefitWeightTransferEngine);
- reference: a memcpy of the merged model's bytes in this process.

Two refitd processes as two nodes on one host (UCX shared memory between them). Each version
changes every A and B (an RL step of the adapter); per path the median over the versions after
the first.

    REFITD=bazel-bin/daemon/refitd PYTHONPATH=client/python \\
        $(scripts/install/install-python-env.sh --print) client/python/tests/bench_lora.py [VERSIONS]
"""

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vllm_models as vm  # noqa: E402

import torch  # noqa: E402

import refit  # noqa: E402
import refit.lora  # noqa: E402
import refit.testing  # noqa: E402
import refit.torch  # noqa: E402
from refit import vllm as refit_vllm  # noqa: E402
from daemons import two_nodes  # noqa: E402
from test_lora import (ALPHA, RANK, add_lora, base_name, model_status, prepare_cpu_gemm,  # noqa: E402
                       vllm_engine)

KIND = "llama_bench"


class _Case:
    def addCleanup(self, fn, *args):
        _cleanups.append((fn, args))

    def assertLess(self, a, b, msg=""):
        assert a < b, msg


_cleanups = []


def trainer_models():
    import transformers
    cfg = vm.hf_config(KIND)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    merged = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        merged.load_state_dict(model.state_dict())
    for p in model.parameters():
        p.requires_grad_(False)
    add_lora(model, RANK)
    return model, merged


def merge_into(model, merged) -> None:
    """merged's adapted weights = W + alpha/r * B @ A (bf16, as a trainer that merges does)."""
    merged_params = dict(merged.named_parameters())
    with torch.no_grad():
        for x in refit.lora.find_adapted(model):
            base = model.get_submodule(x.path).base_layer.weight
            delta = (x.b.float() @ x.a.float()) * (ALPHA / RANK)
            merged_params[x.path + ".weight"].copy_((base.float() + delta).to(base.dtype))


def main():
    versions = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    case = _Case()
    try:
        trainer_node, engine_node = two_nodes(case, retain=4)
        tc, ec = trainer_node.client(), engine_node.client()
        model, merged = trainer_models()
        adapter_pub = refit.lora.publisher(tc, "bench-adapter", model, base_model="bench-base")
        merged_pub = refit.torch.publisher(tc, "bench-merged", merged)

        # Engine A: vLLM's Llama with its LoRA manager, base weights loaded once.
        cfg, vmodel, manager = vllm_engine(kind=KIND)
        base_state = {n: t for n, t in ((base_name(k), v) for k, v in model.state_dict().items())
                      if n is not None}
        vmodel.load_weights(list(base_state.items()))
        prepare_cpu_gemm(vmodel)
        adapter = refit_vllm.adapter(ec, "bench-adapter", manager, lora_id=1)

        # Engine B: a second vLLM Llama, refit zero-copy into its parameters.
        mcfg = vm.vllm_config(KIND)
        mmodel = vm.build(mcfg)
        engine = refit_vllm.RefitWeightTransferEngine(config=None, vllm_config=mcfg,
                                                      device=torch.device("cpu"), model=mmodel)
        merged_state = merged.state_dict()
        engine.init_transfer_engine(engine.parse_init_info({
            "model": "bench-merged", "socket": engine_node.socket, "storage": "zero_copy",
            "params": {n: [list(t.shape), "bfloat16"] for n, t in merged_state.items()
                       if "rotary_emb" not in n}}))
        assert engine.zero_copy

        merged_bytes = sum(t.numel() * t.element_size() for t in merged_state.values())
        src = torch.randint(0, 255, (merged_bytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        rows = []
        g = torch.Generator().manual_seed(5)
        for v in range(1, versions + 1):
            with torch.no_grad():  # an RL step of the adapter: every A and B moves
                for x in refit.lora.find_adapted(model):
                    x.a.add_(torch.randn(x.a.shape, generator=g).to(x.a.dtype) * 1e-3)
                    x.b.add_(torch.randn(x.b.shape, generator=g).to(x.b.dtype) * 1e-3)
            t0 = time.perf_counter()
            adapter_pub.publish(v)
            t1 = time.perf_counter()
            adapter.update(v, timeout=120)
            t2 = time.perf_counter()
            merge_into(model, merged)
            t3 = time.perf_counter()
            merged_pub.publish(v)
            t4 = time.perf_counter()
            engine.start_weight_update()
            engine.update_weights({"version": v})
            engine.finish_weight_update()
            t5 = time.perf_counter()
            t6 = time.perf_counter()
            dst.copy_(src)
            t7 = time.perf_counter()
            rows.append({"adapter_publish": t1 - t0, "adapter_engine": t2 - t1,
                         "adapter_apply": adapter.timings["apply"],
                         "adapter_load": adapter.timings["load"],
                         "merge": t3 - t2, "merged_publish": t4 - t3, "merged_engine": t5 - t4,
                         "memcpy": t7 - t6})
        adapter_bytes = model_status(tc, "bench-adapter").version_bytes
        merged_version_bytes = model_status(tc, "bench-merged").version_bytes
        med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
        print(f"vLLM {__import__('vllm').__version__}, {KIND} bf16 (CPU), LoRA rank {RANK} on "
              f"all {len(refit.lora.find_adapted(model))} linear layers; medians of "
              f"{versions - 1} versions; two refitd nodes on one host")
        print(f"adapter version: {adapter_bytes / 2**20:.2f} MiB; merged model version: "
              f"{merged_version_bytes / 2**20:.1f} MiB "
              f"({merged_version_bytes / adapter_bytes:.0f}x)")
        print("| path | trainer: merge | trainer: publish | engine: publish -> in use | of it: "
              "Apply | of it: into LoRA slots |")
        print("|---|---|---|---|---|---|")
        ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
        print(f"| adapter | - | {ms(med['adapter_publish'])} | {ms(med['adapter_engine'])} | "
              f"{ms(med['adapter_apply'])} | {ms(med['adapter_load'])} |")
        print(f"| merged weights | {ms(med['merge'])} | {ms(med['merged_publish'])} | "
              f"{ms(med['merged_engine'])} | (zero copy: the Apply is the update) | - |")
        print(f"reference: memcpy of the merged model's {merged_bytes / 2**20:.1f} MiB: "
              f"{ms(med['memcpy'])}")
        total_a = med["adapter_publish"] + med["adapter_engine"]
        total_m = med["merge"] + med["merged_publish"] + med["merged_engine"]
        print(f"trainer + engine per version: adapter {ms(total_a)}, merged {ms(total_m)} "
              f"({total_m / total_a:.1f}x the adapter's)")
        adapter.release()
        engine.shutdown()
        adapter_pub.release()
        merged_pub.release()
        tc.close()
        ec.close()
    finally:
        for fn, args in reversed(_cleanups):
            fn(*args)


if __name__ == "__main__":
    main()
