"""Tests of the refit Python client against a real refitd (binary: $REFITD or argv[1])."""

import fcntl
import itertools
import os
import sys
import threading
import time
import unittest

import grpc
import torch

import refit
from daemons import DaemonCase

_models = itertools.count()


def fresh_model(tag: str) -> str:
    return f"{tag}-{next(_models)}"


def llama_like(seed: int, dtype=torch.bfloat16):
    """A tiny Llama-shaped state dict: embeddings, one attention + MLP block, norms, head."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (64, 16),
        "model.layers.0.input_layernorm.weight": (16,),
        "model.layers.0.self_attn.q_proj.weight": (16, 16),
        "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16),
        "model.layers.0.self_attn.o_proj.weight": (16, 16),
        "model.layers.0.mlp.gate_proj.weight": (32, 16),
        "model.layers.0.mlp.up_proj.weight": (32, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 32),
        "model.norm.weight": (16,),
        "lm_head.weight": (64, 16),
    }
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}


def zeros_like(tensors, dtype=None):
    return {k: torch.zeros(v.shape, dtype=dtype or v.dtype) for k, v in tensors.items()}


def step(tensors, seed):
    """Changes every tensor in place, as an optimizer step does."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.01)


class DaemonTestCase(DaemonCase):
    def assertAllEqual(self, expected, actual):
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertEqual(expected[name].dtype, actual[name].dtype, name)
            self.assertTrue(torch.equal(expected[name], actual[name]), name)


