#!/usr/bin/env bash
# run.sh of the GPU bundle (scripts/gpu-bundle.sh copies this file in as DIR/run.sh): runs the
# GPU checks on a machine that has an NVIDIA driver and nothing else — no Bazel, no toolkit, no
# development libraries, no network. Everything it needs is in this directory.
#
#   OUT=DIR ./run.sh        results under $OUT (default ./gpu-out), at most 8 files:
#     summary.txt   written first, one line per step, the bench figures against their goals
#     machine.txt   date, host, glibc, nvidia-smi, the bundle's MANIFEST
#     kernels.log   cuda/gpu_kernels_test: every GPU kernel against its CPU twin, bit-exact
#     quantize.log  cuda/gpu_quantize_test: fp8 block quantization on the GPU against the CPU's,
#                   then daemon/store/quant_gpu_test: the store with GPU slots quantizing on the
#                   GPU, bit for bit what host slots get from the CPU kernel
#     runtime.log   cuda/cuda_runtime_test: IPC import, slots, copies, plans on the GPU, then
#                   daemon/store/sparse_gpu_test: the sparse Apply into GPU destinations (byte
#                   runs through the CUDA RunWriter), bit for bit the host destinations'
#     e2e.log       tests/gpu_e2e_test: two refitd with CUDA slots, a GPU source and destination
#     bench.txt     cuda/gpu_bench, daemon/store/sparse_apply_bench --destination=gpu (sparse vs
#                   full Apply into a GPU destination, 1 GiB, 0.4 % and 1 %, from host slots),
#                   then client/python/tests/bench_zero_copy.py --device=cuda
#                   (with REFIT_PYTHON's torch): the engine's update beside torch's D2D copy
#     engines.log   client/python/tests/test_torch_gpu.py with REFIT_PYTHON (default python3)
#                   when it has torch: torch's CUDA parameters as refit sources and
#                   destinations, bit for bit the CPU reference; then test_vllm_gpu.py when it
#                   also has vllm==0.33.0: vLLM's own models on the GPU receiving versions
#                   zero-copy through refit's CUDA path, bit for bit vLLM's load_weights
#
# Exit status: 0 when every step passed, 77 when no GPU is visible (nothing else was run), 1
# otherwise. Finishes within 9 minutes: each step has a time limit, and none starts past the
# overall budget (RUN_BUDGET_S, default 530 s). Benchmark goals missed are reported in
# summary.txt ("BELOW GOAL") but are not failures.
#
# REFIT_BUNDLE_DRY_RUN=1 runs every step even without a GPU (they then fail, and it exits 1):
# scripts/gpu/gpu-bundle-test.sh uses it to see every binary start from a copied bundle.
set -uo pipefail

B="$(cd "$(dirname "$0")" && pwd)"
started=$(date +%s)
budget=${RUN_BUDGET_S:-530}
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"
summary="$OUT/summary.txt"
echo "refit GPU bundle run, $(date -u +%FT%TZ), host $(hostname 2>/dev/null), $(nproc) cores" \
  >"$summary" || exit 1
note() { echo "$*" | tee -a "$summary"; }
failures=0

# The bundle's binaries find its libraries through lib/launch.sh; REFIT_BUNDLE_LOADER=1 runs
# them under the bundle's own glibc (for hosts whose glibc is older than the build machine's).
export REFIT_BUNDLE_LOADER=0
export UCX_MODULE_DIR="$B/lib/ucx"
# Only when the bundle carries data: tests given REFIT_SHARED_DIR fail without it (a bundle
# made without ../shared skips the real-data checks, saying so).
if [ -d "$B/shared/data/deltas" ]; then
  export REFIT_SHARED_DIR="$B/shared"
fi
# Two daemons on one host talk over loopback tcp; nothing here needs RDMA.
export UCX_TLS="${UCX_TLS:-tcp}"
cd "$B" || exit 1

# ---- the machine ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname 2>/dev/null) ($(nproc) cores), $(uname -srm)"
  echo "glibc: $(getconf GNU_LIBC_VERSION 2>/dev/null || echo unknown)"
  echo "bundle: $B"
  cat "$B/MANIFEST.txt" 2>/dev/null
  echo
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
    nvidia-smi
  else
    echo "no nvidia-smi on PATH"
  fi
} >"$OUT/machine.txt" 2>&1

