"""Which version an engine holds, through the Python client and the engine adapters against a
real refitd: Rollback / Resume (`client.rollback()`, `client.resume()`, Watch events with
`rollback`, the vLLM and SGLang adapters applying a rollback and then the resumed newest), and
runs (`client.publish(..., run=)`, `refit.torch.publisher(..., run=)`: a trainer resuming from an
older step under a new run is followed by the adapters without a manual step)."""

import sys
import unittest

import torch

import refit
from refit import sglang as refit_sglang
from refit import vllm as refit_vllm
from daemons import DaemonCase
from test_engines import CKPT, FP8, FakeEngineModel, checkpoint
from test_fp8 import reference


class VersionsTest(DaemonCase):
    daemon_args = ("--retain=3",)

    def check(self, model, ckpt):
        p = "model.layers.0."
        attn = [ckpt[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        self.assertTrue(torch.equal(model.params[p + "self_attn.qkv_proj.weight"],
                                    torch.cat(attn)))
        codes, _ = reference(ckpt[p + "mlp.down_proj.weight"])
        self.assertTrue(torch.equal(model.params[p + "mlp.down_proj.weight"], codes))

    def source(self, name, ckpt):
        src = self.client.register(name, refit.SOURCE, ckpt)
        self.addCleanup(src.release)
        return src

    def test_vllm_engine_applies_a_rollback_then_the_resumed_newest(self):
        name = "py-rollback"
        model = FakeEngineModel()
        engine = refit_vllm.RefitWeightTransferEngine(model=model)
        engine.init_transfer_engine(engine.parse_init_info({
            "model": name, "socket": self.daemon.socket, "fp8": FP8,
            "params": {n: [list(s), "bfloat16"] for n, s in CKPT.items()}}))
        self.addCleanup(engine.shutdown)
        ckpts = {v: checkpoint(v) for v in (1, 2, 3, 4)}
        src = self.source(name, ckpts[1])
        with self.client.watch(name) as watch:
            for v in (1, 2, 3):
                src.copy_from(ckpts[v])
                self.client.publish(name, v, [src])
                self.assertEqual(refit_vllm.sync(engine, 0), f"{name}@{v}")
            self.check(model, ckpts[3])
            # Bad input changes nothing.
            with self.assertRaises(refit.NotFoundError) as e:
                self.client.rollback(name, 9)
            self.assertIn("oldest retained is 1", str(e.exception))
            with self.assertRaises(refit.FailedPreconditionError):
                self.client.resume(name)

            self.assertEqual(self.client.rollback(name, 2), 2)
            events = [next(watch) for _ in range(4)]
            self.assertEqual([(e.version, e.rollback) for e in events],
                             [(1, False), (2, False), (3, False), (2, True)])
            # The engine on version 3 is told to go back, without asking for version 2.
            self.assertEqual(refit_vllm.sync(engine, 0), f"{name}@2")
            self.assertTrue(engine.weights.rollback)
            self.check(model, ckpts[2])

            # Version 4 completes but is held back until resume.
            src.copy_from(ckpts[4])
            self.client.publish(name, 4, [src])
            with self.assertRaises(refit.DeadlineExceededError):
                self.client.wait_for_version(name, 3, timeout=0.5)
            self.check(model, ckpts[2])
            self.client.resume(name)
            event = next(watch)
            self.assertEqual((event.version, event.rollback), (4, False))
            self.assertEqual(refit_vllm.sync(engine, 0), f"{name}@4")
            self.assertFalse(engine.weights.rollback)
            self.check(model, ckpts[4])

    def test_sglang_receiver_follows_a_resume_from_an_older_step(self):
        name = "py-runs"
        model = FakeEngineModel()
        receiver = refit_sglang.RefitWeightReceiver(
            model, name, {n: (s, torch.bfloat16) for n, s in CKPT.items()}, FP8,
            socket=self.daemon.socket)
        self.addCleanup(receiver.destroy)
        src = self.source(name, checkpoint(600))
        for v in (600, 601):
            src.copy_from(checkpoint(v))
            self.client.publish(name, v, [src], run="job-1")
            self.assertEqual(receiver.receive(0), f"{name}@{v}")
        # The same run may not go back ...
        with self.assertRaises(refit.FailedPreconditionError):
            self.client.publish(name, 500, [src])
        # ... a resume from step 500 under a new run is followed, no drop.
        src.copy_from(checkpoint(500))
        self.client.publish(name, 500, [src], run="job-1-resume@500")
        self.assertEqual(receiver.receive(0), f"{name}@500")
        self.assertEqual(receiver.weights.run, "job-1-resume@500")
        self.check(model, checkpoint(500))
        status = [m for m in self.client.status().models if m.model == name][0]
        self.assertEqual(status.run, "job-1-resume@500")
        self.assertEqual(list(status.past_runs), ["job-1"])
        with self.assertRaises(refit.FailedPreconditionError):
            self.client.publish(name, 900, [src], run="job-1")

    def test_torch_publisher_names_its_run(self):
        import refit.torch as refit_torch
        name = "py-torch-run"
        module = torch.nn.Linear(8, 8, bias=False)
        pub = refit_torch.publisher(self.client, name, module, run="r1", check_peers=False)
        self.addCleanup(pub.release)
        pub.publish(10)
        target = self.client.wait_for_target(name, 10, timeout=10)
        self.assertEqual((target.version, target.run), (10, "r1"))
        pub.publish(3, run="r2")  # resumed from step 3
        target = self.client.wait_for_target(name, 11, run="r1", timeout=10)
        self.assertEqual((target.version, target.run), (3, "r2"))
        pub.publish(4)  # the run stays r2
        self.assertEqual(self.client.wait_for_target(name, 4, timeout=10).run, "r2")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
