"""Build of the refit Python client (pyproject.toml holds the metadata). Two things need code:

* the version: the top-level VERSION, as PEP 440 (scripts/ship/version.sh --python: 0.2.0, or
  0.2.0+dirty from a git tree with uncommitted changes), also written to refit/_version.py;
* the gRPC stubs refit/v1/refit_pb2{,_grpc}.py, generated into the build from
  proto/refit/v1/refit.proto with protoc and grpc_python_plugin (Debian: protobuf-compiler,
  protobuf-compiler-grpc), as client/python/generate.sh does for a checkout.

Both read files of the refit checkout around client/python, so build from it:
`pip install ./client/python` (pip builds a local directory in place).
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROTO_ROOT = os.path.join(ROOT, "proto")
PROTO = os.path.join(PROTO_ROOT, "refit", "v1", "refit.proto")
VERSION_SCRIPT = os.path.join(ROOT, "scripts", "ship", "version.sh")


def fail(message):
    raise SystemExit("refit setup.py: " + message)


def checkout_file(path):
    if not os.path.isfile(path):
        fail(f"{path} is missing: build from a refit checkout (pip install ./client/python)")
    return path


def version():
    out = subprocess.run(["bash", checkout_file(VERSION_SCRIPT), "--python"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        fail(f"scripts/ship/version.sh failed: {out.stderr.strip()}")
    return out.stdout.strip()


def tool(env, name, debian_package):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        fail(f"'{name}' not found (set ${env}, or install the Debian package {debian_package})")
    return path


class BuildPyWithStubs(build_py):
    """build_py, then the generated modules next to the copied package in build_lib."""

    def run(self):
        # pip builds in place and setuptools reuses build/lib: start from an empty package, so
        # a module removed from refit/ leaves no stale copy in the wheel.
        shutil.rmtree(os.path.join(self.build_lib, "refit"), ignore_errors=True)
        super().run()
        protoc = tool("PROTOC", "protoc", "protobuf-compiler")
        plugin = tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin", "protobuf-compiler-grpc")
        # -I proto: the modules become refit/v1/refit_pb2.py, imported as refit.v1.refit_pb2.
        subprocess.run([protoc, "-I", PROTO_ROOT, f"--python_out={self.build_lib}",
                        f"--plugin=protoc-gen-grpc_python={plugin}",
                        f"--grpc_python_out={self.build_lib}", checkout_file(PROTO)], check=True)
        package = os.path.join(self.build_lib, "refit")
        with open(os.path.join(package, "v1", "__init__.py"), "w", encoding="utf-8") as f:
            f.write('"""Generated gRPC stubs of refit.v1, from proto/refit/v1/refit.proto."""\n')
        with open(os.path.join(package, "_version.py"), "w", encoding="utf-8") as f:
            f.write(f'"""The version this package was built as."""\n__version__ = "{VERSION}"\n')


VERSION = version()
setup(version=VERSION, cmdclass={"build_py": BuildPyWithStubs})
