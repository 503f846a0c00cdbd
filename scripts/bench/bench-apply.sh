#!/usr/bin/env bash
# The install benchmark (issue 32): two refitd on temporary sockets act as the trainer's node and
# the engine's node (UCX shared memory + tcp between them, --state-dir on the engine's node so
# the undo journal is the one a deployment has), and tests/bench:apply_bench runs sparse Apply
# beside full Apply and memcpy of the model, in the same run, for each step kind:
#   --density list (default "0.004 0.01"): the demo's RL-like steps (that fraction of the bf16
#     elements moves by one unit in the last place);
#   the real successive versions of ../shared/data/deltas/tiny-llama-lr1e-6 (0.41-0.47 % changed
#     per step), tiled over the model's bytes.
#   --fp8: the engine's buffers FP8_E4M3 with [128, 128] block scales (quantized on its node):
#     sparse fp8 Apply beside full fp8 Apply beside memcpy of the fp8 bytes, per step kind.
#   --plain-too: each step kind again with the engine's Apply plain (REFIT_TEST_APPLY_UNVERIFIED:
#     the full Apply an unchecked streaming copy, its undo saved in a pass first; the sparse Apply
#     without comparing what it wrote), and the verified full and sparse Applies' speed against
#     the plain ones (each run's time over its own memcpy; refitd CPU seconds).
#   --generate-ms N (default 1000): the engine generates N ms between a version's completion and
#     its Apply, as an RL engine does; its refitd prepares the sparse Apply meanwhile (0: the
#     Apply comes at once and waits for that collection).
# Usage: scripts/bench/bench-apply.sh [--mib 1024] [--versions 6] [--density "0.004 0.01"] [--no-build]
#        [--plain-too] [--fp8] [--generate-ms 1000]
set -euo pipefail
cd "$(dirname "$0")/../.."
mib=1024
versions=6
densities="0.004 0.01"
build=1
plain_too=0
fp8_args=()
generate_ms=1000
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) mib="$2"; shift 2 ;;
    --versions) versions="$2"; shift 2 ;;
    --density) densities="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --plain-too) plain_too=1; shift ;;
    --fp8) fp8_args=(--fp8); shift ;;
    --generate-ms) generate_ms="$2"; shift 2 ;;
    *) echo "bench-apply: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$build" = 1 ]; then
  bazel build //daemon:refitd //daemon:refitd_testing //client:refitctl //tests/bench:apply_bench
fi
bin="$(bazel info bazel-bin 2>/dev/null)"
work=$(mktemp -d /tmp/refit-apply-bench-XXXXXX)
pids=()
. scripts/bench/lib/daemons.sh  # (from the repository root)
trap bench_cleanup EXIT
export UCX_TLS=sm,tcp UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
run() {
  local tag="$1"
  shift
  "$bin/daemon/refitd" --socket="$work/$tag-t.sock" --listen=127.0.0.1:0 --node=trainer-node --retain=1 \
    >"$work/$tag-t.log" 2>&1 &
  local trainer=$!
  pids+=("$trainer")
  bench_wait_healthy "$bin/client/refitctl" "$work/$tag-t.sock" "$work/$tag-t.log" || exit 1
  local port
  port=$("$bin/client/refitctl" --socket="$work/$tag-t.sock" status --json |
         /usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("listen_port") or d.get("listenPort"))')
  # The test build of refitd on the engine's node, with REFIT_TEST_SPARSE_ALWAYS: the sparse path
  # is measured even where refitd's cost model would pick the full copy (it does at these
  # densities here: see docs/benchmarks.md).
  local plain_env=()
  if [ "${plain:-0}" = 1 ]; then plain_env=(REFIT_TEST_APPLY_UNVERIFIED=1); fi
  env REFIT_TEST_SPARSE_ALWAYS=1 "${plain_env[@]}" "$bin/daemon/refitd_testing" --socket="$work/$tag-e.sock" \
    --listen=127.0.0.1:0 --node=engine-node \
    --peers="127.0.0.1:$port" --state-dir="$work/$tag-state" >"$work/$tag-e.log" 2>&1 &
  local engine=$!
  pids+=("$engine")
  bench_wait_healthy "$bin/client/refitctl" "$work/$tag-e.sock" "$work/$tag-e.log" || exit 1
  "$bin/tests/bench/apply_bench" --trainer-socket="$work/$tag-t.sock" \
    --engine-socket="$work/$tag-e.sock" --engine-pid="$engine" --mib="$mib" --generate-ms="$generate_ms" \
    ${fp8_args[@]+"${fp8_args[@]}"} "$@" |
    tee "$work/$tag.out"
  kill -TERM "$trainer" "$engine"
  wait "$trainer" "$engine" 2>/dev/null || true
  pids=()
}
echo "bench-apply: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for d in $densities; do
  echo
  echo "== RL-like steps, $d of the elements changed per version"
  run "d$d" --versions="$versions" --density="$d"
  if [ "$plain_too" = 1 ]; then
    echo "-- the same, the engine's full Apply plain (REFIT_TEST_APPLY_UNVERIFIED)"
    plain=1 run "p$d" --versions="$versions" --density="$d"
    /usr/bin/python3 - "$work/d$d.out" "$work/p$d.out" <<'PY'
import re, sys
def figures(path, kind):
    text = open(path).read()
    ratio = float(re.search(kind + r"_over_memcpy=([0-9.]+)", text).group(1))
    cpu = re.search(r"refitd CPU seconds +sparse ([0-9.]+), full ([0-9.]+)", text)
    return ratio, float(cpu.group(2 if kind == "full" else 1)) if cpu else None
for kind in ("full", "sparse"):
    (v, vc), (p, pc) = figures(sys.argv[1], kind), figures(sys.argv[2], kind)
    line = (f"verified {kind} Apply / plain {kind} Apply: {p / v:.2f}x the speed (time over "
            f"each run's memcpy: {v:.3f}x verified, {p:.3f}x plain)")
    if vc and pc:
        line += f"; refitd CPU s {vc:.3f} verified, {pc:.3f} plain: {pc / vc:.2f}x"
    print(line)
PY
  fi
done
real=../shared/data/deltas/tiny-llama-lr1e-6
if [ -d "$real" ]; then
  echo
  echo "== real versions of $real, tiled over the model"
  run real --real="$real"
fi
