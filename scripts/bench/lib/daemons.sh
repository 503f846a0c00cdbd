# Sourced (from the repository root) by the benchmarks in scripts/bench that start refitd processes of their own: waiting
# for one to answer, and stopping them (and removing their work directory) on exit.
# The caller sets `work` (its temporary directory) and `pids` (the processes it started).

bench_name=$(basename "$0" .sh)

# bench_wait_healthy REFITCTL SOCKET LOG: until the refitd on SOCKET answers its health check
# (10 s); otherwise prints LOG and fails.
bench_wait_healthy() {
  for _ in $(seq 100); do
    "$1" --socket="$2" --timeout=0.2 health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "$bench_name: refitd at $2 did not come up:" >&2
  cat "$3" >&2
  return 1
}

# Stops every process in `pids` (TERM, then waits for it).
bench_stop_pids() {
  local pid
  for pid in "${pids[@]:-}"; do
    [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  done
  return 0
}

# The EXIT trap of a benchmark with nothing else to undo: its processes, then its directory.
bench_cleanup() {
  bench_stop_pids
  rm -rf "$work"
}
