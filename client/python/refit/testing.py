"""Starts a real refitd for tests and examples: a temporary socket, TCP port 0, cleaned up.

    with refit.testing.Daemon() as daemon:       # the binary: $REFITD, else refitd on $PATH
        client = refit.Client(daemon.socket)

Not thread-safe; one thread owns a Daemon.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Optional, Sequence

from refit import errors
from refit.client import Client


def find_refitd() -> str:
    path = os.environ.get("REFITD") or shutil.which("refitd")
    if not path:
        raise FileNotFoundError("no refitd: set $REFITD to the binary (bazel-bin/daemon/refitd)")
    return os.path.abspath(path)


class Daemon:
    """A refitd child process serving a fresh socket; stopped and removed by stop()."""

    def __init__(self, args: Sequence[str] = (), binary: Optional[str] = None,
                 log_level: str = "debug", start_timeout: float = 20.0):
        self.binary = binary or find_refitd()
        # Under /tmp and short: Unix socket paths are limited to 107 bytes.
        self.dir = tempfile.mkdtemp(prefix="refit-py-", dir="/tmp")
        self.socket = os.path.join(self.dir, "refitd.sock")
        self.log_path = os.path.join(self.dir, "refitd.log")
        self.args = [self.binary, f"--socket={self.socket}", "--listen=127.0.0.1:0",
                     f"--log-level={log_level}", *args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_serving(start_timeout)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"refitd exited with {self.process.returncode} during start:"
                                   f"\n{self.log()[-4000:]}")
            if os.path.exists(self.socket):
                try:
                    with Client(self.socket, connect_timeout=0.5, call_timeout=1.0) as c:
                        c.status()
                    return
                except errors.RefitError:
                    pass
            time.sleep(0.02)
        raise TimeoutError(f"refitd did not serve {self.socket} within {timeout:g} s:\n"
                           f"{self.log()[-4000:]}")

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> Optional[int]:
        """Sends `sig`, waits up to `timeout` s (then SIGKILL); returns the exit code (-N for
        signal N) and removes the temporary directory."""
        code = None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        else:
            code = self.process.returncode
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