class RoundTripTest(DaemonTestCase):
    daemon_args = ("--retain=4",)

    def test_state_dict_three_versions_bit_exact(self):
        model = fresh_model("llama")
        weights = llama_like(1)
        src = self.register(model, refit.SOURCE, weights)
        dst = self.register(model, refit.DESTINATION, zeros_like(weights))
        self.assertEqual(src.memory, "host")
        self.assertEqual((src.host_memory, dst.host_memory), ("memfd", "memfd"))  # the default
        self.assertAllEqual(weights, src.tensors)  # registration copied the values in
        total = sum(t.numel() * t.element_size() for t in weights.values())
        for version in (1, 2, 3):
            step(weights, seed=version)
            src.copy_from(weights)
            published = self.client.publish(model, version, [src])
            self.assertEqual(published.version, version)
            self.assertIn(published.bytes, (total, src.nbytes))  # slices, or the whole region
            # The snapshot is taken: overwriting the source now must not leak into `version`.
            for t in src.tensors.values():
                t.fill_(7)
            self.assertEqual(self.client.wait_for_version(model, version, timeout=10), version)
            applied = self.client.apply(model, [dst], version)
            self.assertEqual((applied.version, applied.bytes_written), (version, total))
            self.assertAllEqual(weights, dst.tensors)
        # Version 0 is the newest complete one.
        self.assertEqual(self.client.apply(model, dst).version, 3)

    def test_tp2_sources_into_whole_destination(self):
        model = fresh_model("tp2")
        weights = llama_like(2)
        # Two "ranks": each holds half the rows of the 2-D weights; 1-D norms are replicated.
        shards = []
        for rank in range(2):
            part = {name: refit.Slice.shard(t, 0, rank, 2) if t.dim() == 2 else t
                    for name, t in weights.items()}
            shards.append(self.register(model, refit.SOURCE, part, client_name=f"rank{rank}"))
        dst = self.register(model, refit.DESTINATION, zeros_like(weights))
        for version in (1, 2, 3):
            step(weights, seed=10 + version)
            for buf in shards:
                buf.copy_from(weights)  # each takes its own rows of the whole tensors
            self.client.publish(model, version, [shards[0]])
            # Not complete until rank 1 publishes too.
            with self.assertRaises(refit.FailedPreconditionError) as e:
                self.client.apply(model, [dst], version)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            with self.assertRaises(refit.DeadlineExceededError):
                self.client.wait_for_version(model, version, timeout=0.2)
            self.client.publish(model, version, [shards[1].buffer_id])
            self.assertEqual(self.client.apply(model, [dst], version).version, version)
            self.assertAllEqual(weights, dst.tensors)

    def test_whole_source_into_tp2_bf16_destinations(self):
        model = fresh_model("convert")
        weights = llama_like(3, dtype=torch.float32)
        src = self.register(model, "source", weights)
        ranks = []
        for rank in range(2):
            part = {name: refit.Slice.shard(torch.zeros_like(t), t.dim() - 1, rank, 2,
                                            dtype=torch.bfloat16)
                    for name, t in weights.items()}
            ranks.append(self.register(model, "destination", part))
        self.client.publish(model, 1, src)
        self.client.apply(model, ranks)
        expected = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        got = zeros_like(weights, dtype=torch.bfloat16)
        for buf in ranks:
            self.assertEqual(buf.tensors["lm_head.weight"].shape, (64, 8))
            buf.copy_to(got)
        self.assertAllEqual(expected, got)  # fp32 -> bf16 rounds to nearest even, as torch

    def test_bind_module_in_place(self):
        model = fresh_model("module")
        torch.manual_seed(0)
        trainer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                      torch.nn.ReLU(), torch.nn.Linear(16, 4))
        engine = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                     torch.nn.ReLU(), torch.nn.Linear(16, 4))
        src = self.register(model, refit.SOURCE, trainer.state_dict())
        src.bind(trainer)  # optimizer steps now land in shared memory
        dst = self.register(model, refit.DESTINATION, engine.state_dict())
        params = list(engine.parameters())
        dst.bind(engine)
        self.assertTrue(all(a is b for a, b in zip(params, engine.parameters())))
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        x = torch.randn(32, 8)
        for version in (1, 2, 3):
            optimizer.zero_grad()
            trainer(x).square().mean().backward()
            optimizer.step()
            self.client.publish(model, version, [src])
            self.client.apply(model, [dst], version)
            with torch.no_grad():
                self.assertTrue(torch.equal(trainer(x), engine(x)))
            self.assertAllEqual(trainer.state_dict(), engine.state_dict())

    def test_scalars_and_integer_dtypes(self):
        model = fresh_model("ints")
        tensors = {
            "steps": torch.tensor(41, dtype=torch.int64),
            "ids": torch.arange(-5, 5, dtype=torch.int32).reshape(2, 5),
            "mask": torch.arange(0, 200, 7, dtype=torch.uint8),
            "q": torch.arange(-64, 64, dtype=torch.int8),
            "half": torch.randn(3, 3).half(),
        }
        src = self.register(model, refit.SOURCE, tensors)
        dst = self.register(model, refit.DESTINATION, zeros_like(tensors))
        self.client.publish(model, 1, [src])
        self.client.apply(model, [dst])
        self.assertEqual(dst.tensors["steps"].shape, ())
        self.assertAllEqual(tensors, dst.tensors)

    def test_release_unlinks_and_status(self):
        model = fresh_model("status")
        weights = llama_like(4)
        src = self.client.register(model, refit.SOURCE, weights, client_name="trainer-test",
                                   host_memory="shm")
        dst = self.client.register(model, refit.DESTINATION, zeros_like(weights))
        self.assertEqual((src.host_memory, dst.host_memory), ("shm", "memfd"))
        self.assertTrue(os.path.exists("/dev/shm" + src.shm_name))
        self.client.publish(model, 5, [src])
        status = self.client.status()
        (info,) = [m for m in status.models if m.model == model]
        self.assertEqual((info.latest_version, list(info.versions)), (5, [5]))
        self.assertEqual((info.source_buffers, info.destination_buffers), (1, 1))
        clients = {b.buffer_id: b.client for b in info.buffers}
        self.assertEqual(clients[src.buffer_id], "trainer-test")
        path = "/dev/shm" + src.shm_name
        with src, dst:
            pass
        self.assertTrue(src.released and dst.released)
        self.assertFalse(os.path.exists(path))
        src.release()  # idempotent
        (info,) = [m for m in self.client.status().models if m.model == model] or [None]
        if info is not None:
            self.assertEqual((info.source_buffers, info.destination_buffers), (0, 0))


