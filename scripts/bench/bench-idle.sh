#!/usr/bin/env bash
# What an idle pair of refitd costs: two daemons on temporary sockets, the trainer's node and
# the engine's node (--peers=<the trainer's>), with one small model registered on each and one
# version pulled, then --seconds of nothing. tests/bench:idle_bench prints each daemon's share of
# one core over that window (utime + stime from /proc/PID/stat), beside its own sleeping
# process as the floor. Goal: < 0.5 % of a core each (docs/benchmarks.md, "Idle").
#
# Usage: scripts/bench/bench-idle.sh [--seconds 60] [--tls "tcp sm,tcp+eh"] [--bin DIR]... [--no-build]
#                             [--mib 4]
#   --mib N     the model's size; 0 registers nothing (only the connected peers).
#   --bin DIR   a bazel-bin directory holding daemon/refitd, client/refitctl and
#               tests/bench/idle_bench (default: this checkout's, built first). Given twice or
#               more, the builds run in turn for each UCX_TLS (a before/after in one session).
#   --tls       UCX_TLS values, one run each; "+eh" turns on shared-memory peer-failure
#               handling (UCX_POSIX_ERROR_HANDLING / UCX_SYSV_ERROR_HANDLING) as in
#               scripts/bench/bench-two-node.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=60
mib=4
tls_list="tcp"
bins=()
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --tls) tls_list="$2"; shift 2 ;;
    --tls=*) tls_list="${1#*=}"; shift ;;
    --bin) bins+=("$2"); shift 2 ;;
    --bin=*) bins+=("${1#*=}"); shift ;;
    --no-build) build=0; shift ;;
    --mib) mib="$2"; shift 2 ;;
    --mib=*) mib="${1#*=}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-idle: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "${#bins[@]}" = 0 ]; then
  if [ "$build" = 1 ]; then
    bazel build --jobs=2 //daemon:refitd //client:refitctl //tests/bench:idle_bench
  fi
  bins=("$(bazel info bazel-bin 2>/dev/null)")
fi

work=$(mktemp -d /tmp/refit-idle-XXXXXX)
pids=()
. scripts/bench/lib/daemons.sh  # (from the repository root)
trap bench_cleanup EXIT
trap 'exit 130' INT TERM


echo "bench-idle: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), ${seconds} s per run"
n=0
for tls in $tls_list; do
  env_tls=(UCX_TLS="${tls%+eh}" UCX_WARN_UNUSED_ENV_VARS=n)
  case "$tls" in *+eh) env_tls+=(UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y) ;; esac
  for bin in "${bins[@]}"; do
    n=$((n + 1))
    tag="$n"
    env "${env_tls[@]}" "$bin/daemon/refitd" --socket="$work/$tag-trainer.sock" \
      --listen=127.0.0.1:0 --node=trainer-node >"$work/$tag-trainer.log" 2>&1 &
    trainer=$!
    pids=("$trainer")
    bench_wait_healthy "$bin/client/refitctl" "$work/$tag-trainer.sock" "$work/$tag-trainer.log"
    port=$("$bin/client/refitctl" --socket="$work/$tag-trainer.sock" status --json |
           python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("listen_port") or d.get("listenPort"))')
    env "${env_tls[@]}" "$bin/daemon/refitd" --socket="$work/$tag-engine.sock" \
      --listen=127.0.0.1:0 --node=engine-node --peers="127.0.0.1:$port" \
      >"$work/$tag-engine.log" 2>&1 &
    engine=$!
    pids+=("$engine")
    bench_wait_healthy "$bin/client/refitctl" "$work/$tag-engine.sock" "$work/$tag-engine.log"
    echo "=== UCX_TLS=$tls, $bin"
    "$bin/tests/bench/idle_bench" --trainer-socket="$work/$tag-trainer.sock" \
      --engine-socket="$work/$tag-engine.sock" --seconds="$seconds" --mib="$mib" ||
      { echo "idle_bench FAILED; the engine's log says:"; tail -5 "$work/$tag-engine.log"; }
    kill -TERM "$trainer" "$engine" 2>/dev/null || true
    wait "$trainer" "$engine" 2>/dev/null || true
    pids=()
  done
done
