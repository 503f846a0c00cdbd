#!/usr/bin/env bash
# The fault suite's long runs (issue 18, docs/faults.md): each scenario's test with the long
# counts, then the figures they printed ("FIGURE ..." lines), and verified-Apply throughput
# beside plain Apply and memcpy from plan_bench in the same run.
#
#   kill        refitd SIGKILLed at each commit point (publish, pull_complete, apply) x KILLS
#   transit     a byte flipped in transit in every 2nd read, over TRANSIT versions
#   link        a link down for OUTAGE s mid-pull (network namespaces r18f-*; root)
#   deadline    WaitForVersion / WaitForReplicas / Apply deadlines, DEADLINE_ROUNDS rounds
#   sigterm     SIGTERM under load, SIGTERM_ROUNDS rounds
#   connections 10,000 connections to refitd in a 512 MiB memory cgroup, nofile 4096 and 16384
#   peer        hostile peers on the peer port (issue 37): checksum byte recovery, report floods,
#               huge names, 600 idle streams, pin floods, Hello in the node's name
#   hostile     thousands of health Watch streams and stalled connections of local callers
#               (issue 37; other uids: root)
#   apply       plan_bench: memcpy, plain apply, verified apply (same run)
#
# Usage: scripts/faults.sh [--kills 100] [--transit 1000] [--outage 30] [--only "kill transit"]
# Runs bazel with --jobs=2 (a shared machine). Exit status: 1 when any scenario's test failed.
set -uo pipefail
cd "$(dirname "$0")/.."

kills=100
transit=1000
outage=30
deadline_rounds=5
sigterm_rounds=5
only="kill transit link deadline sigterm connections peer hostile apply"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kills) kills="$2"; shift 2 ;;
    --transit) transit="$2"; shift 2 ;;
    --outage) outage="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

failed=0
figures=$(mktemp /tmp/r18f-faults-XXXXXX)
trap 'rm -f "$figures"' EXIT
bazel_test() {  # TARGET [--test_env ...]
  local target="$1"; shift
  local name="${target##*:}"
  echo "== $name" >&2
  if ! bazel test --jobs=2 --test_output=errors --cache_test_results=no --test_timeout=3600 \
      "$target" "$@" >&2; then
    echo "FAILED $name" >>"$figures"
    failed=1
  fi
  grep -h '^FIGURE ' "bazel-testlogs/tests/$name/test.log" >>"$figures" || true
}

for scenario in $only; do
  case "$scenario" in
    kill) bazel_test //tests:faults_kill_test --test_env=REFIT_FAULTS_ITERATIONS="$kills" ;;
    transit) bazel_test //tests:faults_transit_test --test_env=REFIT_FAULTS_ITERATIONS="$transit" ;;
    link) bazel_test //tests:faults_link_test --test_env=REFIT_FAULTS_OUTAGE_S="$outage" ;;
    deadline)
      bazel_test //tests:faults_deadline_test --test_env=REFIT_FAULTS_ITERATIONS="$deadline_rounds" ;;
    sigterm)
      bazel_test //tests:faults_sigterm_test --test_env=REFIT_FAULTS_ITERATIONS="$sigterm_rounds" ;;
    connections)
      for nofile in 4096 16384; do
        bazel_test //tests:faults_connections_test --test_env=REFIT_FAULTS_NOFILE="$nofile"
      done ;;
    peer) bazel_test //tests:faults_peer_test ;;
    hostile) bazel_test //tests:faults_hostile_local_test ;;
    apply)
      echo "== plan_bench" >&2
      bazel build --jobs=2 //daemon/plan:plan_bench >&2 &&
        bazel-bin/daemon/plan/plan_bench 5 |
        grep -A3 -E '^(execution|verified apply)' |
        sed 's/^/FIGURE apply /' >>"$figures" ;;
    *) echo "unknown scenario $scenario" >&2; exit 2 ;;
  esac
done

echo
echo "fault suite figures ($(date -u +%FT%TZ), $(nproc) cores):"
cat "$figures"
exit "$failed"