class MemfdTest(DaemonTestCase):
    """Host buffers are sealed memfds passed over the socket by default (issue 17)."""

    def test_default_is_a_sealed_memfd_passed_to_refitd(self):
        model = fresh_model("memfd")
        weights = llama_like(5)
        src = self.register(model, refit.SOURCE, weights)
        dst = self.register(model, refit.DESTINATION, zeros_like(weights))
        for buf in (src, dst):
            self.assertEqual(buf.host_memory, "memfd")
            self.assertIsNone(buf.shm_name)
            self.assertTrue(os.readlink(f"/proc/self/fd/{buf.region.fd}").startswith("/memfd:"))
            seals = fcntl.fcntl(buf.region.fd, fcntl.F_GET_SEALS)
            self.assertTrue(seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL)
            with self.assertRaises(PermissionError):  # EPERM: nobody can shrink it
                os.ftruncate(buf.region.fd, 4096)
        self.client.publish(model, 1, [src])
        self.assertEqual(self.client.apply(model, [dst], 1).version, 1)
        self.assertAllEqual(weights, dst.tensors)

    def test_named_shm_stays_available(self):
        model = fresh_model("shm")
        weights = {"w": torch.arange(64, dtype=torch.float32)}
        src = self.register(model, refit.SOURCE, weights, host_memory="shm")
        dst = self.register(model, refit.DESTINATION, zeros_like(weights),
                            shm_name=refit.memory.unique_shm_name("named-dst"))
        self.assertEqual((src.host_memory, dst.host_memory), ("shm", "shm"))
        self.client.publish(model, 1, [src])
        self.client.apply(model, [dst], 1)
        self.assertAllEqual(weights, dst.tensors)
        with self.assertRaises(ValueError):
            self.client.register(model, refit.SOURCE, weights, shm_name="/x", host_memory="memfd")

    def request(self, model, token):
        return refit.pb.RegisterBufferRequest(
            model=model, role=refit.SOURCE,
            memory=refit.pb.MemoryHandle(memfd=refit.pb.Memfd(token=token)),
            tensors=[refit.pb.TensorSlice(name="w", dtype=refit.pb.FP32, global_shape=[4, 4])])

    def test_unsealed_memfd_is_refused(self):
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.addCleanup(os.close, fd)
        os.ftruncate(fd, 4096)
        token = self.client.pass_memfd(fd)
        with self.assertRaises(refit.FailedPreconditionError) as e:
            self.client.register_request(self.request(fresh_model("unsealed"), token))
        self.assertIn("F_SEAL_SHRINK", str(e.exception))
        # Sealed now, it is taken; a token is good for one registration.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        token = self.client.pass_memfd(fd)
        buffer_id = self.client.register_request(self.request(fresh_model("sealed"), token))
        self.client.release_buffer(buffer_id)
        with self.assertRaises(refit.NotFoundError):
            self.client.register_request(self.request(fresh_model("again"), token))

    def test_forged_token_is_not_found(self):
        with self.assertRaises(refit.NotFoundError):
            self.client.register_request(
                self.request(fresh_model("forged"), "memfd-" + "0" * 32))


