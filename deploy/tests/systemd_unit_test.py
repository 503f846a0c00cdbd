"""Checks deploy/systemd (the refitd unit and its sysusers.d entry) and the sample config
deploy/refitd.toml:
  * the unit, parsed as text, has every directive the deployment relies on (Type=notify,
    the watchdog, restarts, the refit user, /run/refit, hardening that keeps /dev/shm and
    /dev/nvidia* usable);
  * `systemd-analyze verify` accepts it, with no warning, and `systemd-analyze security
    --offline` rates it (when systemd-analyze can run here; else the checks are SKIPPED
    with a message, or fail when REFIT_REQUIRE_SYSTEMD=1);
  * systemd-sysusers creates the user and group from the sysusers.d entry;
  * the sample config has every key, documented, with values refitd accepts.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploytest as dt  # noqa: E402

UNIT = "deploy/systemd/refitd.service"
SYSUSERS = "deploy/systemd/sysusers-refit.conf"
SAMPLE_CONFIG = "deploy/refitd.toml"
# `systemd-analyze security` exposure, 0.0 (locked down) to 10.0; --threshold takes x10.
MAX_EXPOSURE = 2.5


def parse_unit(text):
    """{section: {key: [values in order]}} of a unit file. Comments and blank lines are
    dropped; an empty assignment (Key=) is kept as '' (it resets a list in systemd)."""
    sections, current = {}, None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            raise AssertionError("%s:%d: line continuations are not used here" % (UNIT, lineno))
        m = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if m:
            current = sections.setdefault(m.group(1), {})
            continue
        if current is None or "=" not in line:
            raise AssertionError("%s:%d: not Key=value in a section: %r" % (UNIT, lineno, raw))
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def timespan_seconds(value):
    """systemd time span ("30s", "1min 30s", "2", "500ms") -> seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600,
             "hr": 3600}
    if re.fullmatch(r"\d+", value):
        return float(value)
    total, pos = 0.0, 0
    for m in re.finditer(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)", value):
        if m.start() != pos:
            break
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    if pos != len(value) or not value:
        raise ValueError("not a time span: %r" % value)
    return total


def boolean(value):
    v = value.lower()
    if v in ("1", "yes", "y", "true", "t", "on"):
        return True
    if v in ("0", "no", "n", "false", "f", "off"):
        return False
    raise ValueError("not a boolean: %r" % value)


