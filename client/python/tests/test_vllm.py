"""refit.vllm against the installed vLLM (client/python/requirements-test.txt), on the CPU,
through a real refitd: vLLM's own model classes (Llama, Qwen3, Qwen3-MoE; Llama with vLLM's
fp8 block quantization) built from small configs, refit found by vLLM through its
`vllm.general_plugins` entry point as the weight-transfer backend `refit`, created by vLLM's
WeightTransferEngineFactory from a WeightTransferConfig, driven through its four phases.
After each version every parameter of the engine's model holds, bit for bit, what vLLM's own
`load_weights` makes of the same Hugging Face checkpoint in a second instance of the model,
and nothing went through `load_weights` (zero copy; the parameters' storage never moves after
setup). Tensor parallelism: test_vllm_tp.py."""

import os
import sys
import tempfile
import tomllib
import unittest

import vllm_models as vm  # sets VLLM_TARGET_DEVICE before vLLM is imported

import torch

import refit
import refit.testing
from refit import vllm as refit_vllm
from refit.engine_storage import MappingError
from test_fp8 import DaemonCase, reference

HERE = os.path.dirname(os.path.abspath(__file__))


def entry_point_dist(pyproject: str) -> str:
    """A directory holding refit's distribution metadata with the entry points that
    client/python/pyproject.toml declares (what `pip install ./client/python` writes), so
    that importlib.metadata — and so vLLM's plugin loader — finds them without installing."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    root = tempfile.mkdtemp(prefix="engines-dist-")
    info = os.path.join(root, "refit-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: refit\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, entries in project["entry-points"].items():
            f.write(f"[{group}]\n")
            for name, value in entries.items():
                f.write(f"{name} = {value}\n")
    return root


def checkpoint_format(state):
    """transformers 5 holds a MoE layer's experts fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); checkpoints on disk hold them per expert
    (`experts.<e>.gate_proj.weight`, ...). The per-expert form, which vLLM loads."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def engine_checkpoint(state, fp8):
    """What vLLM's load_weights is given for the reference: bf16 tensors, and for fp8 names
    the e4m3fn codes and FP32 block scales of refit's rule (test_fp8.reference)."""
    items = []
    for name, t in state.items():
        if name in fp8:
            codes, scales = reference(t)
            items.append((name, codes.view(torch.float8_e4m3fn)))
            items.append((name + "_scale_inv", scales))
        else:
            items.append((name, t))
    return items


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8),
        b.detach().reshape(-1).contiguous().view(torch.uint8))


def assert_same_tensors(test: unittest.TestCase, mine, theirs, what: str) -> None:
    """`mine` and `theirs` (name -> tensor) name the same tensors, each the same bits."""
    test.assertEqual(sorted(mine), sorted(theirs))
    differ = [n for n in theirs if not same_bits(mine[n], theirs[n])]
    test.assertEqual(differ, [], what)


