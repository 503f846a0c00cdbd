#!/usr/bin/env bash
# The refit demo on this one machine: installs what is missing (Debian 12, as root), builds,
# and starts two refitd daemons acting as two nodes — a trainer node and an inference node that
# lists the trainer as its peer. A synthetic trainer publishes 5 versions of a ~1 GiB bf16
# Llama-shaped model on the first; an inference engine on the second waits for each version
# (pulled over UCX while it "generates") and applies it into its own, fused layout.
# Usage: scripts/demo.sh [refit_demo flags, e.g. --versions=10 --layers=4]
# UCX_TLS picks the data-plane transport (default here: tcp).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install/install-deps.sh
bazel build //daemon:refitd //client:refitctl //client/demo:refit_demo
bin="$(bazel info bazel-bin 2>/dev/null)"
export UCX_TLS="${UCX_TLS:-tcp}"

work=$(mktemp -d /tmp/refit-demo-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "${REFIT_DEMO_KEEP:-}" ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

wait_ready() {
  for _ in $(seq 100); do
    "$bin/client/refitctl" --socket="$1" --timeout=0.2 health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "refitd at $1 did not start; see $work/*.log" >&2
  return 1
}

"$bin/daemon/refitd" --socket="$work/trainer.sock" --listen=127.0.0.1:0 --node=trainer-node \
  >"$work/trainer-node.log" 2>&1 &
pids+=($!)
wait_ready "$work/trainer.sock"
port=$("$bin/client/refitctl" --socket="$work/trainer.sock" status --json |
  sed -n 's/.*"listen_port": \([0-9]*\).*/\1/p')

"$bin/daemon/refitd" --socket="$work/engine.sock" --listen=127.0.0.1:0 --node=engine-node \
  --peers="127.0.0.1:$port" >"$work/engine-node.log" 2>&1 &
pids+=($!)
wait_ready "$work/engine.sock"

echo "trainer node: $work/trainer.sock (peer port $port); engine node: $work/engine.sock;" \
  "data plane UCX_TLS=$UCX_TLS"
"$bin/client/demo/refit_demo" --socket="$work/trainer.sock" --engine-socket="$work/engine.sock" "$@"
echo
echo "refitctl status (engine node):"
"$bin/client/refitctl" --socket="$work/engine.sock" status
