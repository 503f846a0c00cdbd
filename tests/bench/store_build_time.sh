#!/bin/bash
# Issue 38, item 1: what an incremental change to one store .cc costs, and the store's tests.
#   tests/bench/store_build_time.sh [runs=3]
# For each run: appends a distinct comment to daemon/store/store_sparse.cc (so no cache hits),
# times `bazel build //daemon:refitd`, and takes the file back. Then times
# `bazel test //daemon/store:all --nocache_test_results` the same number of times. Prints each
# wall time and the medians, with a no-op `bazel build //daemon:refitd` as the same-run
# reference (bazel's own overhead). Takes ~3-6 minutes on a quiet 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-3}
file=daemon/store/store_sparse.cc
cp "$file" "/tmp/store_build_time.$$"
trap 'cp "/tmp/store_build_time.$$" "$file"; rm -f "/tmp/store_build_time.$$"' EXIT

wall() {  # seconds a command takes, its output dropped
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >/dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

bazel build //daemon:refitd >/dev/null 2>&1
noop=(); touched=(); tests=()
for i in $(seq "$runs"); do
  noop+=("$(wall bazel build //daemon:refitd)")
  echo "// store_build_time $$ $i $(date +%s%N)" >>"$file"
  touched+=("$(wall bazel build //daemon:refitd)")
  cp "/tmp/store_build_time.$$" "$file"
done
bazel build //daemon:refitd >/dev/null 2>&1
for i in $(seq "$runs"); do
  tests+=("$(wall bazel test //daemon/store:all --nocache_test_results)")
done
echo "no-op build (reference):        ${noop[*]}  median $(median "${noop[@]}") s"
echo "store_sparse.cc changed, build: ${touched[*]}  median $(median "${touched[@]}") s"
echo "bazel test //daemon/store:all:  ${tests[*]}  median $(median "${tests[@]}") s"