# ---- can the bundle run here, and is there a GPU? refitd --version asks the CUDA runtime ----
if ! probe=$(timeout 30 daemon/refitd --version 2>&1); then
  # The host's glibc may be older than the build machine's: try the bundle's own.
  export REFIT_BUNDLE_LOADER=1
  if ! probe=$(timeout 30 daemon/refitd --version 2>&1); then
    note "FAILED  the bundle's refitd does not start on this machine:"
    echo "$probe" | head -n 20 | sed 's/^/    /' | tee -a "$summary"
    exit 1
  fi
  note "note    running under the bundle's glibc (this host's is older)"
fi
note "probe   $probe"
echo "probe: $probe (REFIT_BUNDLE_LOADER=$REFIT_BUNDLE_LOADER)" >>"$OUT/machine.txt"
if ! echo "$probe" | grep -Eq ', [1-9][0-9]* device\(s\)'; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [ "${REFIT_BUNDLE_DRY_RUN:-0}" != 1 ]; then
    note "no GPU visible (the CUDA runtime sees none; nvidia-smi lists ${gpus:-0}): nothing run, exit 77"
    exit 77
  fi
  note "no GPU visible; a dry run (REFIT_BUNDLE_DRY_RUN=1): every step runs, and fails"
fi
grep -E '^GPU ' "$OUT/machine.txt" | head -n 8 | sed 's/^/gpu     /' >>"$summary"

# step NAME LIMIT_S LOG COMMAND...: runs it with its output in LOG (capped at 8 MiB; appended
# when append=1, so two steps can share one of the 8 files), within LIMIT_S and the overall budget.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((budget - ($(date +%s) - started)))
  if [ "$left" -lt 20 ]; then
    note "FAILED  $name: not started, the 9-minute budget is spent"
    failures=$((failures + 1))
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc
  t0=$(date +%s)
  if [ "${append:-0}" = 1 ]; then
    timeout -k 5 "$limit" "$@" 2>&1 | head -c 8388608 >>"$log"
  else
    timeout -k 5 "$limit" "$@" 2>&1 | head -c 8388608 >"$log"
  fi
  rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    note "ok      $name (${took}s) $(grep -E '^(All tests passed|test cases:)' "$log" | tail -n 1)"
  else
    [ "$rc" -eq 124 ] && rc="timeout after ${limit}s"
    note "FAILED  $name (exit $rc after ${took}s; see $(basename "$log"))"
    grep -E '^(test cases:|assertions:)|FAILED|REQUIRE|CHECK' "$log" | head -n 20 |
      sed 's/^/    /' | tee -a "$summary"
    failures=$((failures + 1))
  fi
  return 0
}

catch_args=(--use-colour no --durations yes)
step kernels 160 "$OUT/kernels.log" cuda/gpu_kernels_test "${catch_args[@]}"
grep -E 'real-data checks|SKIPPING' "$OUT/kernels.log" | sort -u | sed 's/^ */        /' \
  >>"$summary"
step quantize 40 "$OUT/quantize.log" cuda/gpu_quantize_test "${catch_args[@]}"
append=1 step store-quantize 40 "$OUT/quantize.log" daemon/store/quant_gpu_test "${catch_args[@]}"
step runtime 100 "$OUT/runtime.log" cuda/cuda_runtime_test "${catch_args[@]}"
append=1 step store-sparse 40 "$OUT/runtime.log" daemon/store/sparse_gpu_test "${catch_args[@]}"
step e2e 100 "$OUT/e2e.log" tests/gpu_e2e_test "${catch_args[@]}"
step bench 100 "$OUT/bench.txt" cuda/gpu_bench --reps=5
append=1 step sparse-bench 90 "$OUT/bench.txt" daemon/store/sparse_apply_bench --destination=gpu \
  --mib=1024 --shares=0.004,0.01 --reps=3
# The Python client's CUDA paths (the bundle holds the client and the tests, not torch or vLLM):
# REFIT_PYTHON names a Python with torch for CUDA (default: python3, where it has torch).
#   torch-gpu  client/python/tests/test_torch_gpu.py: a torch trainer's CUDA parameters
#              registered in place, a vLLM-shaped torch engine's CUDA parameters as
#              destinations (refit.vllm's adapter; the vllm package is not needed)
#   engines    client/python/tests/test_vllm_gpu.py: vLLM 0.33's own models (needs vllm)
# Both go into engines.log (the 8-file limit). Each fails, never skips, without a GPU.
python=${REFIT_PYTHON:-python3}
python_env=(env REFITD="$B/daemon/refitd" PYTHONUNBUFFERED=1
  PYTHONPATH="$B/client/python:$B/client/python/tests" "$python")
