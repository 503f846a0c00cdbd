"""End to end: trainer.py publishes through a real refitd; two engine.py processes (fp32 and
bf16) apply every version. The fp32 engine must hold bit-identical weights (equal digests).

Run by Bazel (//examples:examples_test), or by hand: REFITD=bazel-bin/daemon/refitd
PYTHONPATH=client/python /usr/bin/python3 examples/examples_test.py
"""

import os
import re
import subprocess
import sys
import time
import unittest

import refit.testing

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def script(name: str, *args: str):
    return [sys.executable, os.path.join(HERE, name), *args]


class ExamplesTest(unittest.TestCase):
    def setUp(self):
        self.daemon = refit.testing.Daemon(args=["--retain=8"])
        self.addCleanup(self.daemon.stop)

    def start_engine(self, *args: str) -> subprocess.Popen:
        engine = subprocess.Popen(
            script("engine.py", f"--socket={self.daemon.socket}", f"--until-version={STEPS}",
                   "--timeout=60", *args),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, engine)
        # Registered and waiting before the trainer publishes, so it sees every version.
        line = engine.stdout.readline()
        self.assertIn("waiting for model=tiny-lm", line)
        return engine

    @staticmethod
    def stop(process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.terminate()  # the engine releases its buffer on SIGTERM
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def test_trainer_and_engines_sync_every_version(self):
        fp32 = self.start_engine()
        bf16 = self.start_engine("--dtype=bfloat16")
        start = time.monotonic()
        trainer = subprocess.run(
            script("trainer.py", f"--socket={self.daemon.socket}", f"--steps={STEPS}",
                   "--shards=2", "--interval=0.05"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(trainer.returncode, 0, trainer.stdout)
        outputs = {}
        for name, engine in (("fp32", fp32), ("bf16", bf16)):
            out, _ = engine.communicate(timeout=max(10, 120 - (time.monotonic() - start)))
            self.assertEqual(engine.returncode, 0, out)
            outputs[name] = out

        published = dict(re.findall(r"published version (\d+) .*digest=(\w+)", trainer.stdout))
        self.assertEqual(sorted(published, key=int), [str(v) for v in range(1, STEPS + 1)],
                         trainer.stdout)
        for name, out in outputs.items():
            applied = re.findall(r"applied version (\d+) bytes=(\d+) .*digest=(\w+)", out)
            self.assertEqual([int(v) for v, _, _ in applied], list(range(1, STEPS + 1)), out)
            self.assertTrue(all(int(b) > 0 for _, b, _ in applied), out)
            if name == "fp32":
                self.assertEqual({v: d for v, _, d in applied}, published, out)
        status = self.daemon.client().status()
        (model,) = [m for m in status.models if m.model == "tiny-lm"]
        self.assertEqual(model.latest_version, STEPS)


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        os.environ["REFITD"] = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
