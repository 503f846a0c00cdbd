#!/usr/bin/env bash
# The refit demo on this one machine: installs what is missing (Debian 12, as root), builds,
# starts a refitd on a temporary socket, and runs a synthetic trainer that publishes 5 versions
# of a ~1 GiB bf16 Llama-shaped model and an inference engine that applies each one.
# Usage: scripts/demo.sh [refit_demo flags, e.g. --versions=10 --layers=4]
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
bazel build //daemon:refitd //client:refitctl //client/demo:refit_demo
bin="$(bazel info bazel-bin 2>/dev/null)"

work=$(mktemp -d /tmp/refit-demo-XXXXXX)
socket="$work/refitd.sock"
"$bin/daemon/refitd" --socket="$socket" --listen=127.0.0.1:0 --node=demo-node \
  >"$work/refitd.log" 2>&1 &
daemon=$!
cleanup() {
  kill -TERM "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

for _ in $(seq 100); do
  "$bin/client/refitctl" --socket="$socket" --timeout=0.2 health >/dev/null 2>&1 && break
  sleep 0.1
done

"$bin/client/demo/refit_demo" --socket="$socket" "$@"
echo
echo "refitctl status:"
"$bin/client/refitctl" --socket="$socket" status