class VllmTest(DaemonCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        sys.path.insert(0, entry_point_dist(os.path.join(HERE, "..", "pyproject.toml")))
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        # A MoE config: vLLM creates its expert-parallel group only for MoE models, and the
        # groups are made once per process (dense models need none of it).
        vm.init_tp(vm.vllm_config("qwen3_moe"))

    def engine(self, config, model):
        """Created by vLLM's factory from a WeightTransferConfig naming the backend."""
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngine
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="refit"), config, torch.device("cpu"), model)
        self.assertIsInstance(engine, WeightTransferEngine)
        self.assertIsInstance(engine, refit_vllm.RefitWeightTransferEngine)
        self.addCleanup(engine.shutdown)
        return engine

    def run_kind(self, kind, fp8=False, versions=(1, 2)):
        name = f"vllm-{kind}{'-fp8' if fp8 else ''}"
        config = vm.vllm_config(kind, fp8=fp8)
        model, ref = vm.build(config), vm.build(vm.vllm_config(kind, fp8=fp8))
        state = checkpoint_format(vm.hf_state_dict(kind, 0))
        f8 = vm.fp8_names(state) if fp8 else []
        engine = self.engine(config, model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": self.daemon.socket, "fp8": f8, "storage": "zero_copy",
            "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}}))
        self.assertTrue(engine.zero_copy)
        self.assertEqual(engine.weights.layout, "probe")
        loads = []
        model.load_weights = lambda weights: loads.append(list(weights))  # must not be called
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in versions:
            state = checkpoint_format(vm.hf_state_dict(kind, version))
            src = self.publish(name, version, state, src)
            engine.start_weight_update()
            engine.update_weights({"version": version})
            engine.finish_weight_update()
            self.assertEqual(engine.weight_version, f"{name}@{version}")
            ref.load_weights(engine_checkpoint(state, f8))
            assert_same_tensors(self, dict(model.named_parameters()), dict(ref.named_parameters()),
                                f"{kind} v{version}: parameters that differ from vLLM's "
                                "load_weights")
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        self.assertEqual(loads, [])
        return model, engine

    def test_backend_registered_through_the_entry_point(self):
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        self.assertIn("refit", WeightTransferEngineFactory._registry)
        refit_vllm.register()  # vLLM may load plugins again: no error

    def test_llama(self):
        self.run_kind("llama")

    def test_qwen3(self):
        self.run_kind("qwen3")

    def test_qwen3_moe(self):
        self.run_kind("qwen3_moe")

    def test_deepseek_v3_mla_moe(self):
        model, _ = self.run_kind("deepseek_v3")
        p = dict(model.named_parameters())
        # MLA: q_a_proj and kv_a_proj_with_mqa fused into fused_qkv_a_proj (256 + 128 + 64
        # rows); routed experts fused into w13/w2, the shared expert's gate_up_proj fused.
        self.assertEqual(tuple(p["model.layers.0.self_attn.fused_qkv_a_proj.weight"].shape),
                         (448, 256))
        self.assertEqual(
            tuple(p["model.layers.1.mlp.experts.routed_experts.w13_weight"].shape),
            (4, 512, 256))

    def test_deepseek_v3_fp8_block_quantized(self):
        model, _ = self.run_kind("deepseek_v3_fp8", fp8=True)
        p = dict(model.named_parameters())
        self.assertEqual(p["model.layers.1.mlp.experts.routed_experts.w13_weight"].dtype,
                         torch.float8_e4m3fn)
        self.assertEqual(
            tuple(p["model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv"].shape),
            (4, 4, 2))

    def test_llama_fp8_block_quantized(self):
        model, engine = self.run_kind("llama", fp8=True)
        # Apply quantized on the node: fp8 bytes and FP32 scales in vLLM's own parameters.
        p = dict(model.named_parameters())
        self.assertEqual(p["model.layers.0.self_attn.qkv_proj.weight"].dtype,
                         torch.float8_e4m3fn)
        self.assertEqual(tuple(p["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape),
                         (4, 2))

    def test_bad_input_one_error_nothing_written(self):
        config = vm.vllm_config("llama")
        model = vm.build(config)
        state = vm.hf_state_dict("llama", 0)
        params = {n: [list(t.shape), "bfloat16"] for n, t in state.items()}
        params["model.layers.0.self_attn.q_proj.weight"] = [[128, 256], "bfloat16"]  # shape
        params["model.layers.1.mlp.gate_prj.weight"] = [[512, 256], "bfloat16"]  # name
        del params["lm_head.weight"]  # an engine parameter nothing fills
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = self.engine(config, model)
        with self.assertRaises(MappingError) as e:
            engine.init_transfer_engine(engine.parse_init_info({
                "model": "vllm-bad", "socket": self.daemon.socket, "params": params}))
        text = str(e.exception)
        self.assertIn("model.layers.0.self_attn.q_proj.weight", text)
        self.assertIn("model.layers.1.mlp.gate_prj.weight", text)
        self.assertIsNone(engine.weights)
        for n, p in model.named_parameters():
            self.assertTrue(same_bits(p, before[n]), n)
        names = [m.model for m in self.client.status().models]
        self.assertNotIn("vllm-bad", names)  # nothing registered
        # Without the bad names: the missing lm_head is the one error.
        params.pop("model.layers.1.mlp.gate_prj.weight")
        params["model.layers.0.self_attn.q_proj.weight"] = [[256, 256], "bfloat16"]
        with self.assertRaises(MappingError) as e:
            engine.init_transfer_engine(engine.parse_init_info({
                "model": "vllm-bad", "socket": self.daemon.socket, "params": params}))
        self.assertIn("lm_head.weight", str(e.exception))
        # A missing scale tensor: an fp8 engine given no fp8 names (no weight_scale_inv).
        fp8_config = vm.vllm_config("llama", fp8=True)
        fp8_model = vm.build(fp8_config)
        engine = self.engine(fp8_config, fp8_model)
        with self.assertRaises(MappingError) as e:
            engine.init_transfer_engine(engine.parse_init_info({
                "model": "vllm-bad", "socket": self.daemon.socket,
                "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}}))
        self.assertIn("weight_scale_inv", str(e.exception))

    def test_failed_update_keeps_the_engine_serving(self):
        """A failed Apply (the test build's fault switch flips a destination byte under the
        first verified Apply: DATA_LOSS) and a version that does not come: vLLM's own utility
        call path answers the failure with the held version in its text, the parameters hold
        what they held, and the next update works."""
        from vllm.v1.engine import UtilityOutput
        from vllm.v1.engine.core import EngineCoreProc
        os.environ["REFIT_FAULT_APPLY_FLIP"] = "1"  # read by refitd_testing at its first Apply
        try:
            daemon = refit.testing.Daemon(binary=os.path.abspath(os.environ["REFITD_TESTING"]))
        finally:
            del os.environ["REFIT_FAULT_APPLY_FLIP"]
        self.addCleanup(daemon.stop)
        client = daemon.client()
        self.addCleanup(client.close)
        name = "vllm-failures"
        config = vm.vllm_config("llama")
        model, ref = vm.build(config), vm.build(vm.vllm_config("llama"))
        state = checkpoint_format(vm.hf_state_dict("llama", 1))
        engine = self.engine(config, model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": daemon.socket, "storage": "zero_copy",
            "params": {n: [list(t.shape), "bfloat16"] for n, t in state.items()}}))
        src = client.register(name, refit.SOURCE, dict(state))
        self.addCleanup(src.release)
        client.publish(name, 1, [src])

        def utility(update_info):  # how vLLM's engine core runs a collective_rpc utility call
            out = []
            EngineCoreProc._invoke_utility_method(
                "update_weights", lambda: engine.update_weights(update_info),
                UtilityOutput(call_id=1), out.append)
            return out[0].failure_message

        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        message = utility({"version": 1})
        self.assertIn("DATA_LOSS", message)
        self.assertIn("version 1 was not applied; the engine still holds version 0", message)
        self.assertEqual(engine.weights.version, 0)
        for n, p in model.named_parameters():  # atomic Apply: every byte as it was
            self.assertTrue(same_bits(p, before[n]), n)
        self.assertIsNone(utility({"version": 1}))  # the next update works
        self.assertEqual(engine.weight_version, f"{name}@1")
        ref.load_weights(engine_checkpoint(state, []))
        theirs = dict(ref.named_parameters())
        self.assertEqual([n for n, p in model.named_parameters()
                          if not same_bits(p, theirs[n])], [])
        # A version that does not come within the update's timeout: version 1 still served.
        message = utility({"version": 2, "timeout": 0.5})
        self.assertIn("DEADLINE_EXCEEDED", message)
        self.assertIn("the engine still holds version 1", message)
        self.assertEqual([n for n, p in model.named_parameters()
                          if not same_bits(p, theirs[n])], [])
        state = checkpoint_format(vm.hf_state_dict("llama", 2))
        for n, t in state.items():
            src.tensors[n].copy_(t)
        client.publish(name, 2, [src])
        self.assertIsNone(utility({"version": 2}))
        self.assertEqual(engine.weight_version, f"{name}@2")

    def test_unknown_release_refused(self):
        with self.assertRaises(ValueError) as e:
            refit_vllm.check_release("0.40.1")
        self.assertIn("0.40.1", str(e.exception))
        refit_vllm.check_release("0.33.0")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
