"""refit's CUDA paths with torch alone, on a GPU machine (the GPU bundle's `torch-gpu` step,
scripts/gpu/gpu-bundle-run.sh; not a Bazel test: this project's CI machine has no GPU, and
test_torch.py / test_zero_copy.py there build the CUDA handles from fake parameters only).

A trainer's torch module on the GPU registered where it is (refit.torch.publisher: cudaIpc
handles of the cudaMalloc blocks that hold its parameters, no copy out), and an engine's
vLLM-shaped torch model on the GPU (fp8 qkv with [128, 128] block scales, fused gate_up, MoE
experts) whose parameters are refit DESTINATION memory (refit.vllm's adapter, storage
"zero_copy"; the vllm package itself is not needed): a CUDA refitd moves each version from the
one into the other. After every version the engine's parameters hold, bit for bit, what the
CPU reference makes of the trainer's tensors; their data_ptr() never moves; load_weights is
never called. A version with one tensor changed (the delta path) and a release/re-register
follow.

Without a GPU it FAILS (it never skips). Needs REFITD (a refitd built with --config=cuda), a
Python with torch (CUDA), grpcio and protobuf."""

import os
import sys
import time
import unittest

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")

import torch  # noqa: E402

import refit  # noqa: E402
import refit.torch  # noqa: E402
from refit import vllm as refit_vllm  # noqa: E402
from test_fp8 import DaemonCase  # noqa: E402
from test_zero_copy import (FP8, LOCAL, MAPPING, VllmShapedModel, checkpoint,  # noqa: E402
                            engine_params, expected, same_bytes)


class Params(torch.nn.Module):
    """A module whose parameters are `tensors` under their dotted names (a trainer's model)."""

    def __init__(self, tensors, device):
        super().__init__()
        for name, value in tensors.items():
            owner = self
            *path, attr = name.split(".")
            for p in path:
                if not hasattr(owner, p):
                    owner.add_module(p, torch.nn.Module())
                owner = getattr(owner, p)
            owner.register_parameter(
                attr, torch.nn.Parameter(value.to(device), requires_grad=False))


class TorchGpuTest(DaemonCase):
    @classmethod
    def setUpClass(cls):
        if not torch.cuda.is_available():
            raise AssertionError("test_torch_gpu: no GPU (torch.cuda.is_available() is False): "
                                 "this test runs refit's CUDA paths and has nothing to check "
                                 "without one")
        super().setUpClass()

    def engine(self, name, model):
        engine = refit_vllm.RefitWeightTransferEngine(model=model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": self.daemon.socket, "fp8": FP8,
            "params": {n: [list(s), "bfloat16"] for n, (s, _) in engine_params().items()},
            "mapping": MAPPING.to_dict(), "storage": "zero_copy", "experts": LOCAL}))
        self.addCleanup(engine.shutdown)
        return engine

    def check(self, model, ckpt, label):
        torch.cuda.synchronize()
        params = dict(model.named_parameters())
        differ = []
        for name, want in expected(ckpt).items():
            got = params[name].detach().cpu()
            if got.dtype != want.dtype:
                want = want.to(got.dtype)
            if not same_bytes(got, want):
                differ.append(name)
        self.assertEqual(differ, [], f"{label}: parameters that differ from the CPU reference")

    def memory_of(self, name, role):
        status = [m for m in self.client.status().models if m.model == name]
        self.assertTrue(status, f"{name} not in status")
        return {b.memory for b in status[0].buffers if b.role == role}

    def test_cuda_trainer_to_cuda_engine_zero_copy(self):
        name = "torch-gpu"
        ckpt = checkpoint(1)
        trainer = Params(ckpt, "cuda")
        model = VllmShapedModel().cuda()
        self.assertTrue(all(p.is_cuda for p in model.parameters()))
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        trainer_pointers = {n: p.data_ptr() for n, p in trainer.named_parameters()}
        pub = refit.torch.publisher(self.client, name, trainer)
        self.addCleanup(pub.release)
        engine = self.engine(name, model)
        self.assertTrue(engine.zero_copy)
        self.assertEqual(self.memory_of(name, refit.SOURCE), {"cuda"})
        self.assertEqual(self.memory_of(name, refit.DESTINATION), {"cuda"})
        timings = []
        for version in (1, 2, 3, 4):
            if version == 4:  # one tensor changed: the delta / sparse path
                ckpt = dict(ckpt)
                o = "model.layers.0.self_attn.o_proj.weight"
                ckpt[o] = ckpt[o].clone()
                ckpt[o][3, :17] += 1
            elif version > 1:
                ckpt = checkpoint(version)
            with torch.no_grad():
                for n, p in trainer.named_parameters():
                    p.copy_(ckpt[n].to("cuda"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pub.publish(version)
            t1 = time.perf_counter()
            self.assertEqual(refit_vllm.sync(engine, version), f"{name}@{version}")
            t2 = time.perf_counter()
            timings.append((version, t1 - t0, t2 - t1))
            self.check(model, ckpt, f"version {version}")
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
            self.assertEqual({n: p.data_ptr() for n, p in trainer.named_parameters()},
                             trainer_pointers)
        self.assertEqual(model.load_weights_calls, 0)
        for version, publish_s, sync_s in timings:
            print(f"torch-gpu: version {version}: publish {publish_s * 1e3:.1f} ms, "
                  f"sync (Apply into the CUDA parameters) {sync_s * 1e3:.1f} ms",
                  file=sys.stderr)

    def test_engine_reregistered_after_shutdown_gets_the_version(self):
        name = "torch-gpu-again"
        ckpt = checkpoint(7)
        trainer = Params(ckpt, "cuda")
        pub = refit.torch.publisher(self.client, name, trainer)
        self.addCleanup(pub.release)
        pub.publish(1)
        first = VllmShapedModel().cuda()
        engine = self.engine(name, first)
        self.assertEqual(refit_vllm.sync(engine, 1), f"{name}@1")
        self.check(first, ckpt, "first engine")
        engine.shutdown()
        second = VllmShapedModel().cuda()  # new cudaMalloc blocks, new handles
        engine = self.engine(name, second)
        self.assertEqual(refit_vllm.sync(engine, 1), f"{name}@1")
        self.check(second, ckpt, "second engine")
        self.check(first, ckpt, "first engine after its shutdown")  # kept the last version


if __name__ == "__main__":
    unittest.main(argv=sys.argv)
