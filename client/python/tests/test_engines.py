"""The engine adapters (refit.vllm, refit.sglang) against a real refitd and a torch model shaped
like a vLLM / SGLang model: fused `qkv_proj` and `gate_up_proj` parameters filled by
`load_weights(weights: Iterable[tuple[str, Tensor]])` from checkpoint names (q/k/v_proj,
gate/up_proj) through a stacked-params mapping, and an fp8 `down_proj` (`weight` as e4m3fn
bytes + `weight_scale_inv`). vLLM and SGLang themselves are not installed: this is what was run."""

import sys
import unittest

import torch

import refit
import refit.testing
from refit import sglang as refit_sglang
from refit import vllm as refit_vllm
from test_fp8 import DaemonCase, reference

H, KV, I = 128, 64, 256
CKPT = {
    "model.layers.0.self_attn.q_proj.weight": (H, H),
    "model.layers.0.self_attn.k_proj.weight": (KV, H),
    "model.layers.0.self_attn.v_proj.weight": (KV, H),
    "model.layers.0.mlp.gate_proj.weight": (I, H),
    "model.layers.0.mlp.up_proj.weight": (I, H),
    "model.layers.0.mlp.down_proj.weight": (H, I),
}
FP8 = ["model.layers.0.mlp.down_proj.weight"]


class FakeEngineModel(torch.nn.Module):
    """Parameters named and fused the way vLLM's Llama is; load_weights maps checkpoints."""

    stacked = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", H),
               ("qkv_proj", "v_proj", H + KV), ("gate_up_proj", "gate_proj", 0),
               ("gate_up_proj", "up_proj", I)]

    def __init__(self):
        super().__init__()
        p = "model.layers.0."
        self.params = {
            p + "self_attn.qkv_proj.weight": torch.zeros(H + 2 * KV, H, dtype=torch.bfloat16),
            p + "mlp.gate_up_proj.weight": torch.zeros(2 * I, H, dtype=torch.bfloat16),
            p + "mlp.down_proj.weight": torch.zeros(H, I, dtype=torch.uint8),  # e4m3fn bytes
            p + "mlp.down_proj.weight_scale_inv": torch.zeros(1, 2, dtype=torch.float32),
        }

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            for fused, part, offset in self.stacked:
                if f".{part}." in name:
                    target = self.params[name.replace(part, fused)]
                    target[offset:offset + tensor.shape[0]].copy_(tensor)
                    break
            else:
                self.params[name].copy_(tensor)
            loaded.add(name)
        return loaded


def checkpoint(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in CKPT.items()}


class EnginesTest(DaemonCase):
    def check(self, model, ckpt):
        p = "model.layers.0."
        attn = ckpt[p + "self_attn.q_proj.weight"], ckpt[p + "self_attn.k_proj.weight"], \
            ckpt[p + "self_attn.v_proj.weight"]
        self.assertTrue(torch.equal(model.params[p + "self_attn.qkv_proj.weight"],
                                    torch.cat(attn)))
        mlp = ckpt[p + "mlp.gate_proj.weight"], ckpt[p + "mlp.up_proj.weight"]
        self.assertTrue(torch.equal(model.params[p + "mlp.gate_up_proj.weight"], torch.cat(mlp)))
        codes, scales = reference(ckpt[p + "mlp.down_proj.weight"])
        self.assertTrue(torch.equal(model.params[p + "mlp.down_proj.weight"], codes))
        self.assertTrue(torch.equal(model.params[p + "mlp.down_proj.weight_scale_inv"]
                                    .view(torch.int32), scales.view(torch.int32)))

    def test_vllm_engine_four_phases_pause_resume(self):
        model = FakeEngineModel()
        engine = refit_vllm.RefitWeightTransferEngine(model=model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": "vllm-policy", "socket": self.daemon.socket, "fp8": FP8,
            "params": {n: [list(s), "bfloat16"] for n, s in CKPT.items()}}))
        self.addCleanup(engine.shutdown)
        src = None
        events = []
        for version in (1, 2):
            ckpt = checkpoint(version)
            src = self.publish("vllm-policy", version, ckpt, src)
            tag = refit_vllm.sync(engine, version, pause=lambda: events.append("pause"),
                                  resume=lambda: events.append("resume"))
            self.assertEqual(tag, f"vllm-policy@{version}")
            self.check(model, ckpt)
        self.assertEqual(events, ["pause", "resume"] * 2)
        with self.assertRaises(ValueError):
            engine.parse_update_info({"versoin": 3})

    def test_sglang_receiver_refuses_a_diverged_version(self):
        model = FakeEngineModel()
        receiver = refit_sglang.RefitWeightReceiver(
            model, "sglang-policy", {n: (s, torch.bfloat16) for n, s in CKPT.items()}, FP8,
            socket=self.daemon.socket)
        ckpt = checkpoint(5)
        src = self.publish("sglang-policy", 1, ckpt)
        self.assertEqual(receiver.receive(1), "sglang-policy@1")
        self.check(model, ckpt)
        bad = {k: v.clone() for k, v in ckpt.items()}
        bad["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
        self.publish("sglang-policy", 2, bad, src)
        with self.assertRaises(refit_sglang.NonFiniteVersionError) as e:
            receiver.receive(2)
        self.assertEqual(e.exception.count, 1)
        self.check(model, ckpt)  # the engine still holds version 1
        receiver.destroy()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
