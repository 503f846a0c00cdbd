"""Tensor-parallel vLLM engine ranks through a real refitd, on the CPU: TP 2 and TP 4 ranks
(one process each, vLLM's own model classes and TP groups on gloo: vllm_tp_rank.py) each
register their own shards of vLLM's parameters — fused qkv_proj with TP-split heads (and KV
heads replicated where TP exceeds them), gate_up_proj and column shards, o_proj / down_proj
row shards, vocab-parallel embedding and lm_head rows with padding, a Qwen3-MoE rank's
w13/w2 expert shards, fp8 weights with their block-scale shards — as DESTINATION memory, found
by asking vLLM's own loader (layout "probe"), and receive each version zero-copy: no
load_weights call, every parameter bit for bit what vLLM's own load_weights of the same
checkpoint makes on that rank, storage unmoved."""

import json
import os
import socket
import subprocess
import sys
import unittest

import torch

import refit
from test_fp8 import DaemonCase

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmTpTest(DaemonCase):
    def ranks(self, kinds, world, name):
        port = free_port()
        procs = []
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "vllm_tp_rank.py"), ",".join(kinds), "0",
                 str(rank), str(world), str(port), self.daemon.socket, name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [HERE, os.environ.get("PYTHONPATH", "")]))))

        def stop():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        self.addCleanup(stop)
        return procs

    @staticmethod
    def read(proc):
        while True:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"engine rank exited with {proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def run_tp(self, kinds, world):
        """One set of `world` rank processes serving `kinds` ([(kind, versions)], a kind
        ending in "+fp8" fp8) one after the other; per kind, each rank's shapes of its last
        version."""
        import vllm_models as vm
        from test_vllm import checkpoint_format
        base = f"vllm-tp{world}"
        procs = self.ranks([k for k, _ in kinds], world, base)
        out = {}
        for kind, versions in kinds:
            name = base if len(kinds) == 1 else f"{base}-{kind.replace('+', '-')}"
            ready = [self.read(p) for p in procs]
            for r, info in enumerate(ready):
                self.assertEqual(info["model"], name)
                self.assertTrue(info["zero_copy"], (kind, r, info))
            src = None
            for version in versions:
                state = checkpoint_format(vm.hf_state_dict(kind.removesuffix("+fp8"), version))
                if src is None:
                    src = self.register(name, refit.SOURCE, dict(state))
                else:
                    for n, t in state.items():
                        src.tensors[n].copy_(t)
                self.client.publish(name, version, [src])
                for p in procs:
                    p.stdin.write(f"{version}\n")
                    p.stdin.flush()
                shapes = []
                for r, p in enumerate(procs):
                    got = self.read(p)
                    self.assertEqual(got["weight_version"], f"{name}@{version}")
                    self.assertEqual(got["differ"], [], (kind, world, r, version))
                    self.assertEqual(got["loads"], 0)
                    self.assertTrue(got["pointers_stable"])
                    shapes.append(got["shapes"])
            out[kind] = shapes
            for p in procs:
                p.stdin.write("0\n")
                p.stdin.flush()
        for p in procs:
            self.assertEqual(p.wait(timeout=120), 0)
        return out

    def test_tp2_llama_qwen3_moe_fp8(self):
        """TP 2 ranks, one process each, serving three models in turn: Llama (two versions),
        Qwen3-MoE (w13/w2 expert shards), fp8 Llama (fp8 row shards and their scale rows)."""
        shapes = self.run_tp([("llama", (1, 2)), ("qwen3_moe", (1,)),
                              ("llama_mha+fp8", (1,))], 2)
        # Each rank holds half the heads: qkv 256/2 + 2 * 128/2 rows.
        self.assertEqual(shapes["llama"][0]["model.layers.0.self_attn.qkv_proj.weight"],
                         [256, 256])
        self.assertEqual(shapes["llama"][0]["model.layers.0.self_attn.o_proj.weight"],
                         [256, 128])
        self.assertEqual(
            shapes["qwen3_moe"][0]["model.layers.0.mlp.experts.routed_experts.w13_weight"],
            [4, 128, 256])
        self.assertEqual(
            shapes["llama_mha+fp8"][1]["model.layers.0.self_attn.qkv_proj.weight"], [384, 256])

    def test_qwen3_tp4_replicated_kv_heads(self):
        shapes = self.run_tp([("qwen3", (1,))], 4)
        # 4 query heads over 4 ranks, 2 KV heads replicated on 2 ranks each (64-dim heads).
        self.assertEqual(shapes["qwen3"][0]["model.layers.0.self_attn.qkv_proj.weight"],
                         [192, 256])


if __name__ == "__main__":
    unittest.main(argv=sys.argv)  # test names may follow (BUILD.bazel splits the cases)
