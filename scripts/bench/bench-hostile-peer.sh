#!/usr/bin/env bash
# Hostile peers against a real refitd (issue 37): per attack on the peer port, refitd's open fds,
# threads and resident memory before / at the peak / 3 s after, the share of ordinary calls
# (local Status and Publish, a legitimate peer's Hello and Pin) served meanwhile, whether both
# daemons stayed alive and the engine pulled every version. The first row is the reference:
# the same ordinary calls with no attack, same run. Goals: 100 % alive, >= 95 % served, memory
# back within 10 % (tests/faults_peer_test.cc).
#
# Usage: scripts/bench/bench-hostile-peer.sh     (bazel --jobs=2; exit 1 when a goal is missed)
set -uo pipefail
cd "$(dirname "$0")/../.."
rc=0
bazel test --jobs=2 --test_output=errors --cache_test_results=no --test_timeout=1800 \
  //tests:faults_peer_test >&2 || rc=1
echo "hostile peers ($(date -u +%FT%TZ), $(nproc) cores); columns: before/peak/after"
grep -h -E '^(FIGURE hostile-peer|  )' bazel-testlogs/tests/faults_peer_test/test.log |
  sed 's/^FIGURE hostile-peer //'
exit "$rc"