class WatchTest(DaemonTestCase):
    def test_watch_yields_versions_in_order(self):
        model = fresh_model("watch")
        weights = {"w": torch.ones(4, 4)}
        src = self.register(model, refit.SOURCE, weights)
        events = []
        with self.client.watch(model) as watch:
            # In place once watch() returns: publishing right away is never missed.
            publisher = threading.Thread(
                target=lambda: [self.client.publish(model, v, [src]) for v in (1, 2, 3)])
            publisher.start()
            for event in watch:
                events.append((event.model, event.version))
                if event.version == 3:
                    break
            publisher.join()
        self.assertEqual(events, [(model, 1), (model, 2), (model, 3)])

    def test_watch_replays_after_version_and_cancel_ends_cleanly(self):
        model = fresh_model("replay")
        src = self.register(model, refit.SOURCE, {"w": torch.ones(8)})
        for v in (1, 2, 3):
            self.client.publish(model, v, [src])
        watch = self.client.watch(model, after_version=1)  # retain=2 keeps 2 and 3
        self.assertEqual([next(watch).version, next(watch).version], [2, 3])
        threading.Timer(0.2, watch.cancel).start()
        self.assertEqual(list(watch), [])


class RlSemanticsTest(DaemonTestCase):
    """Labels, the staleness budget and the timeline on one node (its engine is a replica)."""

    def test_labels_reach_watch_and_status(self):
        model = fresh_model("labels")
        src = self.register(model, refit.SOURCE, {"w": torch.ones(4, 4)})
        self.register(model, refit.DESTINATION, {"w": torch.zeros(4, 4)})
        with self.client.watch(model) as watch:
            self.client.publish(model, 1, [src], labels={"step": 17, "run": "grpo"})
            event = next(watch)
        self.assertEqual(event.version, 1)
        self.assertEqual(dict(event.labels), {"step": "17", "run": "grpo"})
        status = next(m for m in self.client.status().models if m.model == model)
        self.assertEqual([(v.version, dict(v.labels)) for v in status.version_labels],
                         [(1, {"step": "17", "run": "grpo"})])
        with self.assertRaises(refit.InvalidArgumentError):
            self.client.publish(model, 2, [src], labels={"note": "x" * 1021})
        status = next(m for m in self.client.status().models if m.model == model)
        self.assertEqual(status.latest_version, 1)  # nothing published

    def test_staleness_budget(self):
        model = fresh_model("stale")
        src = self.register(model, refit.SOURCE, {"w": torch.ones(4, 4)})
        with self.assertRaises(refit.FailedPreconditionError):
            self.client.publish(model, 1, [src], max_staleness=1)  # no replica yet
        self.register(model, refit.DESTINATION, {"w": torch.zeros(4, 4)})
        # The engine's node reports itself as a replica within a second.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.publish(model, 1, [src], max_staleness=1)
                break
            except refit.FailedPreconditionError:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.1)
        self.client.publish(model, 2, [src], max_staleness=1, timeout=10)
        status = next(m for m in self.client.status().models if m.model == model)
        self.assertEqual(status.max_staleness, 1)
        self.assertEqual(status.published_version, 2)
        self.assertFalse(status.stale)
        self.assertEqual([r.stale for r in status.replicas], [False])

    def test_timeline(self):
        model = fresh_model("timeline")
        src = self.register(model, refit.SOURCE, {"w": torch.ones(4, 4)})
        dst = self.register(model, refit.DESTINATION, {"w": torch.zeros(4, 4)})
        self.client.publish(model, 1, [src])
        self.client.apply(model, [dst], version=1)
        timeline = self.client.timeline(model, 1)
        self.assertEqual(len(timeline.nodes), 1)
        stages = [s.stage for s in timeline.nodes[0].versions[0].stages]
        self.assertEqual(stages, ["published", "complete", "applied"])


class ErrorMappingTest(unittest.TestCase):
    class FakeRpcError(grpc.RpcError):
        def __init__(self, code, details):
            super().__init__()
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    def test_each_code_maps_to_its_class(self):
        from refit.errors import from_rpc_error
        for code, cls in ((grpc.StatusCode.RESOURCE_EXHAUSTED, refit.ResourceExhaustedError),
                          (grpc.StatusCode.NOT_FOUND, refit.NotFoundError),
                          (grpc.StatusCode.INTERNAL, refit.RefitError)):
            error = from_rpc_error(self.FakeRpcError(code, "why"), "Publish")
            self.assertIs(type(error), cls)
            self.assertEqual(error.code, code)
            self.assertEqual(str(error), f"Publish: {code.name}: why")


