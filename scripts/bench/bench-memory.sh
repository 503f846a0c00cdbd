#!/usr/bin/env bash
# The memory benchmark: two refitd on this machine (UCX_TLS=tcp) as the trainer's node and the
# engine's node, and tests/bench:two_node_bench --memory between them, for full versions
# (every byte changes) and delta versions (--density of the elements move by one ulp; the first
# version is full), at each --retain. It prints each daemon's resident memory after the
# versions beside the model's size: VmRSS, the clients' buffers mapped into it (the client's
# memory, shared, not added by refit), refit's own (the rest) and its peak, and the slot
# figures per model from Status; and the publish -> complete time (Publish called ->
# WaitForVersion returned on the engine's node) of the same runs.
#
# --bins "NAME=DIR ..." runs every configuration with each build's refitd (DIR is a bazel-bin,
# e.g. a worktree of the commit before), interleaved, so that before and after come from the
# same run; two_node_bench always comes from this checkout.
#
# --delta-base "held destination" runs each configuration with each of the engine's
# --delta-base modes (destination: the engine's buffers are the delta base, issue 20 part 2).
#
# --burst K then has the trainer publish K versions back to back (not waiting for the engine's
# node between them; it skips to the newest), and memory is read 2 s after the last arrived:
# what a trainer faster than its readers and its delta encoder leaves behind.
#
# Usage: scripts/bench/bench-memory.sh [--mib 1024] [--versions 5] [--retain "1 2"]
#                                [--density "0 0.01"] [--bins "new=$(bazel info bazel-bin)"]
#                                [--burst 0] [--rounds 1] [--no-build]
#                                [--delta-base "held"]
set -euo pipefail
cd "$(dirname "$0")/../.."

mib=1024
versions=5
retain_list="1 2"
density_list="0 0.01"
bins=""
rounds=1
burst=0
build=1
base_list="held"
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) mib="$2"; shift 2 ;;
    --versions) versions="$2"; shift 2 ;;
    --retain) retain_list="$2"; shift 2 ;;
    --density) density_list="$2"; shift 2 ;;
    --bins) bins="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --burst) burst="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --delta-base) base_list="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-memory: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ "$build" = 1 ]; then
  bazel build //daemon:refitd //client:refitctl //tests/bench:two_node_bench
fi
here="$(bazel info bazel-bin 2>/dev/null)"
[ -n "$bins" ] || bins="new=$here"
bench="$here/tests/bench/two_node_bench"
refitctl="$here/client/refitctl"

work=$(mktemp -d /tmp/refit-membench-XXXXXX)
pids=()
. scripts/bench/lib/daemons.sh  # (from the repository root)
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

wait_healthy() { bench_wait_healthy "$refitctl" "$@"; }

# $1: refitd binary, $2: --retain, $3: tag, $4: the engine's --delta-base.
start_daemons() {
  UCX_TLS=tcp "$1" --socket="$work/$3-trainer.sock" --listen=127.0.0.1:0 --node=trainer-node \
    --retain="$2" >"$work/$3-trainer.log" 2>&1 &
  trainer=$!
  pids+=("$trainer")
  wait_healthy "$work/$3-trainer.sock" "$work/$3-trainer.log"
  local port
  port=$("$refitctl" --socket="$work/$3-trainer.sock" status --json |
         python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("listen_port") or d.get("listenPort"))')
  UCX_TLS=tcp "$1" --socket="$work/$3-engine.sock" --listen=127.0.0.1:0 --node=engine-node \
    --retain="$2" ${4:+--delta-base="$4"} --peers="127.0.0.1:$port" >"$work/$3-engine.log" 2>&1 &
  engine=$!
  pids+=("$engine")
  wait_healthy "$work/$3-engine.sock" "$work/$3-engine.log"
}

stop_daemons() {
  kill -TERM "$trainer" "$engine" 2>/dev/null || true
  wait "$trainer" "$engine" 2>/dev/null || true
  pids=()
}

echo "bench-memory: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  model ${mib} MiB bf16, ${versions} versions (+ a burst of ${burst}), UCX_TLS=tcp, builds: $bins, engine --delta-base: $base_list"
results="$work/results.txt"
: >"$results"
for round in $(seq "$rounds"); do
  for retain in $retain_list; do
    for density in $density_list; do
     for base in $base_list; do
      for entry in $bins; do
        name="${entry%%=*}"
        dir="${entry#*=}"
        tag="$name-r$retain-d$density-$base-$round"
        kind=full
        [ "$density" != 0 ] && kind=delta
        echo
        echo "=== $name: --retain=$retain, $kind versions (density $density), engine --delta-base=$base, round $round"
        # held is the default: not passed, so that builds from before the flag run too.
        start_daemons "$dir/daemon/refitd" "$retain" "$tag" "${base#held}"
        if "$bench" --trainer-socket="$work/$tag-trainer.sock" \
             --engine-socket="$work/$tag-engine.sock" --versions="$versions" --warmup=0 \
             --mib="$mib" --density="$density" --burst="$burst" --timeout=120 --memory >"$work/$tag.out" 2>&1; then
          sed -n '/^memory after/,$p' "$work/$tag.out" | grep -v '^RESULT'
          grep '^  publish+transfer' "$work/$tag.out" | sed 's/^  /  median /' || true
          # How the engine's node took the versions (deltas on which base, or in full).
          "$refitctl" --socket="$work/$tag-engine.sock" status --json | python3 -c '
import json, sys
m = json.load(sys.stdin).get("metrics", {})
print("  engine: %d delta versions, %d full, %d delta-base fallbacks" % (
    m.get("refit_delta_versions_total", 0), m.get("refit_full_versions_total", 0),
    m.get("refit_delta_base_fallbacks_total", 0)))' || true
          echo "build=$name retain=$retain kind=$kind base=$base $(grep '^RESULT' "$work/$tag.out")" >>"$results"
        else
          cat "$work/$tag.out"
          echo "two_node_bench FAILED"
        fi
        stop_daemons
      done
     done
    done
  done
done

echo
echo "=== summary: resident memory after $versions versions (+ a burst of $burst), x the model (${mib} MiB); own = RSS less the clients' buffers mapped"
python3 - "$results" <<'PY'
import collections, statistics, sys
rows = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in open(sys.argv[1])]
groups = collections.OrderedDict()
for r in rows:
    groups.setdefault((r["build"], r["retain"], r["kind"], r["base"]), []).append(r)
print(f"{'build':<8} {'retain':>6} {'kind':<6} {'base':<11} {'trainer RSS':>11} {'own':>6} {'own peak':>8} "
      f"{'engine RSS':>10} {'own':>6} {'own peak':>8} {'publish->complete s':>20}")
for (build, retain, kind, base), rs in groups.items():
    size = float(rs[0]["bytes"])
    med = lambda k: statistics.median(float(r[k]) for r in rs)
    print(f"{build:<8} {retain:>6} {kind:<6} {base:<11} {med('trainer_rss') / size:>11.2f} "
          f"{med('trainer_own') / size:>6.2f} {med('trainer_own_peak') / size:>8.2f} "
          f"{med('engine_rss') / size:>10.2f} {med('engine_own') / size:>6.2f} "
          f"{med('engine_own_peak') / size:>8.2f} {med('e2e_s'):>20.4f}")
PY
