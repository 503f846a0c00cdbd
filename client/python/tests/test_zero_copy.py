"""Zero copy in the engine adapters, through a real refitd: a vLLM-shaped torch model (fp8
`qkv_proj` with [128, 128] block scales in `weight_scale_inv`, fused `gate_up_proj`, a plain
fp8 `down_proj`, MoE `experts.w13_weight` / `w2_weight` on an expert-parallel rank holding
experts 1 and 3, an fp32 layernorm fed from bf16) whose own parameters are refit DESTINATION
memory: after each version they hold the exact expected bytes, their `data_ptr()` does not
move, `load_weights` is never called. Also: the fallback through `load_weights` (auto mode,
parameters that can't be registered), the forced modes, a NaN version refused before Apply, a
mapping that does not fit refused, SGLang's custom-weight-loader entry point, and the CUDA
handle building with fake parameters (no GPU here: that path was not run on a device)."""

import gc
import sys
import unittest
from unittest import mock

import torch

import refit
from refit import engine_storage
from refit import sglang as refit_sglang
from refit import vllm as refit_vllm
from refit.mapping import FusedMapping
from refit.v1 import refit_pb2
from test_fp8 import DaemonCase, reference

H, KV, I, E = 256, 128, 128, 4
LOCAL = [1, 3]  # the experts this engine rank holds
L0, L1 = "model.layers.0.", "model.layers.1."
MAPPING = FusedMapping(
    stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
             ("gate_up_proj", ["gate_proj", "up_proj"])],
    experts=[("experts.w13_weight", ["gate_proj", "up_proj"]),
             ("experts.w2_weight", ["down_proj"])])
QKV = [("q_proj", H), ("k_proj", KV), ("v_proj", KV)]


