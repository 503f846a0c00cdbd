#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with an NVIDIA GPU and the CUDA toolkit
# ($CUDA_PATH, else /usr/local/cuda): builds everything with --config=cuda (the GPU targets
# too), runs the GPU tests and //cuda's other tests, runs the GPU benchmark, and writes logs and
# figures under $OUT (default ./gpu-out). Exits non-zero if anything failed. Takes a few
# minutes on a 16-core machine with a cold Bazel cache.
#
# Usage: scripts/gpu-check.sh
#   OUT=DIR                    where logs and figures go (default ./gpu-out)
#   GPU_CHECK_FULL=1           also run every test (bazel test --config=cuda //...)
#   GPU_CHECK_OUTPUT_BASE=DIR  a Bazel output base of its own
#   GPU_CHECK_BENCH_ARGS=...   arguments for gpu_bench (default --reps=5)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
summary="$OUT/summary.txt"
: >"$summary"
failures=0
started=$(date +%s)

note() { echo "gpu-check: $*" | tee -a "$summary"; }
# step NAME TIMEOUT_S COMMAND...: runs it with its output in $OUT/logs/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  local took=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    note "ok      $name (${took}s)"
  else
    note "FAILED  $name (exit $rc after ${took}s; see logs/$name.log)"
    tail -n 30 "$OUT/logs/$name.log" | sed 's/^/    /'
    failures=$((failures + 1))
  fi
  return "$rc"
}

# ---- the machine ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname) ($(nproc) cores)"
  command -v nvidia-smi >/dev/null && nvidia-smi
  "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc" --version
} >"$OUT/logs/machine.log" 2>&1
grep -E "NVIDIA-SMI|release|H200|H100|A100" "$OUT/logs/machine.log" | head -n 5 >>"$summary"
if ! nvidia-smi -L >/dev/null 2>&1; then
  note "no GPU visible (nvidia-smi -L fails): the build runs, the GPU tests and bench will fail"
fi

# Build tools and libraries: install what is missing only where something is missing (the
# machine may be offline, so a failed install is reported, not fatal).
if ! command -v bazel >/dev/null || ! pkg-config --exists grpc++ ucx spdlog 2>/dev/null; then
  note "some build dependencies are missing; trying scripts/install-deps.sh"
  step install-deps 300 ./scripts/install-deps.sh || true
fi
if ! command -v bazel >/dev/null; then
  note "FAILED: no bazel on this machine; nothing can be built"
  exit 1
fi
nvcc="${CUDA_PATH:-/usr/local/cuda}/bin/nvcc"
if [ ! -x "$nvcc" ]; then
  note "FAILED: no nvcc at $nvcc (set CUDA_PATH); --config=cuda can't build"
  exit 1
fi

bazel_cmd=(bazel)
[ -n "${GPU_CHECK_OUTPUT_BASE:-}" ] && bazel_cmd+=("--output_base=$GPU_CHECK_OUTPUT_BASE")

# The shared real-data directory for the delta/kernel tests, where this copy has one.
test_env=()
for dir in "${REFIT_SHARED_DIR:-}" ../shared ./shared; do
  if [ -n "$dir" ] && [ -d "$dir/data/deltas" ]; then
    test_env=(--test_env=REFIT_SHARED_DIR="$(cd "$dir" && pwd)")
    break
  fi
done
[ "${#test_env[@]}" -eq 0 ] && note "no shared/data/deltas here: real-data checks will be skipped"

# ---- build: everything with CUDA, plus the manual GPU targets ----
gpu_targets=$("${bazel_cmd[@]}" query 'attr("tags", "\bgpu\b", //...)' 2>"$OUT/logs/query.log" |
  tr '\n' ' ')
echo "gpu targets: $gpu_targets" >>"$OUT/logs/query.log"
# shellcheck disable=SC2086
step build 420 "${bazel_cmd[@]}" build --config=cuda --experimental_convenience_symlinks=ignore \
  //... $gpu_targets
built=$?

# ---- tests ----
if [ "$built" -eq 0 ]; then
  tests=(//cuda/... //cuda:gpu_kernels_test //cuda:gpu_quantize_test //cuda:cuda_runtime_test)
  [ "${GPU_CHECK_FULL:-0}" = 1 ] && tests=(//... //cuda:gpu_kernels_test //cuda:gpu_quantize_test //cuda:cuda_runtime_test)
  step test 420 "${bazel_cmd[@]}" test --config=cuda --experimental_convenience_symlinks=ignore \
    --test_output=errors "${test_env[@]}" "${tests[@]}"
  testlogs=$("${bazel_cmd[@]}" info --config=cuda bazel-testlogs 2>/dev/null)
  for log in "$testlogs"/cuda/*/test.log; do
    [ -f "$log" ] && cp "$log" "$OUT/logs/$(basename "$(dirname "$log")").test.log"
  done
  grep -E '^//.* (PASSED|FAILED|TIMEOUT|NO STATUS|FLAKY)' "$OUT/logs/test.log" | sed 's/^/  /' \
    >>"$summary"

  # ---- benchmark: run from bazel-bin, ipc_exporter beside it ----
  bin=$("${bazel_cmd[@]}" info --config=cuda bazel-bin 2>/dev/null)
  # shellcheck disable=SC2086
  step bench 240 "$bin/cuda/gpu_bench" ${GPU_CHECK_BENCH_ARGS:---reps=5}
  cp "$OUT/logs/bench.log" "$OUT/bench.txt" 2>/dev/null
  sed 's/^/  /' "$OUT/bench.txt" >>"$summary" 2>/dev/null
fi

note "done in $(($(date +%s) - started))s with $failures failed step(s); logs in $OUT"
[ "$failures" -eq 0 ]
