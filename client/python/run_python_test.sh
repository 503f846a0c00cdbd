#!/usr/bin/env bash
# Runs a Python test against the refitd that Bazel built: run_python_test.sh REFITD SCRIPT
# [ARGS...], or run_python_test.sh --sglang REFITD SCRIPT [ARGS...] for the SGLang engine tests
# (the interpreter of the SGLang overlay that scripts/install/install-python-env.sh layers over the
# test environment: venv-sglang-<hash> beside it, or $REFIT_SGLANG_PYTHON). The interpreter is the test environment's (torch 2.x, transformers, ...: see
# client/python/requirements-test.txt): $REFIT_PYTHON, which scripts/test.sh passes with
# --test_env (.bazelrc passes it through from the caller's environment too), else the newest
# environment scripts/install/install-python-env.sh made (/var/cache/refit-python/venv-current, or
# ~/.cache/refit-python/venv-current). No environment is a failure, never a skip. PYTHONPATH
# gets the refit package from the runfiles (sources plus the generated stubs).
set -euo pipefail
sglang=0
if [ "$1" = "--sglang" ]; then
  sglang=1
  shift
fi
refitd="$1"
script="$2"
shift 2
python="${REFIT_PYTHON:-}"
if [ -z "$python" ]; then
  for base in /var/cache/refit-python "${HOME:-/root}/.cache/refit-python"; do
    if [ -x "$base/venv-current/bin/python" ]; then
      python="$base/venv-current/bin/python"
      break
    fi
  done
fi
if [ -z "$python" ] || [ ! -x "$python" ]; then
  if [ -n "$python" ]; then
    why="REFIT_PYTHON=$python is not an executable"
  else
    why="REFIT_PYTHON is not set and there is no /var/cache/refit-python/venv-current"
  fi
  echo "run_python_test.sh: FAILED: no Python test environment ($why): run" \
    "scripts/install/install-python-env.sh, then bazel test --test_env=REFIT_PYTHON=<the path it" \
    "prints> (scripts/test.sh does both)" >&2
  exit 1
fi
if [ "$sglang" = 1 ]; then
  # The overlay made from the same pins as $python's venv (requirements files in the runfiles).
  here="$PWD/client/python"
  venvs="$(dirname "$(readlink -f "$(dirname "$(dirname "$python")")")")"
  hash="$(cat "$here/requirements-test.txt" "$here/requirements-sglang.txt" | sha256sum |
    cut -c1-16)"
  python="${REFIT_SGLANG_PYTHON:-$venvs/venv-sglang-$hash/bin/python}"
  if [ ! -x "$python" ] || [ ! -f "$(dirname "$(dirname "$python")")/.refit-complete" ]; then
    echo "run_python_test.sh: FAILED: no SGLang overlay environment at $python: run" \
      "scripts/install/install-python-env.sh (it makes it beside the test environment)" >&2
    exit 1
  fi
fi
REFITD="$(cd "$(dirname "$refitd")" && pwd)/$(basename "$refitd")"
export REFITD
export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "$python" "$script" "$@"
