#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU, the CUDA toolkit ($CUDA_PATH, else
# /usr/local/cuda) and Bazel: builds the GPU bundle (scripts/gpu-bundle.sh) and runs its run.sh,
# the same checks a GPU machine without any of those runs from a copied bundle. Results go
# under $OUT (default ./gpu-out): run.sh's files (summary.txt first) and bundle-build.log.
# Exits as run.sh does: 0 all passed, 77 no GPU visible, 1 otherwise (a failed build too).
#
# Usage: scripts/gpu/gpu-check.sh
#   OUT=DIR                where the results go (default ./gpu-out)
#   GPU_CHECK_BUNDLE=DIR   where the bundle is built (default a fresh directory under /tmp)
#   GPU_CHECK_FULL=1       then also every test with the CUDA build (bazel test --config=cuda
#                          //...), its log in $OUT/full-test.log
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"
bundle="${GPU_CHECK_BUNDLE:-$(mktemp -d /tmp/refit-gpu-bundle.XXXXXX)}"

if ! scripts/gpu-bundle.sh "$bundle" >"$OUT/bundle-build.log" 2>&1; then
  echo "gpu-check: building the bundle failed; see $OUT/bundle-build.log" >&2
  tail -n 20 "$OUT/bundle-build.log" >&2
  exit 1
fi
tail -n 2 "$OUT/bundle-build.log"
OUT="$OUT" "$bundle/run.sh"
rc=$?
if [ "$rc" -ne 77 ] && [ "${GPU_CHECK_FULL:-0}" = 1 ]; then
  if ! bazel test --config=cuda --experimental_convenience_symlinks=ignore //... \
    >"$OUT/full-test.log" 2>&1; then
    echo "gpu-check: bazel test --config=cuda //... failed; see $OUT/full-test.log" >&2
    rc=1
  fi
  tail -n 3 "$OUT/full-test.log"
fi
exit "$rc"
