#!/usr/bin/env bash
# Runs a Python test with Debian's /usr/bin/python3 (python3-grpcio, python3-torch) against the
# refitd that Bazel built: run_python_test.sh REFITD SCRIPT [ARGS...]. PYTHONPATH gets the
# refit package from the runfiles (sources plus the generated stubs).
set -euo pipefail
refitd="$1"
script="$2"
shift 2
REFITD="$(cd "$(dirname "$refitd")" && pwd)/$(basename "$refitd")"
export REFITD
export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 "$script" "$@"
