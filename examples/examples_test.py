"""End to end through two real refitd daemons acting as two nodes: trainer.py publishes on the
trainer's node; two engine.py processes (fp32 and bf16) on the engine's node, whose daemon pulls
each version over UCX, apply every version. The fp32 engine must hold bit-identical weights
(equal digests).

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


def first_line(process: subprocess.Popen) -> str:
    """The process's first line of its own output: library warnings some torch builds log to
    stderr at import (e.g. "W1203 ... torch/_opaque_base.py:6] ... deprecated") are skipped."""
    while True:
        line = process.stdout.readline()
        if not line or not re.match(r"[WI]\d{4} \d\d:\d\d:\d\d\.\d+ ", line):
            return line


def script(name: str, *args: str):
    return [sys.executable, os.path.join(HERE, name), *args]


class ExamplesTest(unittest.TestCase):
    def setUp(self):
        self.trainer_node = refit.testing.Daemon(args=["--retain=8", "--node=trainer-node"])
        self.addCleanup(self.trainer_node.stop)
        port = self.trainer_node.client().status().listen_port
        self.daemon = refit.testing.Daemon(
            args=["--retain=8", "--node=engine-node", f"--peers=127.0.0.1:{port}"])
        self.addCleanup(self.daemon.stop)
        deadline = time.monotonic() + 20
        while not all(p.connected for p in self.daemon.client().status().peers):
            self.assertLess(time.monotonic(), deadline, "the daemons did not connect")
            time.sleep(0.05)

    def start_engine(self, *args: str) -> subprocess.Popen:
        engine = subprocess.Popen(
            script("engine.py", f"--socket={self.daemon.socket}", f"--until-version={STEPS}",
                   "--timeout=60", *args),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, engine)
        # Registered and waiting before the trainer publishes, so it sees every version.
        line = first_line(engine)
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
            script("trainer.py", f"--socket={self.trainer_node.socket}", f"--steps={STEPS}",
                   "--shards=2", "--interval=0.3"),
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
        self.assertGreater(status.metrics["refit_data_bytes_received_total"], 0)

    def test_trainer_stays_within_one_version_of_the_engines(self):
        engine = self.start_engine()
        trainer = subprocess.run(
            script("trainer.py", f"--socket={self.trainer_node.socket}", f"--steps={STEPS}",
                   "--max-ahead=1", "--quorum=0", "--replica-timeout=60", "--interval=0.3"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(trainer.returncode, 0, trainer.stdout)
        # Before publishing N the trainer waited for N - 1 on the engine's node.
        reached = re.findall(r"version (\d+) is on 1 engine node\(s\) \(engine-node\)",
                             trainer.stdout)
        self.assertEqual([int(v) for v in reached], list(range(1, STEPS)), trainer.stdout)
        out, _ = engine.communicate(timeout=60)
        self.assertEqual(engine.returncode, 0, out)

    def test_bf16_trainer_into_fp8_engine_with_block_scales(self):
        engine = subprocess.Popen(
            script("fp8_engine.py", f"--socket={self.daemon.socket}",
                   f"--until-version={STEPS}"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, engine)
        self.assertIn("waiting for model=tiny-lm", first_line(engine))
        trainer = subprocess.run(
            script("trainer.py", f"--socket={self.trainer_node.socket}", f"--steps={STEPS}",
                   "--shards=2", "--interval=0.3", "--publish-dtype=bfloat16"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(trainer.returncode, 0, trainer.stdout)
        out, _ = engine.communicate(timeout=120)
        self.assertEqual(engine.returncode, 0, out)
        applied = re.findall(r"applied version (\d+) bytes=(\d+) max_err_over_scale=([\d.]+) "
                             r"tag=(\S+) data_ptr_moved=(\d+)", out)
        self.assertEqual([int(a[0]) for a in applied], list(range(1, STEPS + 1)), out)
        # |q * s - x| <= 16 s: half the e4m3 step at the top of the range, nothing worse.
        self.assertTrue(all(float(a[2]) <= 16.0 for a in applied), out)
        # Written in place by Apply (the adapter's zero copy): no parameter ever moved.
        self.assertEqual([a[3] for a in applied], [f"tiny-lm@{v}" for v in range(1, STEPS + 1)])
        self.assertEqual({a[4] for a in applied}, {"0"}, out)
        status = self.daemon.client().status()
        self.assertGreater(status.metrics["refit_quantized_values_total"], 0)
        self.assertEqual(status.metrics["refit_nonfinite_values_total"], 0)

    def test_fsdp2_trainer_and_vllm_layout_engine(self):
        """examples/fsdp_trainer.py under torchrun (2 ranks, FSDP2, gloo) and fsdp_engine.py:
        the engine's weights (fused qkv_proj / gate_up_proj) equal the trainer's whole model,
        gathered by torch on rank 0, at every version (equal digests)."""
        engine = subprocess.Popen(
            script("fsdp_engine.py", f"--socket={self.daemon.socket}",
                   f"--until-version={STEPS}", "--timeout=240"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, engine)
        line = first_line(engine)
        self.assertIn("waiting for model=qwen3-tiny", line)
        self.assertIn("qkv_proj (128, 64)", line)
        hold = os.path.join(self.trainer_node.dir, "engine-done")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             "--standalone", os.path.join(HERE, "fsdp_trainer.py"),
             f"--socket={self.trainer_node.socket}", f"--steps={STEPS}", "--digest"],
            env=dict(os.environ, REFIT_EXAMPLE_HOLD=hold, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, trainer)
        out, _ = engine.communicate(timeout=300)
        open(hold, "w").close()
        trainer_out, _ = trainer.communicate(timeout=120)
        self.assertEqual(trainer.returncode, 0, trainer_out)
        self.assertEqual(engine.returncode, 0, out)
        published = dict(re.findall(r"rank 0: published version (\d+) .*digest=(\w+)",
                                    trainer_out))
        self.assertEqual(sorted(published, key=int), [str(v) for v in range(1, STEPS + 1)],
                         trainer_out)
        applied = dict(re.findall(r"applied version (\d+) bytes=\d+ digest=(\w+)", out))
        self.assertEqual(applied, published, out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        os.environ["REFITD"] = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
