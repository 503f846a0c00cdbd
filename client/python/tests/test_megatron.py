"""refit.torch.publisher(layout="megatron") with megatron-core's own modules, built on the CPU.

- ModulesTest (one process): the mapping checked against megatron-core itself. A GPTModel
  (Qwen3-like: grouped-query attention with linear_qkv interleaved per query group, q/k norms,
  SwiGLU linear_fc1) published through a real refitd into transformers' Qwen3ForCausalLM gives
  Megatron's logits; GroupedMLP's weight1/weight2 published as strided views equal what
  Megatron's own GroupedMLP.sharded_state_dict() says each expert's fc1/fc2 is.
- TrainersTest: megatron_trainer.py ranks (torch.distributed on gloo, parallel_state with TP, PP,
  virtual pipeline, EP) publish on one refitd; an engine on a second refitd registers vLLM's layout (qkv_proj,
  gate_up_proj, experts.w13_weight/w2_weight through refit.mapping) and applies every version,
  which must equal, bit for bit, the unsharded Hugging Face state_dict that rank 0 made without
  refit (all-gathered shards, converted by Megatron's rules).
- BadInputTest: Partial placements, two ranks claiming one shard with different values, a
  rename colliding, a parameter refit has no name for: a PublisherError naming the parameter
  and the rank, raised before anything is registered; the daemon keeps serving.

Run by Bazel (//client/python:megatron_test) in the test environment.
"""

import contextlib
import os
import sys
import tempfile
import unittest

# megatron-core imports flashinfer where it is installed (vLLM brings it), which makes its
# workspace under $HOME at import: read-only in Bazel's sandbox. The ranks inherit this.
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE",
                      os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp(prefix="flashinfer-"))

import torch  # noqa: E402
import torch.distributed as dist

import refit
import refit.testing
import refit.torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_trainer as mt  # noqa: E402
from test_torch import (VLLM as _VLLM, finish, free_port, launch, two_nodes,  # noqa: E402
                        wait_for_version)
from refit.mapping import FusedMapping  # noqa: E402

STEPS = 3
VLLM = FusedMapping(stacked=_VLLM.stacked,
                    experts=[("experts.w13_weight", ["gate_proj", "up_proj"]),
                             ("experts.w2_weight", ["down_proj"])])


def _init_single():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


@contextlib.contextmanager
def megatron_on_cpu():
    """megatron-core's forward asks for the CUDA device (rotary embeddings) and forks the CUDA
    RNG tracker (attention dropout); on the CPU, for one forward pass, they are the CPU."""
    from megatron.core.tensor_parallel import random as megatron_random
    saved = torch.cuda.current_device, megatron_random.CudaRNGStatesTracker.fork
    torch.cuda.current_device = lambda: "cpu"
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, megatron_random.CudaRNGStatesTracker.fork = saved


class ModulesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        _init_single()
        cls.daemon = refit.testing.Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.client = self.daemon.client()

    def engine(self, model: str, shapes, version: int):
        dst = self.client.register(model, refit.DESTINATION,
                                   {k: torch.zeros(s) for k, s in shapes.items()})
        self.addCleanup(dst.release)
        self.client.apply(model, [dst], version)
        return {k: v.clone() for k, v in dst.tensors.items()}

    def test_gpt_model_logits_through_refit_into_transformers(self):
        from transformers import Qwen3Config, Qwen3ForCausalLM
        torch.manual_seed(0)
        model = mt.build(moe=False, grouped=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        pub = refit.torch.publisher(self.client, "megatron-logits", model, layout="megatron")
        self.addCleanup(pub.release)
        # linear_qkv: 4 query groups, 2 heads each: q, k, v boxes per group.
        q = [s for s in pub.slices() if s[0] == "model.layers.0.self_attn.q_proj.weight"]
        self.assertEqual([s[3] for s in q], [(0, 0), (16, 0), (32, 0), (48, 0)])
        pub.publish(1)
        hf = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=mt.VOCAB, hidden_size=mt.HIDDEN, intermediate_size=mt.FFN,
            num_hidden_layers=mt.LAYERS, num_attention_heads=mt.HEADS,
            num_key_value_heads=mt.GROUPS, head_dim=mt.HEAD_DIM, tie_word_embeddings=False,
            max_position_embeddings=64, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
        shapes = mt.hf_shapes(moe=False)
        self.assertEqual(set(shapes), set(hf.state_dict()))
        hf.load_state_dict(self.engine("megatron-logits", shapes, 1))
        x = torch.randint(0, mt.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
        mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), 1)
        model.eval()
        with torch.no_grad(), megatron_on_cpu():
            want = model(input_ids=x, position_ids=torch.arange(12).expand(2, 12),
                         attention_mask=mask)
        with torch.no_grad():
            got = hf(input_ids=x).logits
        diff = (got - want).abs().max().item()
        self.assertLess(diff, 1e-4, "transformers' Qwen3 with refit's names differs from "
                                    "Megatron's GPTModel")
        self.assertGreater(want.abs().max().item(), 0.1)

    def test_padded_vocabulary_rows_left_out(self):
        """Megatron pads the vocabulary (to a multiple of 128 x TP in Megatron-LM): with
        vocab_size= the Hugging Face tensors are the real rows only."""
        torch.manual_seed(2)
        model = mt.build(moe=False, grouped=False, vocab=mt.VOCAB + 4)
        pub = refit.torch.publisher(self.client, "megatron-vocab", model, layout="megatron",
                                    vocab_size=mt.VOCAB)
        self.addCleanup(pub.release)
        boxes = {s[0]: s for s in pub.slices()}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            self.assertEqual(boxes[name][2:], ((mt.VOCAB, mt.HIDDEN), (0, 0),
                                               (mt.VOCAB, mt.HIDDEN)))
        pub.publish(1)
        got = self.engine("megatron-vocab", mt.hf_shapes(moe=False), 1)
        self.assertTrue(torch.equal(got["model.embed_tokens.weight"],
                                    model.embedding.word_embeddings.weight[:mt.VOCAB].detach()))
        self.assertTrue(torch.equal(got["lm_head.weight"],
                                    model.output_layer.weight[:mt.VOCAB].detach()))

    def test_grouped_mlp_against_its_sharded_state_dict(self):
        """GroupedMLP (EP 1, 4 experts): each expert's gate/up/down as refit publishes them
        (strided, transposed views of weight1/weight2) equal megatron-core's own
        sharded_state_dict of the module (its checkpoint rule, per expert)."""
        torch.manual_seed(1)
        model = mt.build(moe=True, grouped=True)
        experts = model.decoder.layers[0].mlp.experts
        self.assertEqual(type(experts).__name__, "GroupedMLP")
        pub = refit.torch.publisher(self.client, "megatron-grouped", model, layout="megatron")
        self.addCleanup(pub.release)
        strided = [s for s in pub._entries if s.fqn.endswith("experts.weight1")]
        self.assertTrue(strided and all(v.strides for v in strided[0].views))
        pub.publish(1)
        shapes = mt.hf_shapes(moe=True)
        got = self.engine("megatron-grouped", shapes, 1)
        sharded = experts.sharded_state_dict(prefix="decoder.layers.0.mlp.")

        def flat(tree):
            if isinstance(tree, dict):
                for v in tree.values():
                    yield from flat(v)
            elif isinstance(tree, (list, tuple)):
                for v in tree:
                    yield from flat(v)
            elif type(tree).__name__ in ("ShardedTensor", "ShardedTensorFactory"):
                yield tree

        tensors = []
        for t in flat(sharded):  # ShardedTensorFactory (GroupedMLP's rule) -> ShardedTensors
            tensors.extend(flat(t.build()) if hasattr(t, "build") else [t])
        self.assertTrue(tensors)
        checked = 0
        for t in tensors:
            # fc1: two [E, F, H] tensors of a [E, 2F, H] whole (gate at row offset 0, up at F);
            # fc2: [E, H, F]; the first offset is the expert.
            self.assertEqual(tuple(t.data.shape), tuple(t.local_shape), t.key)
            for i in range(t.data.shape[0]):
                e = t.global_offset[0] + i
                p = f"model.layers.0.mlp.experts.{e}."
                if t.key.endswith("linear_fc1.weight"):
                    part = "gate_proj" if t.global_offset[1] == 0 else "up_proj"
                    self.assertEqual(t.global_shape[1:], (2 * mt.MOE_FFN, mt.HIDDEN))
                else:
                    part = "down_proj"
                    self.assertEqual(t.global_shape[1:], (mt.HIDDEN, mt.MOE_FFN))
                self.assertTrue(torch.equal(got[p + part + ".weight"], t.data[i]), p + part)
                checked += 1
        self.assertEqual(checked, 3 * mt.EXPERTS)


