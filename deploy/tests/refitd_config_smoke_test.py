"""Starts the real refitd with each shipped config (deploy/refitd.toml and the ConfigMaps'
refitd.toml) the way systemd / Kubernetes would, and checks the contract the deploy files
rely on:
  * refitd accepts the config file (every key and value);
  * sd_notify: READY=1 arrives, and only once the socket, --listen, --health-listen and
    --metrics-listen all accept connections; WATCHDOG=1 pings at WATCHDOG_USEC/2 from the
    main loop; STOPPING=1 on SIGTERM, then exit 0 and the socket file gone;
  * the health port answers grpc.health.v1.Health/Check with SERVING (spoken as raw
    HTTP/2, the way the kubelet's grpc probe does) and serves nothing else;
  * the metrics port serves Prometheus text at /metrics;
  * the socket is mode 0660.
Addresses are overridden on the command line (flags win over the file) with free local
ports and a temporary socket, so the test runs anywhere; peers are cleared (cluster DNS
names do not resolve here).

Usage: refitd_config_smoke_test.py PATH_TO_REFITD
"""

import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploytest as dt  # noqa: E402

REFITD = None
WATCHDOG_USEC = 400000  # refitd pings every 200 ms


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


# ---- a minimal gRPC-over-HTTP/2 client: what a kubelet grpc probe sends ----

def _frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + \
        struct.pack(">I", stream) + payload


def _hpack_literal(name, value):
    """Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    def string(s):
        b = s.encode()
        n = len(b)
        if n < 127:
            return bytes([n]) + b
        out, n = bytearray([127]), n - 127
        while n >= 128:
            out.append((n & 127) | 128)
            n >>= 7
        out.append(n)
        return bytes(out) + b
    return b"\x00" + string(name) + string(value)


def _read_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return buf


def grpc_unary(port, method, request=b"", timeout=5.0):
    """Calls METHOD (/pkg.Service/Method) on 127.0.0.1:PORT over plaintext HTTP/2. Returns
    the response message bytes, or None when the call ended without one (an error: a
    trailers-only response such as UNIMPLEMENTED)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        headers = b"".join(_hpack_literal(k, v) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", method),
            (":authority", "127.0.0.1:%d" % port), ("content-type", "application/grpc"),
            ("te", "trailers"), ("user-agent", "refit-deploy-test")))
        message = b"\x00" + struct.pack(">I", len(request)) + request
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0) +
                  _frame(1, 0x4, 1, headers) + _frame(0, 0x1, 1, message))
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            header = _read_exact(s, 9)
            length = struct.unpack(">I", b"\x00" + header[:3])[0]
            ftype, flags = header[3], header[4]
            stream = struct.unpack(">I", header[5:9])[0] & 0x7FFFFFFF
            payload = _read_exact(s, length)
            if ftype == 4 and not flags & 0x1:       # SETTINGS -> ACK
                s.sendall(_frame(4, 0x1, 0))
            elif ftype == 6 and not flags & 0x1:     # PING -> ACK
                s.sendall(_frame(6, 0x1, 0, payload))
            elif ftype == 7:                         # GOAWAY
                raise ConnectionError("GOAWAY from the server")
            elif ftype == 3 and stream == 1:         # RST_STREAM
                raise ConnectionError("stream reset by the server")
            elif ftype == 0 and stream == 1:         # DATA
                if flags & 0x8:                      # PADDED
                    payload = payload[1:len(payload) - payload[0]]
                data += payload
                if flags & 0x1:
                    break
            elif ftype == 1 and stream == 1 and flags & 0x1:  # trailers: call over
                break
        if len(data) < 5:
            return None
        n = struct.unpack(">I", data[1:5])[0]
        return data[5:5 + n]


def health_status(port):
    """grpc.health.v1 status of the server's overall health ("" service): 1 = SERVING."""
    response = grpc_unary(port, "/grpc.health.v1.Health/Check")
    if response is None:
        return None
    # HealthCheckResponse { ServingStatus status = 1; } -> b"\x08<status>" (absent = 0).
    return response[1] if response[:1] == b"\x08" else 0


def make_certificates(directory, node):
    """A CA and a certificate for `node` signed by it, as tls.crt, tls.key, ca.crt."""
    def run(*args):
        subprocess.run(["openssl"] + list(args), cwd=directory, check=True,
                       capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=" + node, "-keyout", "tls.key",
        "-out", "tls.csr")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "tls.crt")


