"""refit.torch.publisher with real torch 2.x processes and real refitd daemons.

Two daemons act as two nodes: trainer ranks (torch.distributed on gloo, one process each) publish
on the trainer's node; the engine, on the other node, registers DESTINATION tensors in vLLM's
layout (fused qkv_proj and gate_up_proj, through refit.mapping) and applies every version, which
must equal, bit for bit, the unsharded model's state_dict that the trainer's rank 0 wrote for
that version with torch's own get_model_state_dict (no refit code). FSDP2 on 2 ranks (uneven
embedding shards), TP 2 (parallelize_module), FSDP2 x TP 2 x 2 on 4 ranks.

Then the bad input of the issue, each raised before anything is registered or published, with
the daemon still serving; and single-process checks (plain modules, rename, re-allocated
parameters, the CUDA path's handle building with fakes).

Run by Bazel (//client/python:torch_test) in the test environment (scripts/install/install-python-env.sh).
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import torch
import torch.distributed as dist

import refit
import refit.testing
import refit.torch
from refit.mapping import FusedMapping

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_trainer  # noqa: E402
from daemons import two_nodes  # noqa: E402

STEPS = 3
VLLM = FusedMapping(stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                             ("gate_up_proj", ["gate_proj", "up_proj"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, world: int, *args: str):
    """`world` ranks of `script`, as torchrun would start them (one process per rank)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script), *args],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def finish(test: unittest.TestCase, procs, timeout: float = 300):
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            test.fail(f"a rank did not finish within {timeout} s:\n{out}")
        outs.append(out)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        test.assertEqual(p.returncode, 0, f"rank {rank}:\n{out}")
    return outs


