#!/usr/bin/env bash
# Before/after A/B of the two-node benchmark in one run (docs/benchmarks.md, "Checked data
# plane"): for each UCX_TLS, ROUNDS runs of each build in ABBA order, each a fresh pair of
# daemons (both of that build) and //tests/bench:two_node_bench with one tensor of MIB MiB.
# BASE_BIN and NEW_BIN are bazel-bin directories holding daemon/refitd, client/refitctl and
# tests/bench/two_node_bench (e.g. a worktree of main and this one). Prints each run's transfer
# time and the engine's per-version pull times.
# Usage: tests/bench/ab-two-node.sh BASE_BIN NEW_BIN "tcp sm,tcp+eh" ROUNDS VERSIONS [MIB]
set -uo pipefail
base=$1; new=$2; tls_list=$3; rounds=$4; versions=$5; mib=${6:-1024}
work=$(mktemp -d /tmp/refit-ab-XXXXXX)
echo "ab: $(date -u '+%H:%M:%S UTC'), load $(cut -d' ' -f1-3 /proc/loadavg), work $work"
run_one() {  # bin tls tag
  local bin=$1 tls=$2 tag=$3
  local env=(UCX_TLS="${tls%+eh}" UCX_WARN_UNUSED_ENV_VARS=n UCX_TCP_TX_SEG_SIZE=2m UCX_TCP_RX_SEG_SIZE=2m)
  case "$tls" in *+eh) env+=(UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y) ;; esac
  env "${env[@]}" "$bin/daemon/refitd" --socket="$work/$tag-t.sock" --listen=127.0.0.1:0 \
    --node=trainer-node >"$work/$tag-t.log" 2>&1 & local tp=$!
  for _ in $(seq 100); do "$bin/client/refitctl" --socket="$work/$tag-t.sock" --timeout=0.2 health >/dev/null 2>&1 && break; sleep 0.1; done
  local port=$("$bin/client/refitctl" --socket="$work/$tag-t.sock" status --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("listen_port") or d.get("listenPort"))')
  env "${env[@]}" "$bin/daemon/refitd" --socket="$work/$tag-e.sock" --listen=127.0.0.1:0 \
    --node=engine-node --peers="127.0.0.1:$port" >"$work/$tag-e.log" 2>&1 & local ep=$!
  for _ in $(seq 100); do "$bin/client/refitctl" --socket="$work/$tag-e.sock" --timeout=0.2 health >/dev/null 2>&1 && break; sleep 0.1; done
  "$bin/tests/bench/two_node_bench" --trainer-socket="$work/$tag-t.sock" --engine-socket="$work/$tag-e.sock" \
    --versions="$versions" --warmup=3 --mib="$mib" --tensors=1 --density=0 --engine-shard=none --timeout=60 \
    >"$work/$tag.out" 2>&1 || echo "FAILED $tag"
  kill -TERM $tp $ep; wait $tp $ep 2>/dev/null
  local r=$(grep '^RESULT' "$work/$tag.out" | grep -o 'transfer_s=[0-9.]*')
  local pulls=$(grep -o 'pulled [0-9]* bytes in [0-9.]* s' "$work/$tag-e.log" | awk '{print $5}' | tr '\n' ' ')
  echo "$tls $tag $r pulls: $pulls"
}
for tls in $tls_list; do
  for r in $(seq "$rounds"); do  # ABBA: base, new, new, base, ...
    if [ $((r % 2)) = 1 ]; then
      run_one "$base" "$tls" "base-${tls//[,+]/_}-$r"; run_one "$new" "$tls" "new-${tls//[,+]/_}-$r"
    else
      run_one "$new" "$tls" "new-${tls//[,+]/_}-$r"; run_one "$base" "$tls" "base-${tls//[,+]/_}-$r"
    fi
  done
done
echo "ab: done $(date -u '+%H:%M:%S UTC')"