class StatusCodeTest(DaemonTestCase):
    def setUp(self):
        self.model = fresh_model("codes")
        self.src = self.register(self.model, refit.SOURCE, {"w": torch.ones(4, 4)})
        self.dst = self.register(self.model, refit.DESTINATION, {"w": torch.zeros(4, 4)})

    def assertCode(self, cls, code, fn, *args, **kwargs):
        with self.assertRaises(cls) as e:
            fn(*args, **kwargs)
        self.assertIsInstance(e.exception, refit.RefitError)
        self.assertEqual(e.exception.code, code)
        return e.exception

    def test_apply_of_incomplete_version_is_failed_precondition(self):
        self.client.publish(self.model, 1, [self.src])
        self.assertCode(refit.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION,
                        self.client.apply, self.model, [self.dst], 5)

    def test_republish_is_failed_precondition(self):
        self.client.publish(self.model, 2, [self.src])
        self.assertCode(refit.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION,
                        self.client.publish, self.model, 2, [self.src])

    def test_unknown_buffer_is_not_found(self):
        self.assertCode(refit.NotFoundError, grpc.StatusCode.NOT_FOUND,
                        self.client.publish, self.model, 1, ["no-such-buffer"])
        self.assertCode(refit.NotFoundError, grpc.StatusCode.NOT_FOUND,
                        self.client.release_buffer, "no-such-buffer")

    def test_dropped_version_is_not_found(self):
        for v in (1, 2, 3, 4):
            self.client.publish(self.model, v, [self.src])
        self.assertCode(refit.NotFoundError, grpc.StatusCode.NOT_FOUND,
                        self.client.apply, self.model, [self.dst], 1)

    def test_missing_shm_is_not_found(self):
        request = refit.pb.RegisterBufferRequest(
            model=self.model, role=refit.SOURCE,
            memory=refit.pb.MemoryHandle(host_shm=refit.pb.HostShm(name="/refit-missing-shm")),
            tensors=[refit.pb.TensorSlice(name="w", dtype=refit.pb.FP32, global_shape=[4, 4])])
        self.assertCode(refit.NotFoundError, grpc.StatusCode.NOT_FOUND,
                        self.client.register_request, request)

    def test_shape_disagreement_is_invalid_argument(self):
        err = self.assertCode(refit.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                              self.client.register, self.model, refit.SOURCE,
                              {"w": torch.ones(4, 5)})
        self.assertIn("RegisterBuffer", str(err))

    def test_wait_past_deadline(self):
        err = self.assertCode(refit.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED,
                              self.client.wait_for_version, self.model, 1, timeout=0.1)
        self.assertIsInstance(err, TimeoutError)


