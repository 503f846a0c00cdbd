#!/usr/bin/env bash
# Generates the gRPC stubs of proto/refit/v1/refit.proto into client/python/refit/v1/ (which is
# gitignored), for running the Python client from a checkout:
#
#   client/python/generate.sh && PYTHONPATH=client/python python3 examples/trainer.py
#
# Needs protoc and Debian's grpc_python_plugin (packages protobuf-compiler and
# protobuf-compiler-grpc). Bazel builds the same files with //client/python:refit_py_stubs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
protoc="${PROTOC:-protoc}"
plugin="${GRPC_PYTHON_PLUGIN:-/usr/bin/grpc_python_plugin}"

if [ ! -x "$plugin" ]; then
  echo "generate.sh: $plugin not found (install protobuf-compiler-grpc)" >&2
  exit 1
fi

out="$here/refit/v1"
mkdir -p "$out"
# -I proto: the modules become refit/v1/refit_pb2.py, imported as `from refit.v1 import ...`.
"$protoc" -I "$root/proto" \
  --python_out="$here" \
  --plugin=protoc-gen-grpc_python="$plugin" --grpc_python_out="$here" \
  "$root/proto/refit/v1/refit.proto"
echo '"""Generated gRPC stubs of refit.v1 (client/python/generate.sh)."""' > "$out/__init__.py"
echo "generate.sh: wrote $out/{__init__,refit_pb2,refit_pb2_grpc}.py"
