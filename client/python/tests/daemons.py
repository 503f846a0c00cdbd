"""Real refitd daemons for the Python tests: one per test class (`DaemonCase`), or two as the
trainer's node and an engine's node (`two_nodes`)."""

import sys
import time
import unittest

import refit
import refit.testing


class DaemonCase(unittest.TestCase):
    """One real refitd per test class, started with `daemon_args`; a test class fails when it
    exits other than cleanly (its log's end printed)."""

    daemon_args = ()

    @classmethod
    def setUpClass(cls):
        cls.daemon = refit.testing.Daemon(args=cls.daemon_args)
        cls.client = cls.daemon.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        code = cls.daemon.stop()
        if code != 0:
            print(cls.daemon.log()[-4000:], file=sys.stderr)
        assert code == 0, f"refitd exited with {code}"

    def register(self, *args, **kwargs):
        buf = self.client.register(*args, **kwargs)
        self.addCleanup(buf.release)
        return buf

    def publish(self, model, version, tensors, src=None):
        """Publishes `tensors` (name -> tensor) as `version` of `model` from `src`: a SOURCE
        buffer of them registered at the first call (src None), their values copied in at the
        next; returns it for the next call."""
        if src is None:
            src = self.register(model, refit.SOURCE, dict(tensors))
        else:
            src.copy_from(tensors)
        self.client.publish(model, version, [src])
        return src


def two_nodes(test: unittest.TestCase, retain: int = 8):
    """A trainer's node and an engine's node peering with it (connected), each keeping `retain`
    versions; stopped when `test` ends."""
    trainer = refit.testing.Daemon(args=[f"--retain={retain}", "--node=trainer-node"])
    test.addCleanup(trainer.stop)
    port = trainer.client().status().listen_port
    engine = refit.testing.Daemon(
        args=[f"--retain={retain}", "--node=engine-node", f"--peers=127.0.0.1:{port}"])
    test.addCleanup(engine.stop)
    deadline = time.monotonic() + 20
    while not all(p.connected for p in engine.client().status().peers):
        test.assertLess(time.monotonic(), deadline, "the daemons did not connect")
        time.sleep(0.05)
    return trainer, engine
