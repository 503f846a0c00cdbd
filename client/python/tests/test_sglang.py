"""refit.sglang against the installed SGLang 0.5.23 (the overlay environment of
client/python/requirements-sglang.txt), on the CPU, through a real refitd: SGLang's own model
classes (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA and MoE; Qwen3 and DeepSeek-V3 with
SGLang's Fp8Config block quantization) built from small configs (sglang_models.py), the refit
receiver created and fed by SGLang's own WeightUpdater.update_weights_from_tensor with
load_format = the custom weight loader the server lists in --custom-weight-loader (what
ModelRunner does for the RL framework's Engine.update_weights_from_tensor). After each version
every parameter — and DeepSeek's derived MLA w_kc/w_vc — holds, bit for bit, what SGLang's own
load_weights makes of the same Hugging Face checkpoint in a second instance of the model, and
nothing went through load_weights (zero copy; the parameters' storage never moves after
setup). Failed updates leave the engine serving what it held and never raise into SGLang."""

import sys
import unittest

import sglang_models as sm
import vllm_models as vm

import torch

import refit
from refit import sglang as refit_sglang
from test_fp8 import DaemonCase
from test_vllm import assert_same_tensors, checkpoint_format, engine_checkpoint, same_bits


class SglangTest(DaemonCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        sm.init()

    def settings(self, name, state, fp8=(), **extra):
        return dict({"model": name, "socket": self.daemon.socket, "fp8": list(fp8),
                     "storage": "zero_copy",
                     "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}},
                    **extra)

    def load(self, updater, tensors):
        """What SGLang's scheduler calls per update_weights_from_tensor request."""
        ok, message = updater.update_weights_from_tensor(tensors, load_format=sm.LOADER)
        self.assertTrue(ok, message)

    def compare(self, model, ref, what):
        assert_same_tensors(self, dict(model.named_parameters()), dict(ref.named_parameters()),
                            f"{what}: parameters that differ from SGLang's load_weights")
        assert_same_tensors(self, sm.derived(model), sm.derived(ref),
                            f"{what}: derived tensors that differ")

    def run_kind(self, kind, fp8=False, versions=(1, 2), name=None):
        name = name or f"sglang-{kind}{'-fp8' if fp8 else ''}"
        model, ref = sm.build(kind, fp8), sm.build(kind, fp8)
        state = checkpoint_format(vm.hf_state_dict(kind, 0))
        f8 = vm.fp8_names(state) if fp8 else []
        updater = sm.weight_updater(model)
        self.load(updater, refit_sglang.init_tensors(self.settings(name, state, f8)))
        self.assertIsNone(refit_sglang.last_error(model))
        receiver = model._refit_receiver
        self.addCleanup(receiver.destroy)
        self.assertTrue(receiver.zero_copy)
        self.assertEqual(receiver.weights.layout, "probe")
        loads = []
        model.load_weights = lambda weights: loads.append(list(weights))  # must not be called
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in versions:
            state = checkpoint_format(vm.hf_state_dict(kind, version))
            src = self.publish(name, version, state, src)
            self.load(updater, refit_sglang.version_tensors(version))
            self.assertIsNone(refit_sglang.last_error(model))
            self.assertEqual(receiver.version, version)
            ref.load_weights(engine_checkpoint(state, f8))
            self.compare(model, ref, f"{kind} v{version}")
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        self.assertEqual(loads, [])
        self.assertEqual(refit_sglang.held_versions(self.client, name),
                         {"sglang-tp0": versions[-1]})
        return model, ref, receiver, src

    def test_llama(self):
        self.run_kind("llama")

    def test_qwen3(self):
        self.run_kind("qwen3", versions=(1,))

    def test_qwen3_moe(self):
        model, _, _, _ = self.run_kind("qwen3_moe", versions=(1,))
        p = dict(model.named_parameters())
        self.assertEqual(tuple(p["model.layers.0.mlp.experts.w13_weight"].shape),
                         (4, 256, 256))

    def test_deepseek_v3_mla_moe(self):
        model, _, _, _ = self.run_kind("deepseek_v3")
        p = dict(model.named_parameters())
        self.assertEqual(
            tuple(p["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"].shape),
            (448, 256))
        self.assertIn("model.layers.0.self_attn.w_kc", sm.derived(model))

    def test_qwen3_fp8_block_quantized(self):
        # Qwen3 (as Qwen's own -FP8 checkpoints: [128, 128] blocks, `weight_scale_inv`). Not
        # Llama: SGLang 0.5.23's LlamaForCausalLM.load_weights renames `weight_scale_inv` to
        # `weight_scale`, which its Fp8Config block layer does not have, so SGLang's own loader
        # cannot load a block-quantized Llama checkpoint (its scales are dropped).
        model, _, _, _ = self.run_kind("qwen3", fp8=True, versions=(1,))
        # Quantized on the node: e4m3fn bytes and FP32 block scales in SGLang's own
        # parameters (its scale layout: `weight_scale_inv`, one row per 128 fused rows).
        p = dict(model.named_parameters())
        self.assertEqual(p["model.layers.0.self_attn.qkv_proj.weight"].dtype,
                         torch.float8_e4m3fn)
        self.assertEqual(tuple(p["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape),
                         (4, 2))

    def test_deepseek_v3_fp8_block_quantized(self):
        model, _, _, _ = self.run_kind("deepseek_v3_fp8", fp8=True, versions=(1,))
        p = dict(model.named_parameters())
        self.assertEqual(p["model.layers.1.mlp.experts.w13_weight"].dtype, torch.float8_e4m3fn)
        self.assertEqual(tuple(p["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape),
                         (4, 4, 2))

    def test_failed_update_keeps_the_engine_serving(self):
        """A version that does not come, and bad settings: nothing raised into SGLang, the
        parameters hold the version they held, the error and that version are surfaced, and
        the next update works."""
        name = "sglang-llama-failures"
        model, ref, receiver, src = self.run_kind("llama", versions=(1,), name=name)
        del model.load_weights  # SGLang's own again (run_kind counted calls)
        updater = sm.weight_updater(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        receiver.timeout = 1.0  # the version never comes: a short wait
        self.load(updater, refit_sglang.version_tensors(2))
        error = refit_sglang.last_error(model)
        self.assertIsInstance(error, refit.DeadlineExceededError)
        self.assertEqual(error.held_version, 1)
        self.assertIn("the engine still holds version 1", str(error))
        for n, p in model.named_parameters():
            self.assertTrue(same_bits(p, before[n]), n)
        self.assertEqual(refit_sglang.held_versions(self.client, name),
                         {"sglang-tp0": 1})
        # Bad settings (a misspelt name and a wrong shape): one error listing both, the
        # receiver kept, nothing written.
        state = checkpoint_format(vm.hf_state_dict("llama", 2))
        bad = self.settings(name, state)
        bad["params"]["model.layers.0.self_attn.q_proj.weight"] = [[128, 256], "bfloat16"]
        bad["params"]["model.layers.1.mlp.gate_prj.weight"] = [[512, 256], "bfloat16"]
        self.load(updater, refit_sglang.init_tensors(bad))
        error = refit_sglang.last_error(model)
        self.assertIsInstance(error, refit_sglang.MappingError)
        self.assertIn("model.layers.0.self_attn.q_proj.weight", str(error))
        self.assertIn("model.layers.1.mlp.gate_prj.weight", str(error))
        self.assertIs(model._refit_receiver, receiver)
        for n, p in model.named_parameters():
            self.assertTrue(same_bits(p, before[n]), n)
        # The next update works.
        self.publish(name, 2, state, src)
        self.load(updater, refit_sglang.version_tensors(2))
        self.assertIsNone(refit_sglang.last_error(model))
        ref.load_weights(engine_checkpoint(state, []))
        self.compare(model, ref, "llama after the failures")

    def test_missing_scale_tensor_and_unknown_release(self):
        # An fp8 engine given no fp8 names: no weight_scale_inv reaches its scale parameters.
        model = sm.build("qwen3", fp8=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = checkpoint_format(vm.hf_state_dict("qwen3", 0))
        with self.assertRaises(refit_sglang.MappingError) as e:
            refit_sglang.RefitWeightReceiver(
                model, "sglang-bad", {n: (t.shape, torch.bfloat16) for n, t in state.items()},
                socket=self.daemon.socket, storage="zero_copy")
        self.assertIn("weight_scale_inv", str(e.exception))
        for n, p in model.named_parameters():
            self.assertTrue(same_bits(p, before[n]), n)
        self.assertNotIn("sglang-bad", [m.model for m in self.client.status().models])
        with self.assertRaises(ValueError) as e:
            refit_sglang.check_release("0.5.22")
        self.assertIn("0.5.22", str(e.exception))
        import sglang
        refit_sglang.check_release(sglang.__version__)


if __name__ == "__main__":
    unittest.main(argv=sys.argv)