: >"$OUT/engines.log"
if "$python" -c 'import torch, grpc, google.protobuf' >/dev/null 2>&1; then
  append=1 step torch-gpu 150 "$OUT/engines.log" "${python_env[@]}" \
    "$B/client/python/tests/test_torch_gpu.py" -v
  grep -E '^(Ran|OK|FAILED)|^torch-gpu:' "$OUT/engines.log" | sed 's/^/        /' >>"$summary"
  # The engine's update on the GPU, zero copy and load_weights, beside torch's own D2D copy of
  # the same bytes (client/python/tests/bench_zero_copy.py --device=cuda), into bench.txt.
  append=1 step engine-bench 150 "$OUT/bench.txt" "${python_env[@]}" \
    "$B/client/python/tests/bench_zero_copy.py" --device=cuda --mib=1024 --reps=3
  append=1 step engine-bench-gpu-slots 150 "$OUT/bench.txt" "${python_env[@]}" \
    "$B/client/python/tests/bench_zero_copy.py" --device=cuda --mib=1024 --reps=3 \
    --daemon-arg=--slot-memory=cuda
  # Two refitd on this host as the trainer's and the engine's node (UCX over loopback, UCX_TLS
  # as above): each version is also pulled.
  append=1 step engine-bench-two-nodes 150 "$OUT/bench.txt" "${python_env[@]}" \
    "$B/client/python/tests/bench_zero_copy.py" --device=cuda --mib=1024 --reps=3 --nodes=2
  append=1 step engine-bench-two-nodes-gpu-slots 150 "$OUT/bench.txt" "${python_env[@]}" \
    "$B/client/python/tests/bench_zero_copy.py" --device=cuda --mib=1024 --reps=3 --nodes=2 \
    --daemon-arg=--slot-memory=cuda
  grep -E '^[0-9]+ MiB bf16|^  (torch D2D|publish|pull|update)' "$OUT/bench.txt" |
    sed 's/^ */figure  engine update: /' >>"$summary"
  if "$python" -c 'import vllm' >/dev/null 2>&1; then
    append=1 step engines 200 "$OUT/engines.log" "${python_env[@]}" \
      "$B/client/python/tests/test_vllm_gpu.py" -v
    grep -E '^(Ran|OK|FAILED)' "$OUT/engines.log" | tail -n 1 | sed 's/^/        /' >>"$summary"
  else
    note "NOT RUN engines: $python has no vllm; set REFIT_PYTHON to a Python with torch and" \
      "vllm==0.33.0 (CUDA) for the vLLM CUDA zero-copy check (client/python/tests/test_vllm_gpu.py)"
  fi
else
  note "NOT RUN torch-gpu, engines: $python lacks torch, grpcio or protobuf; set REFIT_PYTHON" \
    "to a Python with them (and vllm==0.33.0 for engines)"
fi

# ---- the figures against the issue's goals ----
# goal WHAT PATTERN MIN: the "= N.NNx" of the bench line matching PATTERN, against MIN.
goal() {
  local what=$1 pattern=$2 min=$3 ratio
  ratio=$(grep -E "$pattern" "$OUT/bench.txt" 2>/dev/null | head -n 1 | sed -n 's/.*= *\([0-9.]*\)x.*/\1/p')
  if [ -z "$ratio" ]; then
    note "figure  $what: not measured"
  elif awk -v r="$ratio" -v m="$min" 'BEGIN { exit !(r >= m) }'; then
    note "figure  $what: ${ratio}x (goal >= ${min}x, met)"
  else
    note "figure  $what: ${ratio}x (goal >= ${min}x, BELOW GOAL)"
  fi
}
goal "snapshot into a GPU slot / cudaMemcpy D2D" 'ipc -> GPU slot' 0.8
goal "change detection at 0.4% / device read+write" 'FindChanges 0.4% changed' 0.5
goal "change detection at 3% / device read+write" 'FindChanges 3.0% changed' 0.5
grep -E '^  OpenIpc|^  close' "$OUT/bench.txt" 2>/dev/null | sed 's/^ */figure  IPC import: /' \
  >>"$summary"

note "done in $(($(date +%s) - started))s: $failures step(s) failed; files in $OUT"
[ "$failures" -eq 0 ] && exit 0
exit 1