class ClientSideTest(unittest.TestCase):
    def test_no_daemon_is_unavailable(self):
        with self.assertRaises(refit.UnavailableError) as e:
            refit.Client("/tmp/refit-no-such-dir/refitd.sock", connect_timeout=0.3)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("/tmp/refit-no-such-dir/refitd.sock", str(e.exception))

    def test_missing_or_refusing_socket_fails_at_once(self):
        import socket as socket_lib
        import tempfile
        import time
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            stale = os.path.join(tmp, "stale.sock")
            bound = socket_lib.socket(socket_lib.AF_UNIX, socket_lib.SOCK_STREAM)
            bound.bind(stale)  # never listens: a socket a dead daemon left behind
            try:
                for path, why in ((os.path.join(tmp, "none.sock"), "does not exist"),
                                  (stale, "nothing listens")):
                    started = time.monotonic()
                    with self.assertRaises(refit.UnavailableError) as e:
                        refit.Client(path, connect_timeout=5)
                    self.assertLess(time.monotonic() - started, 0.5)
                    self.assertIn(path, str(e.exception))
                    self.assertIn(why, str(e.exception))
            finally:
                bound.close()

    def test_default_socket(self):
        old = os.environ.pop("REFIT_SOCKET", None)
        try:
            self.assertEqual(refit.default_socket_path(), "/run/refit/refitd.sock")
            os.environ["REFIT_SOCKET"] = "/tmp/x.sock"
            self.assertEqual(refit.default_socket_path(), "/tmp/x.sock")
        finally:
            os.environ.pop("REFIT_SOCKET", None)
            if old is not None:
                os.environ["REFIT_SOCKET"] = old

    def test_dtype_table(self):
        self.assertEqual(refit.TORCH_TO_REFIT[torch.bfloat16], refit.pb.BF16)
        self.assertEqual(refit.TORCH_TO_REFIT[torch.float32], refit.pb.FP32)
        self.assertEqual(refit.TORCH_TO_REFIT[torch.int64], refit.pb.INT64)
        if hasattr(torch, "float8_e4m3fn"):
            self.assertEqual(refit.TORCH_TO_REFIT[torch.float8_e4m3fn], refit.pb.FP8_E4M3)
        for torch_dtype, refit_dtype in refit.TORCH_TO_REFIT.items():
            self.assertEqual(refit.REFIT_TO_TORCH[refit_dtype], torch_dtype)

    def test_bad_inputs_fail_before_any_call(self):
        slices = refit.buffer.normalize
        with self.assertRaisesRegex(ValueError, "cannot carry torch.float64"):
            slices({"w": torch.ones(2, dtype=torch.float64)})
        with self.assertRaisesRegex(ValueError, "empty"):
            slices({"w": torch.ones(0, 3)})
        with self.assertRaisesRegex(ValueError, "global_shape"):
            refit.Slice(torch.ones(2), offsets=[2])
        with self.assertRaisesRegex(ValueError, "role"):
            refit.client.parse_role("trainer")
        s = refit.Slice.shard(torch.ones(6, 4), 0, 2, 3)
        self.assertEqual((s.global_shape, s.offsets, s.sizes), ((6, 4), (4, 0), (2, 4)))

    def test_layout_is_aligned_back_to_back(self):
        layouts, size = refit.buffer.layout(refit.buffer.normalize(
            {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(5), "c": torch.ones(1)}),
            alignment=64)
        self.assertEqual([lay.buffer_offset for lay in layouts], [0, 64, 128])
        self.assertEqual(size, 132)

    def test_gpu_uuid_from_torch_device_properties(self):
        want = "GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a"
        raw = bytes.fromhex("6b1c9f2e0d3a4c7e9a513f0e2d1c4b5a")

        class Uuid:  # torch >= 2.0's _CUuuid: .bytes, and str() the dashed text
            bytes = raw

            def __str__(self):
                return want[4:]

        class TextUuid:  # a torch whose uuid has no .bytes
            def __str__(self):
                return want.upper()

        class Properties:
            def __init__(self, uuid):
                self.uuid = uuid

        gpu_uuid = refit.memory.gpu_uuid
        self.assertEqual(gpu_uuid(Properties(Uuid())), want)
        self.assertEqual(gpu_uuid(Properties(TextUuid())), want)
        self.assertEqual(gpu_uuid(object()), "")  # torch 1.13: no uuid, the ordinal is used
        self.assertEqual(gpu_uuid(Properties("not-a-uuid")), "")

    @unittest.skipIf(torch.cuda.is_available(), "a GPU is present")
    def test_cuda_without_cuda_is_a_clear_error(self):
        with self.assertRaisesRegex(RuntimeError, "torch.cuda.is_available"):
            refit.memory.CudaRegion(64, torch.device("cuda:0"))


def main():
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        os.environ["REFITD"] = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