def wait_for_version(test, client, model: str, version: int, procs, timeout: float = 240):
    """WaitForVersion, failing at once (with the ranks' output) when a rank exits early."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.wait_for_version(model, version, timeout=1.0)
        except refit.DeadlineExceededError:
            pass
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            outs = [p.communicate()[0] for p in procs]
            test.fail(f"version {version} of {model} did not arrive:\n" + "\n".join(
                f"--- rank {r} (exit {p.returncode}):\n{o[-3000:]}"
                for r, (p, o) in enumerate(zip(procs, outs))))


class TrainersTest(unittest.TestCase):
    """FSDP2, TP and FSDP2 x TP trainers into a vLLM-layout engine on another node."""

    def run_trainer(self, mode: str, world: int, arch: str = "qwen3"):
        trainer_node, engine_node = two_nodes(self)
        out_dir = tempfile.mkdtemp(prefix="refit-torch-")
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", out_dir]))
        model_name = f"{arch}-{mode}"
        # The engine: the whole model in vLLM's fused layout, registered before training.
        shapes = {torch_trainer.vllm_expert_names(k): tuple(v.shape) for k, v in
                  torch_trainer.build(arch, torch_trainer.vocab_of(mode)).state_dict().items()}
        engine = engine_node.client()
        dst = engine.register(model_name, refit.DESTINATION,
                              VLLM.layout(shapes, torch.float32))
        self.addCleanup(dst.release)
        params = VLLM.fused_views(dst)
        self.assertIn("model.layers.0.self_attn.qkv_proj.weight", params)
        if arch == "qwen3":
            self.assertIn("model.layers.1.mlp.gate_up_proj.weight", params)
        else:
            self.assertEqual(tuple(params["model.layers.1.mlp.experts.w13_weight"].shape),
                             (4, 64, 64))

        procs = launch("torch_trainer.py", world, f"--socket={trainer_node.socket}",
                       f"--mode={mode}", f"--arch={arch}", f"--steps={STEPS}",
                       f"--out={out_dir}", f"--model={model_name}")
        from safetensors.torch import load_file
        try:
            for version in range(1, STEPS + 1):
                got = wait_for_version(self, engine, model_name, version, procs)
                self.assertGreaterEqual(got, version)
                response = engine.apply(model_name, [dst], version)
                self.assertEqual(response.version, version)
                want = load_file(os.path.join(out_dir, f"v{version}.safetensors"))
                self.assertEqual(set(want), set(shapes))
                self.check_engine(params, want, version)
            open(os.path.join(out_dir, "done"), "w").close()
        finally:
            outs = finish(self, procs)
        for rank, out in enumerate(outs):
            self.assertIn(f"rank {rank}: published version {STEPS}", out)
            # Nothing re-allocated the shards (FSDP2's lazy init and AdamW work in place).
            self.assertIn("rehomes=0", out)
            self.assertNotIn("rehomes=1", out)
        return outs

    def check_engine(self, params, want, version):
        for target, members in VLLM.parts(want).items():
            expected = torch.cat([want[n] for n, _ in members]) if len(members) > 1 \
                else want[members[0][0]]
            got = params[target]
            self.assertEqual(tuple(got.shape), tuple(expected.shape), target)
            self.assertTrue(torch.equal(got, expected),
                            f"version {version}: {target} differs (max abs diff "
                            f"{(got - expected).abs().max().item()})")

    def test_fsdp2_two_ranks(self):
        outs = self.run_trainer("fsdp", 2)
        # vocab 101 over 2 ranks: 51 + 50 rows, the padding row never published.
        self.assertIn("published version 1", outs[1])

    def test_tensor_parallel_two_ranks(self):
        self.run_trainer("tp", 2)

    def test_qwen3_moe_fsdp2_two_ranks(self):
        """Qwen3-MoE: transformers 5's fused experts, sharded by FSDP2 on the expert dimension
        (2 of 4 experts per rank), published under vLLM's names (w13_weight, w2_weight) through
        the rename hook."""
        self.run_trainer("fsdp", 2, arch="qwen3_moe")

    def test_fsdp2_x_tp_four_ranks(self):
        self.run_trainer("fsdp_tp", 4)

    def test_qwen3_moe_transformers_tp_two_ranks(self):
        """Qwen3-MoE under transformers' own TP plan (from_pretrained(tp_plan="auto")): the
        fused experts' gate_up_proj is _StridedShard(1, sf=2), each rank holding its gate rows
        and its up rows of every expert: published as two strided boxes per rank."""
        self.run_trainer("hf_tp", 2, arch="qwen3_moe")

    def test_qwen3_moe_fsdp2_x_transformers_tp_four_ranks(self):
        self.run_trainer("hf_fsdp_tp", 4, arch="qwen3_moe")


class BadRanksTest(unittest.TestCase):
    """Wrong trainers across ranks: a clear error on every rank, nothing published."""

    def run_case(self, case: str):
        daemon = refit.testing.Daemon()
        self.addCleanup(daemon.stop)
        outs = finish(self, launch("torch_bad_ranks.py", 2, f"--socket={daemon.socket}",
                                   f"--case={case}"), timeout=120)
        status = daemon.client().status()  # still serving
        latest = {m.model: m.latest_version for m in status.models}
        self.assertEqual(latest.get(f"bad-{case}", 0), 0, status)
        return outs

    def test_two_ranks_claiming_the_same_shard(self):
        for rank, out in enumerate(self.run_case("overlap")):
            self.assertIn(f"rank {rank}: ERROR", out)
            self.assertIn("parameter weight: ranks [0, 1] all claim the shard at offsets [0, 0] "
                          "sizes [6, 8] with different values", out)
        # raised before anything was registered: nothing to release on refitd's side

    def test_a_rank_publishing_another_version(self):
        for rank, out in enumerate(self.run_case("versions")):
            self.assertIn(f"rank {rank}: ERROR", out)
            self.assertIn("versions by rank: [1, 2]", out)


class _Odd(torch.Tensor):
    """A tensor subclass refit cannot read as plain bytes."""


class SingleProcessTest(unittest.TestCase):
    """One rank (a gloo world of one); real refitd."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = refit.testing.Daemon()
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.client = self.daemon.client()

    def engine_copy(self, model: str, shapes, version: int):
        dst = self.client.register(model, refit.DESTINATION,
                                   {k: torch.zeros(s) for k, s in shapes.items()})
        self.addCleanup(dst.release)
        self.client.apply(model, [dst], version)
        return {k: v.clone() for k, v in dst.tensors.items()}

    def test_plain_module_published_from_its_own_storage(self):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
        net.register_buffer("steps", torch.zeros(3))
        net.register_buffer("scratch", torch.ones(2), persistent=False)
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        weight = net[0].weight
        with refit.torch.publisher(self.client, "plain", net) as pub:
            self.assertEqual(sorted(pub.names),
                             ["0.bias", "0.weight", "1.bias", "1.weight", "steps"])
            self.assertIs(net[0].weight, weight)  # the same Parameter object
            for version in (1, 2):
                net(torch.randn(4, 16)).sum().backward()
                opt.step()
                net.steps += 1
                pub.publish(version)
                want = net.state_dict()
                got = self.engine_copy("plain", {k: want[k].shape for k in pub.names}, version)
                for k in pub.names:
                    self.assertTrue(torch.equal(got[k], want[k]), k)
            self.assertEqual(pub.rehomes, 0)

    def test_reallocated_parameters_are_registered_again(self):
        net = torch.nn.Linear(4, 4)
        pub = refit.torch.publisher(self.client, "moved", net)
        self.addCleanup(pub.release)
        pub.publish(1)
        fresh = {k: torch.full_like(v, 7.0) for k, v in net.state_dict().items()}
        net.load_state_dict(fresh, assign=True)  # new Parameter objects, new storage
        pub.publish(2)
        self.assertEqual(pub.rehomes, 1)
        got = self.engine_copy("moved", {k: v.shape for k, v in fresh.items()}, 2)
        for k, v in fresh.items():
            self.assertTrue(torch.equal(got[k], v), k)
        with torch.no_grad():
            net.weight.fill_(3.0)  # in place: no re-home
        pub.publish(3)
        self.assertEqual(pub.rehomes, 1)
        self.assertTrue(torch.equal(self.engine_copy("moved", {"weight": (4, 4),
                                                               "bias": (4,)}, 3)["weight"],
                                    torch.full((4, 4), 3.0)))

    def test_rename(self):
        net = torch.nn.Linear(4, 2)
        pub = refit.torch.publisher(self.client, "renamed", net,
                                    rename=lambda n: None if n == "bias" else f"lm.{n}")
        self.addCleanup(pub.release)
        self.assertEqual(pub.names, ["lm.weight"])
        pub.publish(1)
        got = self.engine_copy("renamed", {"lm.weight": (2, 4)}, 1)
        self.assertTrue(torch.equal(got["lm.weight"], net.weight.detach()))

    def assert_refused(self, model: str, module, pattern: str, **kwargs):
        before = self.client.status()
        with self.assertRaisesRegex(refit.torch.PublisherError, pattern):
            refit.torch.publisher(self.client, model, module, **kwargs)
        after = self.client.status()
        self.assertNotIn(model, [m.model for m in after.models])  # nothing registered
        self.assertEqual(len(before.models), len(after.models))

    def test_rename_mapping_two_parameters_to_one_name(self):
        self.assert_refused("clash", torch.nn.Linear(4, 2),
                            r"rank 0: rename maps parameters weight and bias to one name 'w'",
                            rename={"weight": "w", "bias": "w"})

    def test_tensor_subclass_refused(self):
        net = torch.nn.Linear(4, 2)
        net.register_buffer("odd", torch.zeros(3).as_subclass(_Odd))
        self.assert_refused("odd", net, r"rank 0: buffer odd is a _Odd, neither a torch.Tensor")

    def test_partial_placement_refused(self):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Partial
        net = torch.nn.Linear(4, 2, bias=False)
        mesh = DeviceMesh("cpu", [0])
        net.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 4), mesh, [Partial()]))
        self.assert_refused("partial", net, r"rank 0: parameter weight has placement "
                                            r"Partial \(P\(sum\)\) on mesh dimension 0")

    def test_unsupported_dtype_refused(self):
        net = torch.nn.Linear(4, 2).to(torch.float64)
        self.assert_refused("f64", net, r"rank 0: parameter weight has dtype torch.float64")

    def test_megatron_layout_needs_a_megatron_model(self):
        self.assert_refused("m", torch.nn.Linear(2, 2), r"rank 0: Linear has no Megatron "
                            r"TransformerConfig \(\.config\)", layout="megatron")

    def test_check_boxes(self):
        whole = [("w", "torch.float32", (4, 2), (0, 0), (4, 2))]
        self.assertEqual(refit.torch.check_boxes([whole, []]), [])
        both = refit.torch.check_boxes([whole, whole])
        self.assertIn("rank 0 and rank 1 both claim the shard", both[0])
        gap = refit.torch.check_boxes([[("w", "torch.float32", (4, 2), (0, 0), (3, 2))]])
        self.assertIn("publish 6 of its 8 elements", gap[0])
        shape = refit.torch.check_boxes([whole, [("w", "torch.float32", (5, 2), (4, 0),
                                                  (1, 2))]])
        self.assertIn("rank 0 has torch.float32 [4, 2], rank 1 has torch.float32 [5, 2]",
                      shape[0])

    def test_cuda_ipc_handle_from_every_torch_form(self):
        """torch's `_share_cuda_()` handle: the bare 64-byte cudaIpcMemHandle_t (older torch),
        or behind a version byte and the type byte 'c' (torch 2.11 on an H200 gave 66 bytes,
        version 2; the GPU bundle's torch-gpu step found it); an expandable segment ('e') and
        anything else refused, naming the fix."""
        handle = bytes(range(64))
        decode = refit.memory.cuda_ipc_handle
        self.assertEqual(decode(handle), handle)
        for version in (1, 2, 3):
            self.assertEqual(decode(bytes([version]) + b"c" + handle), handle)
        with self.assertRaisesRegex(RuntimeError, "expandable_segments:False"):
            decode(b"\x02e" + b"\x00" * 40)
        for bad in (b"", b"\x02c" + handle[:10], b"\x02x" + handle, handle + b"\x00"):
            with self.assertRaisesRegex(RuntimeError, "CUDA IPC handle"):
                decode(bad)

    def test_cuda_regions_with_fake_blocks(self):
        """The CUDA path's handle building (no GPU here): two parameters in one fake cudaMalloc
        block, one in another, become two regions with the right offsets."""

        class FakeLocal:
            def __init__(self, ptr, shape):
                self.ptr, self.shape = ptr, shape

            def data_ptr(self):
                return self.ptr

            def numel(self):
                return int(torch.Size(self.shape).numel())

            def element_size(self):
                return 2

            def is_contiguous(self):
                return True

            dtype = torch.bfloat16

        entries = []
        for name, ptr in (("a", 0x1000 + 512), ("b", 0x1000 + 4096), ("c", 0x9000)):
            e = refit.torch._Entry(name, name, None, name, True, FakeLocal(ptr, (8, 16)))
            e.global_shape, e.offsets, e.sizes = (16, 16), (8, 0), (8, 16)
            e.publishes = True
            entries.append(e)
        handles = {0x1000: b"A" * 64, 0x9000: b"C" * 64}

        def block_of(t):
            base = 0x1000 if t.ptr < 0x9000 else 0x9000
            return 0, handles[base], base

        regions = refit.torch.cuda_regions(entries, block_of=block_of,
                                           uuid_of=lambda d: "GPU-x")
        self.assertEqual(len(regions), 2)
        (r1, l1), (r2, l2) = regions
        self.assertEqual((r1.handle, r1.offset, r1.size), (b"A" * 64, 512, 4096 - 512 + 256))
        self.assertEqual([(lay.name, lay.buffer_offset) for lay in l1], [("a", 0), ("b", 3584)])
        self.assertEqual((r2.offset, r2.size, l2[0].buffer_offset), (0, 256, 0))
        proto = l1[1].to_proto()
        self.assertEqual((list(proto.offsets), list(proto.sizes)), ([8, 0], [8, 16]))
        handle = r1.memory_handle()
        self.assertEqual((handle.cuda_ipc.handle, handle.offset), (b"A" * 64, 512))


if __name__ == "__main__":
    unittest.main(verbosity=2)