def analyze_unavailable_reason():
    """None if `systemd-analyze verify` works here, else why not (checked on a unit that
    is certainly valid, so a failure is the environment's, not refitd.service's)."""
    exe = shutil.which("systemd-analyze")
    if not exe:
        return "systemd-analyze is not installed (Debian package: systemd)"
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "refit-probe.service")
        with open(probe, "w") as f:
            f.write("[Unit]\nDescription=probe\n[Service]\nType=oneshot\nExecStart=/bin/true\n")
        try:
            r = subprocess.run([exe, "verify", "--man=no", probe], capture_output=True,
                               text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return "systemd-analyze verify cannot run here: %s" % e
        if r.returncode != 0:
            return ("systemd-analyze verify cannot run in this environment (it fails on a "
                    "trivial valid unit, rc=%d): %s" % (r.returncode, r.stderr.strip()[:500]))
    return None


class UnitFileTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.text = dt.read(UNIT)
        cls.unit = parse_unit(cls.text)

    def one(self, section, key):
        values = self.unit.get(section, {}).get(key)
        self.assertIsNotNone(values, "[%s] %s= is missing" % (section, key))
        self.assertEqual(len(values), 1, "[%s] %s= is set more than once" % (section, key))
        return values[0]

    def absent_or_false(self, section, key, why):
        for v in self.unit.get(section, {}).get(key, []):
            self.assertFalse(boolean(v), "[%s] %s=%s: %s" % (section, key, v, why))

    def test_sections(self):
        self.assertEqual(set(self.unit), {"Unit", "Service", "Install"})
        self.assertTrue(self.one("Unit", "Description"))
        self.assertEqual(self.one("Install", "WantedBy"), "multi-user.target")

    def test_notify_and_watchdog(self):
        self.assertEqual(self.one("Service", "Type"), "notify")
        self.assertIn(self.unit["Service"].get("NotifyAccess", ["main"])[-1], ("main",))
        watchdog = timespan_seconds(self.one("Service", "WatchdogSec"))
        self.assertGreaterEqual(watchdog, 5, "too short a watchdog for a busy daemon")
        self.assertLessEqual(watchdog, 300)
        # The stop timeout covers refitd's 5 s grace for in-flight calls.
        self.assertGreater(timespan_seconds(self.one("Service", "TimeoutStopSec")), 5)

    def test_exec_and_restart(self):
        self.assertEqual(self.one("Service", "ExecStart"),
                         "%s --config=%s" % (dt.DAEMON_BINARY, dt.CONFIG_PATH))
        self.assertEqual(self.one("Service", "Restart"), "on-failure")
        self.assertGreater(timespan_seconds(self.one("Service", "RestartSec")), 0)

    def test_user_and_runtime_directory(self):
        self.assertEqual(self.one("Service", "User"), "refit")
        self.assertEqual(self.one("Service", "Group"), "refit")
        self.assertNotIn("DynamicUser", self.unit["Service"],
                         "a fixed refit group is what clients join")
        self.assertEqual(self.one("Service", "RuntimeDirectory"), "refit")
        mode = int(self.one("Service", "RuntimeDirectoryMode"), 8)
        self.assertEqual(mode & 0o007, 0, "others must not reach the socket directory")
        self.assertEqual(mode & 0o050, 0o050, "the refit group must traverse it")
        umask = int(self.one("Service", "UMask"), 8)
        self.assertEqual(umask & 0o007, 0o007, "the socket must never be world-accessible")
        self.assertEqual(umask & 0o060, 0, "the socket must be group read/write")
        # The socket of the sample config is in that directory.
        config = dt.parse_toml(dt.read(SAMPLE_CONFIG), SAMPLE_CONFIG)
        self.assertEqual(os.path.dirname(config["socket"]), "/run/refit")

    def test_hardening(self):
        s = self.unit["Service"]
        self.assertTrue(boolean(self.one("Service", "NoNewPrivileges")))
        self.assertEqual(self.one("Service", "ProtectSystem"), "strict")
        self.assertIn(self.one("Service", "ProtectHome"), ("yes", "read-only", "tmpfs"))
        self.assertTrue(boolean(self.one("Service", "PrivateTmp")))
        self.assertEqual(s.get("CapabilityBoundingSet"), [""], "no capabilities at all")
        for key in ("ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
                    "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime"):
            self.assertTrue(boolean(self.one("Service", key)), key)

    def test_dev_shm_stays_shared(self):
        # Clients' buffers are POSIX shm in the host's /dev/shm; a private IPC namespace or
        # private /dev would give the daemon an empty /dev/shm of its own.
        self.absent_or_false("Service", "PrivateIPC", "the daemon needs the host's /dev/shm")
        self.absent_or_false("Service", "PrivateDevices", "hides /dev/shm and /dev/nvidia*")
        self.absent_or_false("Service", "RemoveIPC", "would delete shm owned by refit on stop")
        self.assertNotIn("IPCNamespacePath", self.unit["Service"])
        self.assertNotIn("JoinsNamespaceOf", self.unit["Unit"])
        for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem",
                    "BindPaths", "BindReadOnlyPaths"):
            for value in self.unit["Service"].get(key, []):
                for p in value.split():
                    p = p.lstrip("-+").split(":")[0]
                    self.assertFalse(p in ("/", "/dev", "/dev/shm") or
                                     "/dev/shm".startswith(p.rstrip("/") + "/"),
                                     "%s=%s covers /dev/shm" % (key, value))
        # ProtectSystem=strict leaves /dev alone (an API file system), so /dev/shm stays
        # writable; ProcSubset=pid would hide /proc/driver/nvidia from CUDA.
        self.assertNotEqual(self.unit["Service"].get("ProcSubset", ["all"])[-1], "pid")

    def test_nvidia_devices_allowed(self):
        policy = self.unit["Service"].get("DevicePolicy", ["auto"])[-1]
        allow = self.unit["Service"].get("DeviceAllow", [])
        if policy in ("closed", "strict") or allow:
            specs = [a.split()[0] for a in allow if a]
            self.assertTrue(any(re.fullmatch(r"char-nvidia\*", s) for s in specs),
                            "DeviceAllow must let every NVIDIA char device group through "
                            "(char-nvidia*: nvidia, nvidiactl, nvidia-frontend, nvidia-uvm, "
                            "nvidia-caps)")
            for a in allow:
                if a.split()[0].startswith("char-nvidia"):
                    self.assertIn("rw", a.split()[1], a)
        self.assertNotEqual(policy, "strict", "strict would also deny /dev/null and friends")

    def test_address_families(self):
        families = " ".join(self.unit["Service"].get("RestrictAddressFamilies", [])).split()
        if families:
            for needed in ("AF_UNIX", "AF_INET", "AF_INET6"):
                self.assertIn(needed, families)

    def test_systemd_analyze_verify(self):
        reason = analyze_unavailable_reason()
        if reason:
            dt.skip_or_fail(self, reason)
        with tempfile.TemporaryDirectory() as tmp:
            # verify insists that ExecStart's binary exists and is executable; refitd is not
            # installed here, so the copy under test runs /bin/true with the same arguments.
            # Everything else in the file is verified as shipped.
            text = self.text.replace("ExecStart=%s " % dt.DAEMON_BINARY, "ExecStart=/bin/true ")
            self.assertNotEqual(text, self.text)
            unit = os.path.join(tmp, "refitd.service")
            with open(unit, "w") as f:
                f.write(text)
            r = subprocess.run(["systemd-analyze", "verify", "--man=no", unit],
                               capture_output=True, text=True, timeout=120)
            output = (r.stdout + r.stderr).strip()
            self.assertEqual(r.returncode, 0, output)
            # verify exits 0 on unknown keys and bad values it ignores; any line about the
            # unit is a warning we do not ship.
            problems = [l for l in output.splitlines() if "refitd.service" in l]
            self.assertEqual(problems, [], output)

    def test_systemd_analyze_security(self):
        reason = analyze_unavailable_reason()
        if reason:
            dt.skip_or_fail(self, reason)
        help_text = subprocess.run(["systemd-analyze", "--help"], capture_output=True,
                                   text=True).stdout
        if "--offline" not in help_text:
            dt.skip_or_fail(self, "this systemd-analyze has no `security --offline` (< v250)")
        with tempfile.TemporaryDirectory() as tmp:
            unit = os.path.join(tmp, "refitd.service")
            with open(unit, "w") as f:
                f.write(self.text.replace("ExecStart=%s " % dt.DAEMON_BINARY,
                                          "ExecStart=/bin/true "))
            r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                                "--threshold=%d" % int(MAX_EXPOSURE * 10), unit],
                               capture_output=True, text=True, timeout=120)
            output = r.stdout + r.stderr
            m = re.search(r"Overall exposure level for refitd\.service: (\d+\.\d+)", output)
            self.assertIsNotNone(m, output[-2000:])
            sys.stderr.write("systemd-analyze security: exposure %s\n" % m.group(1))
            self.assertLessEqual(float(m.group(1)), MAX_EXPOSURE, output[-3000:])
            self.assertEqual(r.returncode, 0, output[-3000:])