def checkpoint_shapes():
    shapes = {L0 + f"self_attn.{p}.weight": (rows, H) for p, rows in QKV}
    shapes[L0 + "self_attn.o_proj.weight"] = (H, H)
    shapes[L0 + "mlp.gate_proj.weight"] = (I, H)
    shapes[L0 + "mlp.up_proj.weight"] = (I, H)
    shapes[L0 + "mlp.down_proj.weight"] = (H, I)
    shapes[L0 + "input_layernorm.weight"] = (H,)
    for e in range(E):
        shapes[L1 + f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        shapes[L1 + f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        shapes[L1 + f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    return shapes


FP8 = [L0 + f"self_attn.{p}.weight" for p, _ in QKV] + [L0 + "mlp.down_proj.weight"]


def checkpoint(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
            for n, s in checkpoint_shapes().items()}


def engine_params():
    """The settings an adapter is given: the engine rank's checkpoint tensors and dtypes."""
    return {n: (s, torch.bfloat16) for n, s in checkpoint_shapes().items()
            if ".experts." not in n or int(n.split(".")[5]) in LOCAL}


class VllmShapedModel(torch.nn.Module):
    """Parameters named, fused and typed as vLLM's fp8 MoE models are; `load_weights` maps
    checkpoint names onto them (counting its calls). `odd=True` makes two parameters that
    refit cannot write in place: a non-contiguous o_proj and a float64 layernorm."""

    def __init__(self, odd=False):
        super().__init__()
        z = torch.zeros
        self.shapes = {
            L0 + "self_attn.qkv_proj.weight": z(H + 2 * KV, H, dtype=torch.uint8),
            L0 + "self_attn.qkv_proj.weight_scale_inv": z((H + 2 * KV) // 128, H // 128),
            L0 + "self_attn.o_proj.weight": z(H, H, dtype=torch.bfloat16).t() if odd
            else z(H, H, dtype=torch.bfloat16),
            L0 + "mlp.gate_up_proj.weight": z(2 * I, H, dtype=torch.bfloat16),
            L0 + "mlp.down_proj.weight": z(H, I, dtype=torch.uint8),
            L0 + "mlp.down_proj.weight_scale_inv": z(H // 128, I // 128),
            L0 + "input_layernorm.weight": z(H, dtype=torch.float64 if odd else torch.float32),
            L1 + "mlp.experts.w13_weight": z(len(LOCAL), 2 * I, H, dtype=torch.bfloat16),
            L1 + "mlp.experts.w2_weight": z(len(LOCAL), H, I, dtype=torch.bfloat16),
        }
        for name, value in self.shapes.items():
            owner = self
            *path, attr = name.split(".")
            for p in path:
                if not hasattr(owner, p):
                    owner.add_module(p, torch.nn.Module())
                owner = getattr(owner, p)
            owner.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
        self.load_weights_calls = 0

    @torch.no_grad()
    def load_weights(self, weights):
        self.load_weights_calls += 1
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            loaded.add(name)
            scale = name.endswith("_scale_inv")
            if ".experts." in name:
                parts = name.split(".")
                e, part = LOCAL.index(int(parts[5])), parts[6]
                fused = "w2_weight" if part == "down_proj" else "w13_weight"
                target = params[L1 + "mlp.experts." + fused][e]
                row = I if part == "up_proj" else 0
                target[row:row + tensor.shape[0]].copy_(tensor)
                continue
            for fused, members in (("qkv_proj", QKV),
                                   ("gate_up_proj", [("gate_proj", I), ("up_proj", I)])):
                row = 0
                for part, rows in members:
                    if f".{part}." in name:
                        target = params[name.replace(part, fused)]
                        at = row // 128 if scale else row
                        target[at:at + tensor.shape[0]].copy_(tensor)
                        break
                    row += rows
                else:
                    continue
                break
            else:
                params[name].copy_(tensor)
        return loaded


def expected(ckpt):
    """Engine parameter name -> the exact tensor it must hold after applying `ckpt`."""
    codes, scales = zip(*(reference(ckpt[L0 + f"self_attn.{p}.weight"]) for p, _ in QKV))
    down_codes, down_scales = reference(ckpt[L0 + "mlp.down_proj.weight"])
    return {
        L0 + "self_attn.qkv_proj.weight": torch.cat(codes),
        L0 + "self_attn.qkv_proj.weight_scale_inv": torch.cat(scales),
        L0 + "self_attn.o_proj.weight": ckpt[L0 + "self_attn.o_proj.weight"],
        L0 + "mlp.gate_up_proj.weight": torch.cat([ckpt[L0 + "mlp.gate_proj.weight"],
                                                   ckpt[L0 + "mlp.up_proj.weight"]]),
        L0 + "mlp.down_proj.weight": down_codes,
        L0 + "mlp.down_proj.weight_scale_inv": down_scales,
        L0 + "input_layernorm.weight": ckpt[L0 + "input_layernorm.weight"].double(),
        L1 + "mlp.experts.w13_weight": torch.stack([torch.cat(
            [ckpt[L1 + f"mlp.experts.{e}.gate_proj.weight"],
             ckpt[L1 + f"mlp.experts.{e}.up_proj.weight"]]) for e in LOCAL]),
        L1 + "mlp.experts.w2_weight": torch.stack(
            [ckpt[L1 + f"mlp.experts.{e}.down_proj.weight"] for e in LOCAL]),
    }


def same_bytes(a, b):
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


class ZeroCopyTest(DaemonCase):
    def check(self, model, ckpt):
        params = dict(model.named_parameters())
        for name, want in expected(ckpt).items():
            got = params[name].detach()
            if got.dtype != want.dtype:
                want = want.to(got.dtype)
            self.assertTrue(same_bytes(got, want), f"{name} differs")

    def vllm_engine(self, name, model, storage="zero_copy"):
        engine = refit_vllm.RefitWeightTransferEngine(model=model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": self.daemon.socket, "fp8": FP8,
            "params": {n: [list(s), "bfloat16"] for n, (s, _) in engine_params().items()},
            "mapping": MAPPING.to_dict(), "storage": storage, "experts": LOCAL}))
        self.addCleanup(engine.shutdown)
        return engine

    def test_vllm_writes_in_place_and_never_calls_load_weights(self):
        model = VllmShapedModel()
        objects = {n: id(p) for n, p in model.named_parameters()}
        with mock.patch.object(engine_storage, "cuda_regions",
                               side_effect=AssertionError("the CUDA path on CPU parameters")):
            engine = self.vllm_engine("zc-vllm", model)
        self.assertTrue(engine.zero_copy)
        self.assertEqual([b.host_memory for b in engine.weights.buffers], ["memfd"])
        self.assertEqual({n: id(p) for n, p in model.named_parameters()}, objects)
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in (1, 2, 3):
            ckpt = checkpoint(version)
            src = self.publish("zc-vllm", version, ckpt, src)
            self.assertEqual(refit_vllm.sync(engine, version), f"zc-vllm@{version}")
            self.check(model, ckpt)
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        self.assertEqual(model.load_weights_calls, 0)
        engine.shutdown()  # the buffers go; the parameters keep the last version
        del engine
        gc.collect()  # nothing but the parameters holds the mapping now
        self.check(model, ckpt)
        self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)

    def test_nan_version_refused_before_apply(self):
        model = VllmShapedModel()
        receiver = refit_sglang.RefitWeightReceiver(
            model, "zc-nan", engine_params(), FP8, socket=self.daemon.socket, mapping=MAPPING,
            storage="zero_copy", experts=LOCAL)
        self.addCleanup(receiver.destroy)
        ckpt = checkpoint(7)
        src = self.publish("zc-nan", 1, ckpt)
        self.assertEqual(receiver.receive(1), "zc-nan@1")
        bad = {k: v.clone() for k, v in ckpt.items()}
        bad[L0 + "mlp.down_proj.weight"][3, 5] = float("nan")
        self.publish("zc-nan", 2, bad, src)
        applies = []
        real_apply = receiver.client.apply
        receiver.client.apply = lambda *a, **k: applies.append(a) or real_apply(*a, **k)
        with self.assertRaises(refit_sglang.NonFiniteVersionError) as e:
            receiver.receive(2)
        self.assertEqual((e.exception.version, e.exception.count), (2, 1))
        self.assertEqual(applies, [])
        self.check(model, ckpt)  # still version 1, bytes and all
        self.assertEqual(model.load_weights_calls, 0)
        self.publish("zc-nan", 3, checkpoint(8), src)
        self.assertEqual(receiver.receive(3), "zc-nan@3")
        self.assertEqual(len(applies), 1)
        self.check(model, checkpoint(8))

    def test_auto_falls_back_to_load_weights_for_what_cannot_be_registered(self):
        model = VllmShapedModel(odd=True)
        with self.assertLogs("refit.engine", "WARNING") as logs:
            engine = self.vllm_engine("zc-auto", model, storage="auto")
        text = "\n".join(logs.output)
        self.assertIn("o_proj.weight': it is not contiguous", text)
        self.assertIn("input_layernorm.weight': refit does not carry its dtype torch.float64",
                      text)
        self.assertEqual(sorted(engine.weights.fallback_reasons),
                         [L0 + "input_layernorm.weight", L0 + "self_attn.o_proj.weight"])
        self.assertFalse(engine.zero_copy)
        self.assertEqual(sorted(engine.weights.fallback.tensors),
                         [L0 + "input_layernorm.weight", L0 + "self_attn.o_proj.weight"])
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in (1, 2):
            ckpt = checkpoint(10 + version)
            src = self.publish("zc-auto", version, ckpt, src)
            refit_vllm.sync(engine, version)
            self.check(model, ckpt)
            self.assertEqual(model.load_weights_calls, version)
            self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        # Forced zero copy refuses the same model, naming each parameter and why.
        with self.assertRaises(ValueError) as e:
            self.vllm_engine("zc-auto-forced", VllmShapedModel(odd=True))
        self.assertIn("storage='zero_copy'", str(e.exception))
        self.assertIn("it is not contiguous", str(e.exception))

    def test_forced_load_weights_mode(self):
        model = VllmShapedModel()
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        engine = self.vllm_engine("zc-lw", model, storage="load_weights")
        self.assertEqual(engine.weights.buffers, [])
        ckpt = checkpoint(21)
        self.publish("zc-lw", 1, ckpt)
        refit_vllm.sync(engine, 1)
        self.check(model, ckpt)
        self.assertEqual(model.load_weights_calls, 1)
        self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        with self.assertRaises(ValueError):
            engine.parse_init_info({"model": "x", "params": {}, "storage": "zero-copy",
                                    "bogus": 1})

    def test_mismatched_mapping_is_refused(self):
        model = VllmShapedModel()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        short = FusedMapping(stacked=[("qkv_proj", ["q_proj", "k_proj"]),
                                      ("gate_up_proj", ["gate_proj", "up_proj"])],
                             experts=MAPPING.experts)
        for storage in ("auto", "zero_copy"):
            with self.assertRaises(refit_sglang.MappingError) as e:
                refit_sglang.RefitWeightReceiver(
                    model, "zc-bad", engine_params(), FP8, socket=self.daemon.socket,
                    mapping=short, storage=storage, experts=LOCAL)
            self.assertIn("qkv_proj.weight' [512, 256]: its parts", str(e.exception))
            self.assertIn("add up to 384 rows, not 512", str(e.exception))
            self.assertIn("qkv_proj.weight_scale_inv' [4, 2]: its parts", str(e.exception))
            self.assertIn("add up to 3 rows, not 4 (fused block scales", str(e.exception))
        # Experts: a rank told it holds three experts whose w13 has room for two.
        with self.assertRaises(refit_sglang.MappingError) as e:
            refit_sglang.RefitWeightReceiver(
                model, "zc-bad", {**engine_params(), **{
                    L1 + f"mlp.experts.0.{p}.weight": (s, torch.bfloat16)
                    for p, s in (("gate_proj", (I, H)), ("up_proj", (I, H)),
                                 ("down_proj", (H, I)))}},
                FP8, socket=self.daemon.socket, mapping=MAPPING, experts=[0] + LOCAL)
        self.assertIn("the mapping gives it 3 expert(s)", str(e.exception))
        for name, p in model.named_parameters():  # nothing was re-homed or changed
            self.assertTrue(same_bytes(p.detach(), before[name]), name)
        self.assertEqual([m.destination_buffers for m in self.client.status().models
                          if m.model == "zc-bad"], [])

    def test_sglang_custom_weight_loader(self):
        model = VllmShapedModel()
        loader = refit_sglang.custom_weight_loader
        # Never raises (an exception would end SGLang's scheduler): logged and kept.
        loader(model, refit_sglang.version_tensors(1))
        self.assertIsInstance(refit_sglang.last_error(model), RuntimeError)
        settings = {"model": "zc-sgl", "socket": self.daemon.socket, "fp8": FP8,
                    "params": {n: [list(s), "bfloat16"] for n, (s, _) in
                               engine_params().items()},
                    "mapping": MAPPING.to_dict(), "storage": "zero_copy", "experts": LOCAL}
        loader(model, refit_sglang.init_tensors(settings))
        receiver = model._refit_receiver
        self.addCleanup(lambda: model._refit_receiver and model._refit_receiver.destroy())
        self.assertTrue(receiver.zero_copy)
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        src = None
        for version in (1, 2):
            ckpt = checkpoint(30 + version)
            src = self.publish("zc-sgl", version, ckpt, src)
            loader(model, refit_sglang.version_tensors(version))
            self.check(model, ckpt)
        self.assertEqual({n: p.data_ptr() for n, p in model.named_parameters()}, pointers)
        self.assertEqual(model.load_weights_calls, 0)
        self.assertIsNone(refit_sglang.last_error(model))
        loader(model, [("model.layers.0.mlp.down_proj.weight", torch.zeros(1))])
        self.assertIsInstance(refit_sglang.last_error(model), ValueError)
        loader(model, refit_sglang.init_tensors({"model": "x", "params": {}, "bogus": 1}))
        self.assertIsInstance(refit_sglang.last_error(model), ValueError)
        self.assertIs(model._refit_receiver, receiver)  # bad settings change nothing
        ckpt = checkpoint(33)
        self.publish("zc-sgl", 3, ckpt, src)
        loader(model, refit_sglang.version_tensors(0))  # 0: the next version
        self.check(model, ckpt)


class FakeCudaParam:
    """What the CUDA path reads of a parameter, for a machine without a GPU."""

    def __init__(self, shape, dtype, address):
        self.shape, self.dtype, self.address = torch.Size(shape), dtype, address
        self.device = torch.device("cuda", 0)

    def is_contiguous(self):
        return True

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def data_ptr(self):
        return self.address


class CudaHandleTest(unittest.TestCase):
    def test_regions_per_block_with_offsets(self):
        block_a, block_b = 0x7f0000000000, 0x7f1000000000
        params = {
            L0 + "self_attn.qkv_proj.weight": FakeCudaParam((H + 2 * KV, H), torch.uint8,
                                                            block_a + 4096),
            L0 + "self_attn.qkv_proj.weight_scale_inv": FakeCudaParam((4, 2), torch.float32,
                                                                      block_a + 512),
            L1 + "mlp.experts.w2_weight": FakeCudaParam((len(LOCAL), H, I), torch.bfloat16,
                                                        block_b + 1024),
        }
        ckpt = {n: s for n, s in engine_params().items()
                if "self_attn" in n and "o_proj" not in n or "down_proj" in n and ".experts." in n}
        result = engine_storage.plan(params, MAPPING, ckpt,
                                     [n for n in FP8 if n in ckpt], (128, 128), LOCAL)
        self.assertEqual(result.fallback, {})
        handles = {block_a: b"a" * 64, block_b: b"b" * 64}

        def block_of(param):
            base = block_a if param.address < block_b else block_b
            return 0, handles[base], base

        regions = engine_storage.cuda_regions(params, result.placed, block_of,
                                              uuid_of=lambda d: f"GPU-fake-{d}")
        by_handle = {r.handle: (r, {lay.name: lay for lay in lays}) for r, lays in regions}
        a, lays_a = by_handle[b"a" * 64]
        self.assertEqual((a.offset, a.size), (512, 4096 + (H + 2 * KV) * H - 512))
        q, k = L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight"
        self.assertEqual(lays_a[q].buffer_offset, 4096 - 512)
        self.assertEqual(lays_a[k].buffer_offset, 4096 - 512 + H * H)
        self.assertEqual(lays_a[k + "_scale_inv"].buffer_offset, 2 * 2 * 4)
        self.assertEqual(lays_a[k].scale_tensor, k + "_scale_inv")
        self.assertEqual(lays_a[k].to_proto().dtype, refit_pb2.FP8_E4M3)
        handle = a.memory_handle()
        self.assertEqual((handle.cuda_ipc.handle, handle.cuda_ipc.device_uuid, handle.offset,
                          handle.size), (b"a" * 64, "GPU-fake-0", a.offset, a.size))
        b, lays_b = by_handle[b"b" * 64]
        three = L1 + "mlp.experts.3.down_proj.weight"
        self.assertEqual((b.offset, b.size), (1024, len(LOCAL) * H * I * 2))
        self.assertEqual(lays_b[three].buffer_offset, H * I * 2)  # expert 3 is local index 1
        with self.assertRaises(RuntimeError):  # a handle torch gave in another form
            engine_storage.cuda_regions(params, result.placed, lambda p: (0, b"x" * 8, 0),
                                        uuid_of=str)


    def test_fp8_expert_scales_go_into_the_fused_scale_parameter(self):
        # vLLM's fp8 MoE: experts.w13_weight [E, 2I, H] e4m3fn + w13_weight_scale_inv
        # [E, 2I/128, H/128]; per-expert checkpoints gate/up_proj.weight (+ _scale_inv).
        params = {L1 + "mlp.experts.w13_weight": torch.zeros(2, 2 * I, H, dtype=torch.uint8),
                  L1 + "mlp.experts.w13_weight_scale_inv": torch.zeros(2, 2, 2)}
        ckpt = {L1 + f"mlp.experts.{e}.{p}.weight": ((I, H), torch.bfloat16)
                for e in LOCAL for p in ("gate_proj", "up_proj")}
        result = engine_storage.plan(params, MAPPING, ckpt, list(ckpt), (128, 128), LOCAL)
        self.assertEqual(result.fallback, {})
        scales = result.placed[L1 + "mlp.experts.w13_weight_scale_inv"]
        self.assertEqual([(p.name.split(".")[5], p.name.split(".")[6], p.expert, p.row)
                          for p in scales],
                         [("1", "gate_proj", 0, 0), ("1", "up_proj", 0, 1),
                          ("3", "gate_proj", 1, 0), ("3", "up_proj", 1, 1)])
        weights = result.placed[L1 + "mlp.experts.w13_weight"]
        self.assertEqual({p.scale_tensor for p in weights}, {p.name for p in scales})
        self.assertEqual({p.refit_dtype for p in weights}, {refit_pb2.FP8_E4M3})
        # A CPU model never takes the CUDA path: its plan is re-homed into a memfd.
        with mock.patch.object(engine_storage.memory, "torch_cuda_block",
                               side_effect=AssertionError("CUDA path")):
            region, layouts = engine_storage.rehome_cpu("m", params, result.placed)
        self.assertEqual(region.kind, "memfd")
        base = region.bytes.data_ptr()
        for param in params.values():  # both now live in the memfd
            self.assertTrue(base <= param.data_ptr() < base + region.size)
        region.close()


    def test_a_closed_region_keeps_its_pages_for_live_views(self):
        # torch.frombuffer holds the mmap object, not a buffer export: close() must not unmap.
        from refit import memory
        for region in (memory.MemfdRegion(4096, "zc-close"),
                       memory.HostRegion(memory.unique_shm_name("zc-close"), 4096)):
            view = region.bytes.narrow(0, 100, 8)
            view.fill_(7)
            region.close()
            gc.collect()
            self.assertEqual(view.tolist(), [7] * 8)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
