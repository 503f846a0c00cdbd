#!/usr/bin/env bash
# Hostile local callers against a real refitd (issue 37): for each attack, refitd's open
# descriptors, threads and resident memory before, at the peak and after, whether it stayed
# alive, and the share of ordinary calls served during the attack (40 Status calls, each on a
# new connection of a new process, 2 s deadline each). The reference is the same probe with no
# attack, in the same run. Goals (docs/benchmarks.md, "Hostile local callers"): 100 % alive,
# >= 95 % served, memory back within 10 % of where it started.
#
# Attacks (run by tests/testing/hostile_client under other uids, setpriv; needs root):
#   health-watch   70 processes x 32 grpc.health.v1 Watch streams of an allowed uid (the crash
#                  of issue 37 took ~2,100), plus 500 of a refused uid
#   wait           40 processes x 32 WaitForVersion calls of an allowed uid
#   stall          2,000 connections of an allowed uid and 2,000 of a refused one, each one byte
#                  of the HTTP/2 preface, then silence
#   fd-preface     256 connections sending refit's fd preface a byte a message, 4 memfds each
#
# Usage: scripts/bench/bench-hostile.sh [--no-build] [--hold SECONDS] [--refitd PATH]
#   --refitd PATH  attack that refitd binary instead of this checkout's (e.g. an older build,
#                  for a before/after); one that dies is started again for the next attack.
set -euo pipefail
cd "$(dirname "$0")/../.."

build=1
hold=4
refitd=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0; shift ;;
    --hold) hold="$2"; shift 2 ;;
    --refitd) refitd="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-hostile: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "bench-hostile: run as root (attacks run under other uids)" >&2; exit 1; }
if [ "$build" = 1 ]; then
  bazel build //daemon:refitd //tests/testing:hostile_client >/dev/null
fi
bin=$(bazel info bazel-bin 2>/dev/null)
[ -n "$refitd" ] || refitd="$bin/daemon/refitd"
allowed=65534 refused=65533
work=$(mktemp -d /tmp/refit-bench-hostile-XXXXXX)
chmod 755 "$work"
cp "$bin/tests/testing/hostile_client" "$work/"
chmod 755 "$work/hostile_client"
socket="$work/refitd.sock"
start_refitd() {
  rm -f "$socket"
  "$refitd" --socket="$socket" --listen=127.0.0.1:0 --node=bench-hostile \
    --allow-uids=$allowed --log-level=warn >>"$work/refitd.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
  chmod 666 "$socket"
  sleep 0.5
}
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
start_refitd

as() { local uid=$1; shift; ulimit -n 16384; setpriv --reuid="$uid" --regid="$uid" --clear-groups "$work/hostile_client" "$socket" "$@"; }
fds() { ls "/proc/$pid/fd" 2>/dev/null | wc -l; }
threads() { awk '/^Threads:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo 0; }
rss() { awk '/^VmRSS:/ { printf "%.1f", $2 / 1024 }' "/proc/$pid/status" 2>/dev/null || echo 0; }
served() { as 0 probe 40 2000 | sed -n 's/.*served=\([0-9]*\).*/\1/p'; }

reference=$(served)
echo "refitd $refitd ($(git describe --always --dirty 2>/dev/null) checkout) on $(nproc) cores; reference: $reference/40 ordinary calls served with no attack"
printf '%-13s %-16s %-16s %-18s %-6s %-7s %s\n' attack "fds b/peak/a" "threads b/peak/a" "RSS MiB b/peak/a" alive served "attacker saw"

run_attack() {
  local name=$1; shift
  local f0 t0 r0 fp=0 tp=0 rp=0 got
  f0=$(fds) t0=$(threads) r0=$(rss)
  local pids=() outs=()
  while [ $# -gt 1 ]; do
    local uid=$1 args=$2 out="$work/$name.$#.out"
    shift 2
    # Each attacker holds what it opened until its standard input closes.
    # shellcheck disable=SC2086
    (sleep $((hold + 30)) | as "$uid" $args >"$out" 2>&1) &
    pids+=($!) outs+=("$out")
  done
  # The peak while the attack is under way, then the probe.
  for _ in $(seq $((hold * 5))); do
    local f t r
    f=$(fds) t=$(threads) r=$(rss)
    [ "$f" -gt "$fp" ] && fp=$f
    [ "$t" -gt "$tp" ] && tp=$t
    awk -v a="$r" -v b="$rp" 'BEGIN { exit !(a > b) }' && rp=$r
    sleep 0.2
  done
  got=$(served)
  for p in "${pids[@]}"; do pkill -KILL -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done 2>/dev/null
  sleep 6
  local alive=yes
  kill -0 "$pid" 2>/dev/null || alive=NO
  local saw
  saw=$(cat "${outs[@]}" 2>/dev/null | grep -o 'OK.*' | tr '\n' ';' | cut -c1-150 || true)
  printf '%-13s %-16s %-16s %-18s %-6s %-7s %s\n' "$name" "$f0/$fp/$(fds)" "$t0/$tp/$(threads)" \
    "$r0/$rp/$(rss)" "$alive" "$got/40" "$saw"
  if [ "$alive" = NO ]; then
    wait "$pid" 2>/dev/null || true
    echo "  refitd died: $(grep -m1 -iE 'abort|quota|fatal|terminate' "$work/refitd.log" | cut -c1-160)"
    died=1
    start_refitd
  fi
}
died=0

run_attack health-watch "$allowed" "hold health-watch 32 70" "$refused" "hold health-watch 50 10"
run_attack wait "$allowed" "hold wait-for-version 32 40"
run_attack stall "$allowed" "stall 2000 1" "$refused" "stall 2000 1"
run_attack fd-preface "$allowed" "fd-preface 256"
if [ "$died" = 0 ]; then echo "refitd alive after every attack (pid $pid)"; else echo "refitd DIED at least once"; exit 1; fi
