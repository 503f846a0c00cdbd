"""Clients ride out a restart of refitd (issue 18): a trainer's and an engine's Client keep
their buffers through a SIGKILLed and restarted refitd on the same socket — the next call
registers them again (memfds passed anew) and carries on: publish, wait, apply, bit-exact.
Binary: $REFITD or argv[1]."""

import os
import signal
import subprocess
import sys
import unittest

import torch

import refit
import refit.testing


def restart(daemon: refit.testing.Daemon) -> None:
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait()
    with open(daemon.log_path, "ab") as log:
        daemon.process = subprocess.Popen(daemon.args, stdout=log, stderr=subprocess.STDOUT)
    daemon._wait_serving(20)


class RestartTest(unittest.TestCase):
    def test_trainer_and_engine_carry_on_after_a_restart(self):
        with refit.testing.Daemon() as daemon:
            trainer = daemon.client()
            engine = daemon.client()
            weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
                       "b": torch.ones(64, dtype=torch.bfloat16)}
            src = trainer.register("m", "SOURCE", weights)
            dst = engine.register("m", "DESTINATION",
                                  {k: torch.zeros_like(v) for k, v in weights.items()})
            self.assertEqual(src.host_memory, "memfd")
            trainer.publish("m", 1, src)
            self.assertEqual(engine.wait_for_version("m", 1, timeout=10), 1)
            engine.apply("m", dst, 1)
            self.assertTrue(torch.equal(dst.tensors["w"], weights["w"]))
            first_ids = (src.buffer_id, dst.buffer_id)
            watch = engine.watch("m", after_version=0)

            restart(daemon)

            # The trainer's next step: its buffer is registered again under the hood.
            src.tensors["w"].add_(1)
            trainer.publish("m", 2, src)
            # The engine waits on the new refitd (its buffer registered again by its first call).
            self.assertEqual(engine.wait_for_version("m", 2, timeout=10), 2)
            engine.apply("m", dst, 2)
            self.assertTrue(torch.equal(dst.tensors["w"], weights["w"] + 1))
            self.assertTrue(torch.equal(dst.tensors["b"], weights["b"]))
            # The watch opened before the restart goes on after it.
            self.assertEqual(next(watch).version, 2)
            watch.cancel()
            # Callers keep the ids they were given; refitd holds one buffer each, not two.
            self.assertEqual((src.buffer_id, dst.buffer_id), first_ids)
            status = trainer.status()
            model = [m for m in status.models if m.model == "m"][0]
            self.assertEqual((model.source_buffers, model.destination_buffers), (1, 1))
            src.release()
            dst.release()
            trainer.close()
            engine.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ.setdefault("REFITD", sys.argv[1])
    unittest.main(argv=[sys.argv[0]])
