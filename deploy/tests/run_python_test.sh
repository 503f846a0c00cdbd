#!/usr/bin/env bash
# Runs a Python 3 test with the system interpreter (Debian's python3, python3-yaml; Python
# >= 3.11 for tomllib). A Bazel py_test would need a Python toolchain this offline build
# does not have. Usage: run_python_test.sh TEST.py [ARGS...]
set -euo pipefail
PYTHON=/usr/bin/python3
if ! "$PYTHON" -c 'import sys, tomllib, yaml; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "run_python_test.sh: needs $PYTHON >= 3.11 with the yaml module (apt-get install python3-yaml)" >&2
  exit 1
fi
# -B: write no .pyc files into the runfiles tree.
exec "$PYTHON" -B "$@"