class TrainersTest(unittest.TestCase):
    """Megatron trainers (TP, PP, EP) into a vLLM-layout engine on another node."""

    def run_trainer(self, mode: str):
        tp, pp, ep, moe, grouped, world = mt.MODES[mode]
        trainer_node, engine_node = two_nodes(self)
        out_dir = tempfile.mkdtemp(prefix="refit-megatron-")
        self.addCleanup(lambda: __import__("shutil").rmtree(out_dir, ignore_errors=True))
        model_name = f"megatron-{mode}"
        shapes = mt.hf_shapes(moe, mt.layers_of(mode))
        engine = engine_node.client()
        dst = engine.register(model_name, refit.DESTINATION, VLLM.layout(shapes, torch.float32))
        self.addCleanup(dst.release)
        params = VLLM.fused_views(dst)
        self.assertIn("model.layers.1.self_attn.qkv_proj.weight", params)
        if moe:
            self.assertEqual(tuple(params["model.layers.1.mlp.experts.w13_weight"].shape),
                             (mt.EXPERTS, 2 * mt.MOE_FFN, mt.HIDDEN))
        procs = launch("megatron_trainer.py", world, f"--socket={trainer_node.socket}",
                       f"--mode={mode}", f"--steps={STEPS}", f"--out={out_dir}",
                       f"--model={model_name}")
        from safetensors.torch import load_file
        try:
            for version in range(1, STEPS + 1):
                wait_for_version(self, engine, model_name, version, procs)
                self.assertEqual(engine.apply(model_name, [dst], version).version, version)
                want = load_file(os.path.join(out_dir, f"v{version}.safetensors"))
                self.assertEqual(set(want), set(shapes))
                for target, members in VLLM.parts(want).items():
                    got = params[target]
                    expected = torch.cat([want[n] for n, _ in members]).view(got.shape)
                    self.assertTrue(torch.equal(got, expected),
                                    f"{mode} version {version}: {target} differs")
            open(os.path.join(out_dir, "done"), "w").close()
        finally:
            outs = finish(self, procs)
        for rank, out in enumerate(outs):
            self.assertIn(f"rank {rank}: published version {STEPS}", out)
            self.assertIn("rehomes=0", out)
        return outs

    def test_tensor_parallel_two_ranks_interleaved_qkv(self):
        outs = self.run_trainer("tp")
        # Per rank: 2 of the 4 query groups, each a q, k and v box (12 of the layer's boxes).
        self.assertIn("publishing", outs[0])

    def test_expert_parallel_two_ranks(self):
        self.run_trainer("ep")

    def test_expert_parallel_grouped_mlp(self):
        self.run_trainer("grouped")

    def test_pipeline_parallel_two_stages(self):
        outs = self.run_trainer("pp")
        self.assertIn("layers [0]", outs[0])
        self.assertIn("layers [1]", outs[1])

    def test_virtual_pipeline_two_stages_two_chunks(self):
        """PP 2 x virtual pipeline 2 (4 layers: rank 0 holds layers 0 and 2, rank 1 layers 1
        and 3), each rank's chunks published as one list."""
        outs = self.run_trainer("vpp")
        self.assertIn("rank 0: publishing", outs[0])
        self.assertIn("layers [0, 2]", outs[0])
        self.assertIn("layers [1, 3]", outs[1])

    def test_tensor_x_expert_parallel_four_ranks(self):
        self.run_trainer("tp_ep")


class BadInputTest(unittest.TestCase):
    """Each a PublisherError naming the parameter and the rank; nothing registered."""

    def run_case(self, case: str, world: int = 2):
        daemon = refit.testing.Daemon()
        self.addCleanup(daemon.stop)
        outs = finish(self, launch("megatron_bad_ranks.py", world, f"--socket={daemon.socket}",
                                   f"--case={case}"), timeout=180)
        status = daemon.client().status()  # still serving
        self.assertNotIn(f"bad-{case}", [m.model for m in status.models])
        for rank, out in enumerate(outs):
            self.assertIn(f"rank {rank}: ERROR", out)
        return outs

    def test_two_ranks_claiming_one_shard(self):
        """Both ranks think they are TP rank 0 of 1 but hold different values (a wrong
        parallel_state): every rank names the tensor, the Megatron parameter and both ranks."""
        for out in self.run_case("duplicate"):
            self.assertIn("parameter model.layers.0.self_attn.o_proj.weight (from "
                          "decoder.layers.0.self_attention.linear_proj.weight): ranks [0, 1] "
                          "all claim the shard at offsets [0, 0] sizes [64, 64] with different "
                          "values", out)

    def test_partial_rename_and_unknown_parameter(self):
        outs = self.run_case("partial")
        self.assertIn("rank 0: parameter decoder.final_layernorm.weight has placement Partial",
                      outs[0])
        self.assertIn("rank 1: parameters decoder.layers.0.input_layernorm.weight and "
                      "decoder.final_layernorm.weight both give model.norm.weight", outs[0])
        self.assertIn("rank 1: parameter decoder.layers.1.extra_scale: refit has no Hugging "
                      "Face name for this Megatron parameter", outs[1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
