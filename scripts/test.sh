#!/usr/bin/env bash
# Runs every refit test: installs what is missing (Debian 12, as root), makes the Python test
# environment (scripts/install/install-python-env.sh: a pinned venv outside the checkout, once per set of
# pins), the source checks (doc links, clang-format, clang's lock analysis), then
# `bazel test //...` (Python tests in that venv), then scripts/ship/test-packages.sh (the .deb, the
# image and the pip package installed and checked).
# Usage: scripts/test.sh [extra bazel test arguments]
#   REFIT_TEST_GPU_BUNDLE=1   then also scripts/gpu/gpu-bundle-test.sh: builds the GPU bundle with
#                             the CUDA toolkit (a few minutes more) and checks a copy of it
#                             outside the checkout (run.sh exits 77 without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."

# Real weight versions for the delta tests live in ../shared/data/deltas next to the checkout
# (REFIT_SHARED_DIR overrides). They are required here: a run without them fails now, and the
# tests, given REFIT_SHARED_DIR, fail rather than skip when they cannot read the data.
shared_dir="${REFIT_SHARED_DIR:-$(cd .. && pwd)/shared}"
if [ ! -d "$shared_dir/data/deltas" ]; then
  echo "tests: $shared_dir/data/deltas is missing (the real bf16 versions the delta, bucket and" \
    "kernel tests read; set REFIT_SHARED_DIR to where data/deltas is)" >&2
  exit 1
fi
shared_dir="$(cd "$shared_dir" && pwd)"  # absolute: the tests run elsewhere

./scripts/install/install-deps.sh
# The Python test environment (torch 2.x, transformers, ...: client/python/requirements-test.txt)
# in a venv outside the checkout, made once per set of pins (a cold install: about 3 minutes).
# (Its output is printed once it is done, not through tee /dev/stderr: reopening a stderr that
# is a file would write over the start of the log.)
python_env_out="$(./scripts/install/install-python-env.sh)"
echo "$python_env_out"
python_env="$(tail -n 1 <<< "$python_env_out")"

# Every link in README.md and docs/ resolves inside the repository (a second or so).
./scripts/check/check-doc-links.sh
# Source checks (docs/building.md, "Checks beyond the compiler"); a failure fails the run after
# the tests have run too, so one CI run reports everything.
checks_rc=0
./scripts/check/check-format.sh || checks_rc=1
./scripts/check/check-thread-safety.sh || checks_rc=1

test_env=(--test_env=REFIT_PYTHON="$python_env" --test_env=REFIT_SHARED_DIR="$shared_dir")

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
bazel test "${test_env[@]}" "$@" //... 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
passed=$(grep -cE '^//.* PASSED( in|$)| \(cached\) PASSED' "$log" || true)
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|FAILED TO BUILD|NO STATUS|INCOMPLETE)' "$log" || true)
echo "tests: ${passed} passed, ${failed} failed"

# What an operator installs, built and installed as they would: the .deb, the container image,
# the pip package (root; about 1.5 minutes; it installs and purges the package refit here).
packages_rc=0
./scripts/ship/test-packages.sh || packages_rc=$?
if [ "$packages_rc" -ne 0 ]; then
  echo "tests: scripts/ship/test-packages.sh FAILED"
fi
if [ "${REFIT_TEST_GPU_BUNDLE:-0}" = 1 ]; then
  ./scripts/gpu/gpu-bundle-test.sh || rc=1
fi
if [ "$checks_rc" -ne 0 ]; then
  echo "tests: a source check FAILED (check-format.sh or check-thread-safety.sh, above)"
  rc=1
fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$packages_rc"
