"""Shared helpers for the deploy/ tests: paths, the config keys refitd knows, loaders.

The tests run under Bazel (sh_test -> /usr/bin/python3, working directory = the runfiles
root of the workspace) or directly from a checkout (python3 deploy/tests/<test>.py), so
paths are resolved against the workspace root either way.
"""

import os
import re
import subprocess
import sys
import tomllib
import unittest

import yaml

# The keys of refitd.toml and their flags and types, from refitd's option table
# (daemon/config/option_table.cc) through //daemon/config:options_doc --keys, a data dependency
# of the tests that import this module.
def _options_doc():
    if os.environ.get("REFIT_OPTIONS_DOC"):
        return os.environ["REFIT_OPTIONS_DOC"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in ("daemon/config/options_doc", "bazel-bin/daemon/config/options_doc"):
        if os.path.exists(os.path.join(root, path)):
            return os.path.join(root, path)
    raise RuntimeError("no options_doc: bazel build //daemon/config:options_doc")


def _load_options():
    out = subprocess.run([_options_doc(), "--keys"], check=True, capture_output=True, text=True)
    keys, types = {}, {}
    for line in out.stdout.splitlines():
        key, flag, kind = line.split()
        keys[key], types[key] = flag, kind
    return keys, types


CONFIG_KEYS, CONFIG_TYPES = _load_options()
FLAG_TO_KEY = {flag: key for key, flag in CONFIG_KEYS.items()}
LOG_LEVELS = {"trace", "debug", "info", "warn", "error"}

# Ports the deployment uses (docs/deploy.md).
PEER_PORT = 7070
HEALTH_PORT = 7071
METRICS_PORT = 9464

DAEMON_BINARY = "/usr/bin/refitd"
CONFIG_PATH = "/etc/refit/refitd.toml"
SOCKET_PATH = "/run/refit/refitd.sock"


def workspace_root():
    """The directory holding deploy/: the runfiles root under Bazel, else the checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = []
    srcdir, workspace = os.environ.get("TEST_SRCDIR"), os.environ.get("TEST_WORKSPACE")
    if srcdir and workspace:
        candidates.append(os.path.join(srcdir, workspace))
    candidates += [os.getcwd(), os.path.dirname(os.path.dirname(here))]
    for c in candidates:
        if os.path.isdir(os.path.join(c, "deploy", "k8s")):
            return c
    raise RuntimeError("cannot find deploy/ (looked in %s)" % ", ".join(candidates))


def version():
    """The VERSION file at the workspace root (the image tag; scripts/ship/version.sh)."""
    with open(os.path.join(workspace_root(), "VERSION"), encoding="utf-8") as f:
        return f.read().strip()


# The image the manifests run: scripts/ship/build-image.sh builds it, tagged with VERSION.
IMAGE = "refit/refitd:" + version()


ROOT = workspace_root()


def path(*parts):
    return os.path.join(ROOT, *parts)


def read(*parts):
    with open(path(*parts), encoding="utf-8") as f:
        return f.read()


def load_yaml_documents(relpath):
    """Every non-empty document of a YAML file."""
    with open(path(relpath), encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def k8s_manifest_files(subdir="deploy/k8s", recursive=True):
    out = []
    for dirpath, dirnames, filenames in os.walk(path(subdir)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".yaml", ".yml")):
                out.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
        if not recursive:
            break
    return out


def parse_host_port(value):
    """"HOST:PORT" or "[V6]:PORT" -> (host, port)."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", value)
    if not m:
        raise ValueError("not HOST:PORT: %r" % value)
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 < port < 65536:
        raise ValueError("port out of range in %r" % value)
    return host, port


def check_config_values(test, config, origin):
    """Asserts each key of a parsed refitd.toml is known and has the TOML type refitd accepts
    (refitd itself checks ranges: refitd_config_smoke_test starts it with each config)."""
    for key, value in config.items():
        test.assertIn(key, CONFIG_KEYS, "%s: unknown key %r" % (origin, key))
        kind = CONFIG_TYPES[key]
        what = "%s: %s=%r" % (origin, key, value)
        if key == "peers":
            if isinstance(value, str):
                value = [p for p in value.split(",") if p.strip()]
            test.assertIsInstance(value, list, what)
            for p in value:
                test.assertIsInstance(p, str, "%s: peers entry %r" % (origin, p))
                parse_host_port(p.strip())
        elif kind in ("integer", "size"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            test.assertTrue(ok or (kind == "size" and isinstance(value, str)), what)
        elif kind == "number":
            test.assertTrue(isinstance(value, (int, float)) and not isinstance(value, bool), what)
        elif kind == "bool":
            test.assertIsInstance(value, bool, what)
        elif kind == "ids":
            test.assertIsInstance(value, list, what)
            for v in value:
                test.assertTrue(isinstance(v, int) and not isinstance(v, bool) and v >= 0, what)
        else:
            test.assertIsInstance(value, str, what)
            if key == "log_level":
                test.assertIn(value, LOG_LEVELS, what)
            if key in ("listen", "metrics_listen", "health_listen") and value:
                parse_host_port(value)
            if key == "socket":
                test.assertTrue(value.startswith("/"), "%s: socket must be absolute" % origin)


def parse_toml(text, origin):
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise AssertionError("%s: not valid TOML: %s" % (origin, e)) from e


def require_env(name):
    """True when the environment asks for checks that would otherwise be skipped to fail."""
    return os.environ.get(name, "") not in ("", "0")


def skip_or_fail(test, reason, env="REFIT_REQUIRE_SYSTEMD"):
    """Skips loudly (a line on stderr and unittest's 'skipped'), or fails if $env is set."""
    if require_env(env):
        test.fail("%s (and %s is set, so this is a failure)" % (reason, env))
    sys.stderr.write("SKIP: %s: %s\n" % (test.id(), reason))
    test.skipTest(reason)


def main():
    result = unittest.main(verbosity=2, exit=False).result
    skipped = len(result.skipped)
    if skipped:
        sys.stderr.write("NOTE: %d check(s) SKIPPED, see the SKIP lines above\n" % skipped)
    sys.exit(0 if result.wasSuccessful() else 1)
