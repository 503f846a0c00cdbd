"""Runs the README's two-node recipe (the block between the readme-recipe markers) in bash, as
a user pasting it would, with three changes that let it run inside a test: the `bazel build`
line is left out (Bazel built the binaries already: ./bazel-bin points at them), the ports
7070/7071 become free ones and /tmp/refit-recipe a fresh directory. Then checks what it
printed: every version applied and checked, the engine's node holding them, the trainer's
node showing who pulls from it."""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import unittest

RUNFILES = os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "refit"))


def free_ports(n: int) -> list:
    """n distinct ports on 127.0.0.1 that were free a moment ago: the sockets are held open until
    all n are bound, since a port-0 bind may be given the port the previous one just closed."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def recipe() -> str:
    with open(os.path.join(RUNFILES, "README.md")) as f:
        text = f.read()
    block = re.search(r"<!-- readme-recipe: begin -->\n```sh\n(.*?)```\n<!-- readme-recipe: end -->",
                      text, re.S)
    if not block:
        raise AssertionError("README.md has no readme-recipe block")
    return block.group(1)


class ReadmeRecipeTest(unittest.TestCase):
    def test_recipe_runs_as_pasted(self):
        script = recipe()
        lines = script.splitlines()
        self.assertTrue(lines[0].startswith("bazel build "), lines[0])
        # Everything the rest runs must be what that line builds.
        for binary in ("refitd", "refitctl", "refit_demo"):
            self.assertIn(binary, script)
        script = "\n".join(lines[1:]) + "\n"
        work = tempfile.mkdtemp(prefix="refit-recipe-", dir="/tmp")
        os.symlink(RUNFILES, os.path.join(work, "bazel-bin"))
        for old, port in zip(("7070", "7071"), free_ports(2)):
            self.assertIn(old, script)
            script = script.replace(old, str(port))
        script = script.replace("/tmp/refit-recipe", os.path.join(work, "run"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        env.pop("REFIT_SOCKET", None)
        # Its own process group: the daemons it starts in the background are in it too.
        proc = subprocess.Popen(["/bin/bash", "-e", "-c", script], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            # The recipe's last line stops the daemons; make sure of it whatever happened.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.stderr.write(out + err)
        self.assertEqual(proc.returncode, 0, err)
        table = [l for l in out.splitlines() if re.match(r"^[123]\s+\d+", l)]
        self.assertEqual(len(table), 3, out)
        for row in table:
            self.assertTrue(row.rstrip().endswith("ok"), row)
        self.assertIn("node: engine-node", out)
        self.assertRegex(out, r"engine-node\s+\S+\s+pulled by\s+connected")
        self.assertRegex(out, r"trainer-node\s+\S+\s+pulls from\s+connected")


if __name__ == "__main__":
    unittest.main()
