"""refit.vllm's CUDA zero-copy path on a GPU machine (the GPU bundle's `engines` step,
scripts/gpu/gpu-bundle-run.sh; not a Bazel test: this project's CI machine has no GPU). vLLM 0.33's
own LlamaForCausalLM and fp8 Llama built on the GPU, refit created by vLLM's
WeightTransferEngineFactory as the backend `refit`, the parameters registered where they are
(cudaIpc handles of the blocks that hold them) with a CUDA refitd, versions applied by refitd
into them: every parameter bit for bit what vLLM's own load_weights makes of the same
checkpoint in a second instance, no load_weights call, the parameters' storage unmoved.

Without a GPU it FAILS (it never skips): run it where torch.cuda.is_available().
Needs: REFITD (a refitd built with --config=cuda), a Python with torch and vllm==0.33.0 (CUDA),
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (set here before torch starts)."""

import os
import sys
import unittest

os.environ["VLLM_TARGET_DEVICE"] = "cuda"
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")

import torch  # noqa: E402

import refit  # noqa: E402
import vllm_models as vm  # noqa: E402
from test_fp8 import DaemonCase  # noqa: E402
from test_vllm import (checkpoint_format, engine_checkpoint, entry_point_dist,  # noqa: E402
                       same_bits, HERE)


class VllmGpuTest(DaemonCase):
    @classmethod
    def setUpClass(cls):
        if not torch.cuda.is_available():
            raise AssertionError("test_vllm_gpu: no GPU (torch.cuda.is_available() is False): "
                                 "this test runs refit.vllm's CUDA path and has nothing to "
                                 "check without one")
        super().setUpClass()
        sys.path.insert(0, entry_point_dist(os.path.join(HERE, "..", "pyproject.toml")))
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        vm.init_tp(vm.vllm_config("llama", device="cuda"))

    def run_kind(self, kind, fp8=False, versions=(1, 2)):
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        name = f"vllm-gpu-{kind}{'-fp8' if fp8 else ''}"
        config = vm.vllm_config(kind, fp8=fp8, device="cuda")
        model = vm.build(config)
        ref = vm.build(vm.vllm_config(kind, fp8=fp8, device="cuda"))
        self.assertTrue(all(p.is_cuda for p in model.parameters()))
        state = checkpoint_format(vm.hf_state_dict(kind, 0))
        f8 = vm.fp8_names(state) if fp8 else []
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="refit"), config, torch.device("cuda"), model)
        self.addCleanup(engine.shutdown)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": self.daemon.socket, "fp8": f8, "storage": "zero_copy",
            "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}}))
        self.assertTrue(engine.zero_copy)
        status = [m for m in self.client.status().models if m.model == name]
        self.assertTrue(status and all(b.memory == "cuda" for b in status[0].buffers
                                       if b.role == refit.DESTINATION), status)
        loads = []
        model.load_weights = lambda weights: loads.append(list(weights))
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in versions:
            state = checkpoint_format(vm.hf_state_dict(kind, version))
            if src is None:
                src = self.register(name, refit.SOURCE, dict(state))
            else:
                for n, t in state.items():
                    src.tensors[n].copy_(t)
            self.client.publish(name, version, [src])
            engine.start_weight_update()
            engine.update_weights({"version": version})
            engine.finish_weight_update()
            torch.cuda.synchronize()
            self.assertEqual(engine.weight_version, f"{name}@{version}")
            ref.load_weights([(n, t.cuda()) for n, t in engine_checkpoint(state, f8)])
            mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
            differ = [n for n in theirs if not same_bits(mine[n].cpu(), theirs[n].cpu())]
            self.assertEqual(differ, [], f"{kind} v{version} on the GPU")
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        self.assertEqual(loads, [])

    def test_llama_cuda_zero_copy(self):
        self.run_kind("llama")

    def test_llama_fp8_cuda_zero_copy(self):
        self.run_kind("llama", fp8=True, versions=(1,))


if __name__ == "__main__":
    unittest.main(argv=sys.argv)