class SysusersTest(unittest.TestCase):

    def entries(self):
        out = []
        for line in dt.read(SYSUSERS).splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                # Fields are whitespace-separated; GECOS may be quoted.
                out.append(re.findall(r'"[^"]*"|\S+', line))
        return out

    def test_entries(self):
        entries = self.entries()
        self.assertIn(["g", "refit", "-"], [e[:3] for e in entries])
        users = [e for e in entries if e[0] == "u"]
        self.assertEqual(len(users), 1)
        u = users[0]
        self.assertEqual(u[1], "refit")
        self.assertIn(u[2], ("-", "-:refit"))
        self.assertEqual(u[-1], "/usr/sbin/nologin")

    def test_systemd_sysusers_creates_them(self):
        exe = shutil.which("systemd-sysusers")
        if not exe:
            dt.skip_or_fail(self, "systemd-sysusers is not installed (Debian package: systemd)")
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "etc"))
            r = subprocess.run([exe, "--root=" + root, dt.path(SYSUSERS)],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            with open(os.path.join(root, "etc", "passwd")) as f:
                passwd = [l.split(":") for l in f.read().splitlines()]
            with open(os.path.join(root, "etc", "group")) as f:
                group = [l.split(":") for l in f.read().splitlines()]
            users = [p for p in passwd if p[0] == "refit"]
            groups = [g for g in group if g[0] == "refit"]
            self.assertEqual(len(users), 1, passwd)
            self.assertEqual(len(groups), 1, group)
            self.assertEqual(users[0][3], groups[0][2], "refit's primary group is refit")
            self.assertLess(int(users[0][2]), 1000, "a system user")
            self.assertEqual(users[0][6], "/usr/sbin/nologin")


class TlsCredentialsTest(unittest.TestCase):

    def test_certificates_from_etc_refit_tls_as_credentials(self):
        unit = parse_unit(dt.read(UNIT))["Service"]
        loads = dict(v.split(":", 1) for v in unit.get("LoadCredential", []))
        self.assertEqual(loads, {"tls.crt": "/etc/refit/tls/tls.crt",
                                 "tls.key": "/etc/refit/tls/tls.key",
                                 "ca.crt": "/etc/refit/tls/ca.crt"})
        # Defaults that are not PEM: a host without certificates still starts (on loopback).
        sets = dict(v.split(":", 1) for v in unit.get("SetCredential", []))
        self.assertEqual(sets, {"tls.crt": "none", "tls.key": "none", "ca.crt": "none"})
        # The config names no TLS files, so refitd takes the credentials.
        config = dt.parse_toml(dt.read(SAMPLE_CONFIG), SAMPLE_CONFIG)
        for key in ("tls_cert", "tls_key", "tls_ca"):
            self.assertNotIn(key, config)


class SampleConfigTest(unittest.TestCase):

    def test_secure_by_default(self):
        # The conffile the .deb installs: every port on loopback, plaintext not allowed.
        config = dt.parse_toml(dt.read(SAMPLE_CONFIG), SAMPLE_CONFIG)
        for key in ("listen", "metrics_listen", "health_listen"):
            host, _ = dt.parse_host_port(config[key])
            self.assertEqual(host, "127.0.0.1", "%s: %s" % (SAMPLE_CONFIG, key))
        self.assertNotIn("allow_plaintext_peers", config)
        self.assertNotIn("0.0.0.0", "\n".join(
            l for l in dt.read(SAMPLE_CONFIG).splitlines() if not l.startswith("#")))

    def test_every_key_is_documented(self):
        text = dt.read(SAMPLE_CONFIG)
        config = dt.parse_toml(text, SAMPLE_CONFIG)
        dt.check_config_values(self, config, SAMPLE_CONFIG)
        for key, flag in dt.CONFIG_KEYS.items():
            set_line = re.search(r"^%s\s*=" % key, text, re.M)
            commented = re.search(r"^#\s*%s\s*=" % key, text, re.M)
            self.assertTrue(set_line or commented,
                            "%s: key %s is neither set nor shown commented out" % (
                                SAMPLE_CONFIG, key))
            self.assertTrue(re.search(r"Flags?: [^\n]*%s\b" % re.escape(flag), text),
                            "%s: say which flag %s is" % (SAMPLE_CONFIG, key))
        # `node = ""` would name the node "", so it is shown commented out.
        self.assertNotIn("node", config)
        self.assertEqual(config["socket"], dt.SOCKET_PATH)
        _, health_port = dt.parse_host_port(config["health_listen"])
        _, metrics_port = dt.parse_host_port(config["metrics_listen"])
        _, listen_port = dt.parse_host_port(config["listen"])
        self.assertEqual((listen_port, health_port, metrics_port),
                         (dt.PEER_PORT, dt.HEALTH_PORT, dt.METRICS_PORT))


if __name__ == "__main__":
    dt.main()