class RefitdProcess:
    """refitd started with a config file, its addresses overridden, under a fake systemd
    notify socket that records every message."""

    def __init__(self, config_text, tmp, extra_env=None, listen_host="127.0.0.1"):
        self.tmp = tmp
        self.config = os.path.join(tmp, "refitd.toml")
        with open(self.config, "w") as f:
            f.write(config_text)
        self.socket_path = os.path.join(tmp, "run", "refitd.sock")
        self.listen_port, self.health_port, self.metrics_port = (free_port(), free_port(),
                                                                 free_port())
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_path = os.path.join(tmp, "notify")
        self.notify.bind(self.notify_path)
        self.messages = []
        env = dict(os.environ, NOTIFY_SOCKET=self.notify_path,
                   WATCHDOG_USEC=str(WATCHDOG_USEC))
        env.pop("WATCHDOG_PID", None)
        env.pop("REFIT_SOCKET", None)
        env.pop("CREDENTIALS_DIRECTORY", None)
        env.update(extra_env or {})
        self.log = open(os.path.join(tmp, "refitd.log"), "w+")
        self.proc = subprocess.Popen(
            [REFITD, "--config=" + self.config, "--socket=" + self.socket_path,
             "--listen=%s:%d" % (listen_host, self.listen_port),
             "--health-listen=127.0.0.1:%d" % self.health_port,
             "--metrics-listen=127.0.0.1:%d" % self.metrics_port,
             "--peers=", "--node=deploy-test"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def wait_message(self, prefix, timeout):
        """Waits for a notify datagram with a line starting with PREFIX; returns the
        datagram, or None on timeout or if refitd exits first."""
        deadline = time.monotonic() + timeout
        for m in self.messages:
            if any(l.startswith(prefix) for l in m.splitlines()):
                return m
        while time.monotonic() < deadline:
            self.notify.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
            try:
                m = self.notify.recv(4096).decode()
            except socket.timeout:
                if self.proc.poll() is not None:
                    return None
                continue
            self.messages.append(m)
            if any(l.startswith(prefix) for l in m.splitlines()):
                return m
        return None

    def count(self, line):
        return sum(1 for m in self.messages for l in m.splitlines() if l == line)

    def drain(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.wait_message("\0never", end - time.monotonic())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        self.log.close()


class ConfigSmokeTest(unittest.TestCase):

    def run_config(self, config_text, origin):
        with tempfile.TemporaryDirectory() as tmp:
            # The Kubernetes configs name the CSI driver's files and the node's state dir:
            # certificates made here, and a state dir under tmp, stand in for them.
            if "/etc/refit-tls/" in config_text:
                certs = os.path.join(tmp, "tls")
                os.mkdir(certs)
                make_certificates(certs, "deploy-test")
                config_text = config_text.replace("/etc/refit-tls/", certs + "/")
            config_text = config_text.replace('state_dir = "/var/lib/refit"',
                                              'state_dir = "%s/state"' % tmp)
            d = RefitdProcess(config_text, tmp)
            try:
                ready = d.wait_message("READY=1", 60)
                self.assertIsNotNone(ready, "%s: no READY=1 (refitd exit=%s):\n%s" % (
                    origin, d.proc.poll(), d.output()))
                # READY=1 comes after every listener is up: all accept now, at once.
                self.assertTrue(os.path.exists(d.socket_path), origin)
                mode = stat.S_IMODE(os.stat(d.socket_path).st_mode)
                self.assertEqual(mode, 0o660, "%s: socket mode %o" % (origin, mode))
                for name, port in (("listen", d.listen_port), ("health", d.health_port),
                                   ("metrics", d.metrics_port)):
                    self.assertTrue(accepts(port), "%s: %s port %d not up at READY=1" % (
                        origin, name, port))

                self.assertEqual(health_status(d.health_port), 1,
                                 "%s: health port is not SERVING" % origin)
                # Nothing but grpc.health.v1 on the health port: Status gets no response.
                self.assertIsNone(grpc_unary(d.health_port, "/refit.v1.Refit/Status"),
                                  "%s: refit.v1.Refit is served on the health port" % origin)

                with urllib.request.urlopen(
                        "http://127.0.0.1:%d/metrics" % d.metrics_port, timeout=5) as r:
                    self.assertEqual(r.status, 200)
                    self.assertTrue(r.headers.get("Content-Type", "").startswith("text/plain"),
                                    r.headers.get("Content-Type"))
                    body = r.read().decode()
                self.assertIn("refit_publish_total", body, "%s: /metrics:\n%s" % (
                    origin, body[:2000]))
                # Prometheus's own linter accepts it: HELP and TYPE for every metric, names
                # and units by its conventions (promtool: Debian's prometheus package).
                lint = subprocess.run(["promtool", "check", "metrics"], input=body,
                                      capture_output=True, text=True)
                self.assertEqual((lint.returncode, lint.stdout + lint.stderr), (0, ""),
                                 "%s: promtool check metrics on /metrics" % origin)
                self.assertIn("# HELP refit_publish_total ", body)

                # Watchdog pings from the main loop, every WATCHDOG_USEC / 2.
                d.drain(WATCHDOG_USEC * 4 / 1e6)
                self.assertGreaterEqual(d.count("WATCHDOG=1"), 3, "%s: %r" % (
                    origin, d.messages))

                d.proc.terminate()
                self.assertIsNotNone(d.wait_message("STOPPING=1", 20),
                                     "%s: no STOPPING=1 after SIGTERM:\n%s" % (origin,
                                                                                d.output()))
                self.assertEqual(d.proc.wait(timeout=30), 0, d.output())
                self.assertFalse(os.path.exists(d.socket_path), "socket left behind")
            finally:
                d.close()

    def test_sample_config(self):
        self.run_config(dt.read("deploy/refitd.toml"), "deploy/refitd.toml")

    def test_configmaps(self):
        n = 0
        for f in dt.k8s_manifest_files():
            for doc in dt.load_yaml_documents(f):
                if doc.get("kind") == "ConfigMap" and "refitd.toml" in doc.get("data", {}):
                    with self.subTest(configmap=doc["metadata"]["name"]):
                        self.run_config(doc["data"]["refitd.toml"],
                                        "%s (%s)" % (f, doc["metadata"]["name"]))
                    n += 1
        self.assertEqual(n, 2)

    def test_shipped_config_refuses_plaintext_off_loopback(self):
        # The .deb's conffile with --listen moved off loopback and no certificates: refused
        # before anything listens, saying how to fix it.
        for host in ("0.0.0.0", "[::]"):
            with tempfile.TemporaryDirectory() as tmp:
                d = RefitdProcess(dt.read("deploy/refitd.toml"), tmp, listen_host=host)
                try:
                    rc = d.proc.wait(timeout=30)
                    out = d.output()
                    self.assertEqual(rc, 1, out)
                    self.assertIn("is not a loopback address", out)
                    for fix in ("--tls-cert", "--allow-plaintext-peers", "127.0.0.1"):
                        self.assertIn(fix, out)
                    self.assertFalse(os.path.exists(d.socket_path))
                    self.assertFalse(accepts(d.health_port))
                finally:
                    d.close()

    def test_shipped_config_with_systemd_credentials(self):
        """The unit hands /etc/refit/tls/* over as $CREDENTIALS_DIRECTORY/{tls.crt,tls.key,
        ca.crt}, empty where the operator put none."""
        with tempfile.TemporaryDirectory() as tmp:
            creds = os.path.join(tmp, "credentials")
            os.mkdir(creds)
            make_certificates(creds, "deploy-test")
            d = RefitdProcess(dt.read("deploy/refitd.toml"), tmp,
                              extra_env={"CREDENTIALS_DIRECTORY": creds})
            try:
                self.assertIsNotNone(d.wait_message("READY=1", 60), d.output())
                self.assertIn("peer plane: mutual TLS (certificate %s/tls.crt" % creds,
                              d.output())
                self.assertNotIn("the peer plane is unauthenticated", d.output())
                # A plaintext HTTP/2 gRPC call on the peer port gets no answer.
                try:
                    answer = grpc_unary(d.listen_port, "/refit.v1.Peer/Hello")
                except ConnectionError:
                    answer = None
                self.assertIsNone(answer)
            finally:
                d.close()
        # The unit's defaults ("none"): no certificates, plaintext on loopback.
        with tempfile.TemporaryDirectory() as tmp:
            creds = os.path.join(tmp, "credentials")
            os.mkdir(creds)
            for name in ("tls.crt", "tls.key", "ca.crt"):
                with open(os.path.join(creds, name), "w") as f:
                    f.write("none")
            d = RefitdProcess(dt.read("deploy/refitd.toml"), tmp,
                              extra_env={"CREDENTIALS_DIRECTORY": creds})
            try:
                self.assertIsNotNone(d.wait_message("READY=1", 60), d.output())
                self.assertNotIn("peer plane: mutual TLS", d.output())
            finally:
                d.close()
        # Some but not all: refused at start, naming the missing file.
        with tempfile.TemporaryDirectory() as tmp:
            creds = os.path.join(tmp, "credentials")
            os.mkdir(creds)
            make_certificates(creds, "deploy-test")
            with open(os.path.join(creds, "ca.crt"), "w") as f:
                f.write("none")
            d = RefitdProcess(dt.read("deploy/refitd.toml"), tmp,
                              extra_env={"CREDENTIALS_DIRECTORY": creds})
            try:
                self.assertEqual(d.proc.wait(timeout=30), 2, d.output())
                self.assertIn("ca.crt missing or not PEM", d.output())
            finally:
                d.close()

    def test_bad_config_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            config = os.path.join(tmp, "refitd.toml")
            with open(config, "w") as f:
                f.write('retain = 2\nhealth_port = "0.0.0.0:7071"\n')
            r = subprocess.run([REFITD, "--config=" + config,
                                "--socket=" + os.path.join(tmp, "s.sock")],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("health_port", r.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    REFITD = os.path.abspath(sys.argv.pop(1))
    dt.main()
