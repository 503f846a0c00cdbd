"""refit.mapping through a real refitd: a trainer publishing per-tensor checkpoints (q/k/v,
gate/up, per-expert gate/up/down) and an expert-parallel engine rank whose fused parameters
(`qkv_proj`, `gate_up_proj`, `experts.w13_weight` [E_local, 2I, H], `experts.w2_weight`) are
views of its DESTINATION buffer: Apply writes them in place. And the other way round: a trainer
holding fused [E, ., .] expert tensors into per-expert engine tensors, sliced on dim 0."""

import sys
import unittest

import torch

import refit
from refit.mapping import FusedMapping
from test_fp8 import DaemonCase

H, KV, I, E = 64, 32, 96, 4
P = "model.layers.0."
MAPPING = FusedMapping(
    stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
             ("gate_up_proj", ["gate_proj", "up_proj"])],
    experts=[("experts.w13_weight", ["gate_proj", "up_proj"]),
             ("experts.w2_weight", ["down_proj"])])


def checkpoint(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {P + "self_attn.q_proj.weight": (H, H), P + "self_attn.k_proj.weight": (KV, H),
              P + "self_attn.v_proj.weight": (KV, H), P + "mlp.shared.gate_proj.weight": (I, H),
              P + "mlp.shared.up_proj.weight": (I, H), P + "input_layernorm.weight": (H,)}
    for e in range(E):
        shapes[P + f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        shapes[P + f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        shapes[P + f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


class MappingTest(DaemonCase):
    def test_expert_parallel_rank_with_fused_parameters_in_place(self):
        ckpt = checkpoint(1)
        src = self.register("moe", refit.SOURCE, ckpt)
        shapes = {n: tuple(t.shape) for n, t in ckpt.items()}
        rank1 = self.register("moe", refit.DESTINATION,
                              MAPPING.layout(shapes, torch.bfloat16, experts=range(2, 4)))
        params = MAPPING.fused_views(rank1)
        self.assertEqual(sorted(params), sorted([
            P + "self_attn.qkv_proj.weight", P + "mlp.shared.gate_up_proj.weight",
            P + "input_layernorm.weight", P + "mlp.experts.w13_weight",
            P + "mlp.experts.w2_weight"]))
        self.assertEqual(tuple(params[P + "mlp.experts.w13_weight"].shape), (2, 2 * I, H))
        self.client.publish("moe", 1, [src])
        self.client.wait_for_version("moe", 1, timeout=10)
        self.client.apply("moe", [rank1], 1)
        qkv = torch.cat([ckpt[P + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        self.assertTrue(torch.equal(params[P + "self_attn.qkv_proj.weight"], qkv))
        for local, e in enumerate((2, 3)):
            w13 = torch.cat([ckpt[P + f"mlp.experts.{e}.gate_proj.weight"],
                             ckpt[P + f"mlp.experts.{e}.up_proj.weight"]])
            self.assertTrue(torch.equal(params[P + "mlp.experts.w13_weight"][local], w13))
            self.assertTrue(torch.equal(params[P + "mlp.experts.w2_weight"][local],
                                        ckpt[P + f"mlp.experts.{e}.down_proj.weight"]))

    def test_fused_trainer_experts_into_per_expert_engine_tensors(self):
        g = torch.Generator().manual_seed(2)
        w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
        src = self.register("moe-fused", refit.SOURCE, {"experts.w13": w13})
        # Engine rank 0 of 2 (EP): experts 0 and 1, each its own tensor (one buffer each: a
        # buffer holds one box of a tensor), each a dim-0 box of the trainer's fused w13.
        dsts = [self.register("moe-fused", refit.DESTINATION, {"experts.w13": refit.Slice(
            torch.zeros(1, 2 * I, H, dtype=torch.bfloat16), global_shape=(E, 2 * I, H),
            offsets=(e, 0, 0))}) for e in (0, 1)]
        self.client.publish("moe-fused", 1, [src])
        self.client.wait_for_version("moe-fused", 1, timeout=10)
        self.client.apply("moe-fused", dsts, 1)
        for e, dst in enumerate(dsts):
            self.assertTrue(torch.equal(dst.tensors["experts.w13"][0], w13[e]))

if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
