#!/usr/bin/env bash
# The fan-out benchmark (issue 16): one trainer node and K engine nodes, each a network
# namespace on one bridge, each node's link limited to --rate (default 1 Gbit/s) in both
# directions. For each K it starts one refitd per node (a full mesh of --peers: the trainer and
# every engine know each other, as relays need), runs tests/bench:fanout_bench, stops them, and
# runs a torch gloo broadcast of the same bytes in the same topology (rank 0 on the trainer's
# node, one receiver per engine's node). It prints per K:
#   T(K)      Publish returned on the trainer -> the version complete on the LAST engine node
#             (median over versions 3..N; the first, and the second, which allocate the nodes'
#             two version slots, apart: the second took 2-3x the others on a loaded machine);
#   T(K)/T(1);
#   trainer   what the trainer node's refit_data_bytes_sent_total grew by per version, in models
#             (and the same over all engines: what they served each other), and the trainer
#             link's transmitted bytes per version (IP level, control traffic included);
#   gloo T(K) and refit T(K) / gloo T(K),
# with the issue's goals beside them (printed, not asserted). Every engine Applies every
# version and its bytes are compared with the source; every gloo receiver checks its bytes.
#
# Network: namespaces fleet-fan-sw (the bridge br0 and the switch ends p0..pK of the veth
# pairs), fleet-fan-t (the trainer, 198.18.0.1) and fleet-fan-e1..fleet-fan-eK (198.18.0.2..;
# RFC 2544 benchmark
# addresses), each node's end named eth0. Each node's upload is capped on eth0, its download on
# pN (the bridge side), by a tbf qdisc, except that with --host-queue fair (the default) a
# node's eth0 is an HTB of the same rate with one class per peer (u32 on the destination
# address; each class's share 1/K of the rate, borrowing up to all of it, a 20 ms bfifo each):
# the node's upload is shared fairly between the peers it sends to, as a Linux host's default
# fq_codel shares it between flows (this VM's kernel has no fq_codel, fq or sfq; the switch
# ports stay one FIFO each, as a switch's are). --host-queue fifo: a tbf on eth0 too (one FIFO
# for every flow of the node, what runs before 2026-12-04 late used; the trainer's link is then
# shared between the stripes as their TCP flows happen to split it: docs/benchmarks.md, "What
# is left at K = 8"). The switch side: burst 256 KiB (~2 ms at
# 1 Gbit/s: above a 64 KiB GSO packet, so tbf never has to split one, and a negligible lead
# over a 2 s transfer), latency 20 ms (a ~2.5 MiB queue at 1 Gbit/s: TCP is not dropped into
# retransmits by a short queue). The daemons run with UCX_TLS=tcp UCX_NET_DEVICES=eth0 and
# --retain=1, the engines' with --delta-base=destination (one version slot each: nine daemons
# with 1 GiB each must fit in 24 GiB); nothing crosses the root namespace.
# Where the time goes: the machine's CPU busy fraction while each K runs (from /proc/stat) and
# the daemons' CPU seconds per version (utime + stime; the kernel's softirq work for their
# sockets is in the busy fraction, not always in their times) are printed beside T(K): the
# median of the versions after the warm-up ones, from Publish until the byte counters settled
# (fanout_bench's cpu_s, Apply not included), and the mean over the whole run (all versions,
# the warm-up ones and Apply included).
# Everything is removed on exit (trap), also after a failure; a run first removes what a killed
# run left (namespaces fleet-fan-*, their processes, /dev/shm/refit-fanout-*). One run at a time
# (flock on /run/lock/refit-bench-fanout.lock). Needs root and iproute2.
#
# Usage: scripts/bench/bench-fanout.sh [--engines "1 2 4"] [--mib 256 | --gib | --sizes "256 1024"]
#                                [--versions 5] [--warmup 2] [--gloo-rounds 5] [--rate 1gbit]
#                                [--no-gloo | --gloo-sizes "256"] [--no-build]
#                                [--refitd-args "--relay=false"] [--keep] [--extras]
#                                [--host-queue fair | fifo]
# The issue-36 table (K = 1 2 4 8 at 256 MiB and at 1 GiB, gloo beside the 256 MiB table),
# at 250 Mbit/s: the rate at which the daemons' CPU is not the limit at K = 8 on 2 cores (they
# use ~1.1-1.5 CPU-s per engine node per 256 MiB version, a little more at lower rates (part
# is paid per second of transfer): 10-12 CPU-s for nine daemons, plus the kernel's veth/tbf/TCP
# work; a K = 8 version at line rate has 2 x 2.4 CPU-s at 1 Gbit/s, 2 x 4.8 at 500 Mbit/s,
# 2 x 9.5 at 250 Mbit/s). About 17 minutes on a quiet machine:
#   scripts/bench/bench-fanout.sh --engines "1 2 4 8" --sizes "256 1024" --versions 4 --warmup 1 \
#     --gloo-rounds 1 --gloo-warmup 0 --gloo-sizes 256 --rate 250mbit
# --gloo-sizes: the sizes the gloo reference runs at (default: every size; gloo's K = 8 round
# at 1 GiB and 250 Mbit/s alone takes ~4.5 min).
# --sizes: each size in turn, every K at each (one table per size). A size that nine (K + 1)
# daemons, their clients' buffers and the slots can't hold in the memory available is shrunk,
# in 64 MiB steps, to the largest that fits the largest K, and the output says so.
# --warmup: versions reported apart, not in the medians (default 2); --gloo-warmup: gloo rounds
# before the timed ones (default 1). After each size's table the simulator's T(K) for the same
# K, model and link is printed beside it, every link at --sim-goodput (default 0.951: the
# goodput fitted once, docs/fanout-simulator.md).
# --engines: the K values, run in this order (8 is skipped, with a message, when the machine's
# available memory can't hold it); --gib: a 1 GiB model; --keep: keep the logs (the daemons'
# logs say what each pull did); --refitd-args: more flags for every refitd (split on spaces),
# e.g. to compare a daemon option on and off in the same topology; --extras: afterwards, the
# timed relay kill (tests/fleet_netns_test, four engine nodes, 200 Mbit/s, 64 MiB) and the
# sites run (tests/fleet_sites_test: inter-site bytes per version by refit's count and by the
# slow link's own counters), their figures printed here.
# Environment: BAZEL_OUTPUT_BASE=<dir> builds in that Bazel output base, without convenience
# symlinks.
set -euo pipefail
cd "$(dirname "$0")/../.."

engines_list="1 2 4"
mib=256
versions=5
warmup=2
sizes=""
gloo_rounds=5
gloo_warmup=1
sim_goodput=0.951
rate=1gbit
burst=256kb
latency=20ms
gloo=1
gloo_sizes=""
build=1
keep=0
extras=0
refitd_args=""
host_queue=fair
while [ $# -gt 0 ]; do
  case "$1" in
    --engines) engines_list="$2"; shift 2 ;;
    --engines=*) engines_list="${1#*=}"; shift ;;
    --mib) mib="$2"; shift 2 ;;
    --mib=*) mib="${1#*=}"; shift ;;
    --gib) mib=1024; shift ;;
    --sizes) sizes="$2"; shift 2 ;;
    --sizes=*) sizes="${1#*=}"; shift ;;
    --warmup) warmup="$2"; shift 2 ;;
    --warmup=*) warmup="${1#*=}"; shift ;;
    --versions) versions="$2"; shift 2 ;;
    --versions=*) versions="${1#*=}"; shift ;;
    --gloo-rounds) gloo_rounds="$2"; shift 2 ;;
    --gloo-rounds=*) gloo_rounds="${1#*=}"; shift ;;
    --gloo-warmup) gloo_warmup="$2"; shift 2 ;;
    --gloo-warmup=*) gloo_warmup="${1#*=}"; shift ;;
    --sim-goodput) sim_goodput="$2"; shift 2 ;;
    --sim-goodput=*) sim_goodput="${1#*=}"; shift ;;
    --rate) rate="$2"; shift 2 ;;
    --rate=*) rate="${1#*=}"; shift ;;
    --no-gloo) gloo=0; shift ;;
    --gloo-sizes) gloo_sizes="$2"; shift 2 ;;
    --gloo-sizes=*) gloo_sizes="${1#*=}"; shift ;;
    --refitd-args) refitd_args="$2"; shift 2 ;;
    --refitd-args=*) refitd_args="${1#*=}"; shift ;;
    --host-queue) host_queue="$2"; shift 2 ;;
    --host-queue=*) host_queue="${1#*=}"; shift ;;
    --no-build) build=0; shift ;;
    --keep) keep=1; shift ;;
    --extras) extras=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-fanout: unknown argument $1" >&2; exit 2 ;;
  esac
done
for k in $engines_list; do
  case "$k" in
    [1-9]|[1-9][0-9]) ;;
    *) echo "bench-fanout: --engines takes numbers 1-99, not '$k'" >&2; exit 2 ;;
  esac
done
# The link rate in Mbit/s (tc's kbit / mbit / gbit): the timeouts below scale with it.
rate_mbit=$(echo "$rate" | awk '/gbit$/ { sub(/gbit$/, ""); print int($0 * 1000); next }
                                /mbit$/ { sub(/mbit$/, ""); print int($0); next }
                                /kbit$/ { sub(/kbit$/, ""); print int($0 / 1000); next }')
if [ -z "$rate_mbit" ] || [ "$rate_mbit" -lt 1 ]; then
  echo "bench-fanout: --rate takes tc's kbit / mbit / gbit of at least 1mbit, not '$rate'" >&2
  exit 2
fi
case "$host_queue" in
  fair|fifo) ;;
  *) echo "bench-fanout: --host-queue takes fair or fifo, not '$host_queue'" >&2; exit 2 ;;
esac
# Seconds a transfer of $1 MiB at the link rate takes, at least 1.
line_s() { echo $(( ($1 * 8 * 1049 / 1000 + rate_mbit - 1) / rate_mbit + 1 )); }
if [ "$(id -u)" -ne 0 ]; then
  echo "bench-fanout: needs root (network namespaces, tc)" >&2
  exit 1
fi

bazel_cmd=(bazel)
build_flags=()
if [ -n "${BAZEL_OUTPUT_BASE:-}" ]; then
  bazel_cmd+=(--output_base="$BAZEL_OUTPUT_BASE")
  build_flags+=(--experimental_convenience_symlinks=ignore)
fi
if [ "$build" = 1 ]; then
  ./scripts/install/install-deps.sh
  "${bazel_cmd[@]}" build "${build_flags[@]}" //daemon:refitd //client:refitctl \
    //tests/bench:fanout_bench //daemon/fleet:fanout_sim
  if [ "$extras" = 1 ]; then
    "${bazel_cmd[@]}" build "${build_flags[@]}" //tests:fleet_netns_test //tests:fleet_sites_test \
      //daemon:refitd_testing
  fi
fi
# $REFIT_FANOUT_BIN: binaries laid out as bazel-bin (daemon/refitd, ...) instead of bazel-bin.
bin="${REFIT_FANOUT_BIN:-$("${bazel_cmd[@]}" info bazel-bin 2>/dev/null)}"
# The lock is fd 9 of this shell only: every process started below gets "9>&-", so one
# that outlives a killed run (and the Bazel server) never holds it.
exec 9>/run/lock/refit-bench-fanout.lock
if ! flock -n 9; then
  echo "bench-fanout: another bench-fanout run holds /run/lock/refit-bench-fanout.lock" >&2
  exit 1
fi
python=/usr/bin/python3
# $REFIT_TEST_NETNS_PREFIX (as the netns tests): whose namespaces these are.
prefix=${REFIT_TEST_NETNS_PREFIX:+$REFIT_TEST_NETNS_PREFIX-}fleet-fan
switch=$prefix-sw
port=7070
gloo_port=29500

node_name() { if [ "$1" = 0 ]; then echo trainer; else echo "engine$1"; fi; }
node_ns() { if [ "$1" = 0 ]; then echo "$prefix-t"; else echo "$prefix-e$1"; fi; }
node_ip() { echo "198.18.0.$(($1 + 1))"; }

# Removes every namespace named $prefix-* with the processes in it, and our shared memory.
remove_network() {
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
      [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
      sleep 0.1
    done
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f /dev/shm/refit-fanout-*
}

work=$(mktemp -d /tmp/refit-fanout-XXXXXX)
pids=()
stop_pids() {
  local pid
  for pid in "${pids[@]:-}"; do
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for pid in "${pids[@]:-}"; do
    if [ -n "$pid" ]; then wait "$pid" 2>/dev/null || true; fi
  done
  pids=()
}
cleanup() {
  stop_pids
  remove_network
  if [ "$keep" = 1 ]; then echo "bench-fanout: logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Memory: the clients' buffers (the trainer's SOURCE and one DESTINATION per engine, in
# /dev/shm), the trainer's retain+1 = 2 version slots, and per engine node one version slot
# (--delta-base=destination) and the Apply's undo-journal slot, which it keeps for the next
# Apply (atomic Apply; a model's size each); gloo holds one copy per rank plus torch. Each size
# is shrunk (in 64 MiB steps) until the largest K leaves 2 GiB available. (Counting one slot per
# engine, 1 GiB at K = 8 passed this check and the kernel killed an engine's refitd.)
avail_mib=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
max_k=0
runs=()
for k in $engines_list; do
  runs+=("$k")
  [ "$k" -gt "$max_k" ] && max_k=$k
done
[ -n "$sizes" ] || sizes="$mib"
fitted=()
for size in $sizes; do
  case "$size" in
    [1-9]|[1-9][0-9]|[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9]|[1-9][0-9][0-9][0-9][0-9]) ;;
    *) echo "bench-fanout: --sizes takes MiB (1-99999), not '$size'" >&2; exit 2 ;;
  esac
  fit=$size
  while [ $(( (3 * max_k + 3) * fit + 2048 )) -gt "$avail_mib" ] && [ "$fit" -gt 64 ]; do
    fit=$(( (fit - 1) / 64 * 64 ))
  done
  if [ $(( (3 * max_k + 3) * fit + 2048 )) -gt "$avail_mib" ]; then
    echo "bench-fanout: not even 64 MiB fits K=$max_k (${avail_mib} MiB available)" >&2
    exit 1
  fi
  if [ "$fit" != "$size" ]; then
    echo "bench-fanout: ${size} MiB does not fit K=$max_k: $(( max_k + 1 )) daemons need" \
      "~$(( (3 * max_k + 3) * size + 2048 )) MiB, ${avail_mib} MiB available;" \
      "running ${fit} MiB instead (the largest that fits)"
  fi
  fitted+=("$fit")
done

# Node $2's upload on eth0 of namespace $1, shared fairly between its peers (--host-queue fair):
# an HTB at the link rate, one class per peer address (guaranteed 1/max_k of the rate, borrowing
# up to all of it; quantum 64 KiB), each with a bfifo of 20 ms at the full rate; what goes to no
# peer (ARP) in a small default class.
host_egress_fair() {
  local ns="$1" me="$2" j share_kbit queue
  share_kbit=$(( rate_mbit * 1000 / max_k ))
  queue=$(( rate_mbit * 1000000 / 8 * ${latency%ms} / 1000 ))
  ip netns exec "$ns" tc qdisc replace dev eth0 root handle 1: htb default 99
  ip netns exec "$ns" tc class add dev eth0 parent 1: classid 1:1 htb rate "$rate" ceil "$rate" \
    burst "$burst" cburst "$burst" quantum 65536
  ip netns exec "$ns" tc class add dev eth0 parent 1:1 classid 1:99 htb rate 1mbit ceil "$rate" \
    burst "$burst" cburst "$burst" quantum 65536
  for j in $(seq 0 "$max_k"); do
    [ "$j" = "$me" ] && continue
    ip netns exec "$ns" tc class add dev eth0 parent 1:1 classid "1:$((j + 10))" htb \
      rate "${share_kbit}kbit" ceil "$rate" burst "$burst" cburst "$burst" quantum 65536
    ip netns exec "$ns" tc qdisc add dev eth0 parent "1:$((j + 10))" bfifo limit "$queue"
    ip netns exec "$ns" tc filter add dev eth0 parent 1: protocol ip prio 1 u32 \
      match ip dst "$(node_ip "$j")/32" flowid "1:$((j + 10))"
  done
}

remove_network  # what a killed run left
ip netns add "$switch"
ip -n "$switch" link set lo up
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for i in $(seq 0 "$max_k"); do
  ns=$(node_ns "$i")
  ip netns add "$ns"
  ip -n "$switch" link add "p$i" type veth peer name "n$i"
  ip -n "$switch" link set "n$i" netns "$ns"
  ip -n "$ns" link set "n$i" name eth0
  ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$switch" link set "p$i" master br0
  ip -n "$switch" link set "p$i" up
  if [ "$host_queue" = fair ]; then
    host_egress_fair "$ns" "$i"
  else
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" \
      latency "$latency"
  fi
  ip netns exec "$switch" tc qdisc replace dev "p$i" root tbf rate "$rate" burst "$burst" \
    latency "$latency"
done

started=$(date +%s)
echo "bench-fanout: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg), ${avail_mib} MiB available"
echo "  models ${fitted[*]} MiB (one bf16 tensor), ${versions} versions per K (the first ${warmup} apart), engines: ${runs[*]}; links: tbf rate $rate burst $burst latency $latency on each switch port, the nodes' uploads $( [ "$host_queue" = fair ] && echo "an HTB of that rate shared fairly between peers (--host-queue fair)" || echo "the same tbf (--host-queue fifo)")"
echo "  refitd --retain=1 ${refitd_args:+$refitd_args }(full mesh of --peers), UCX_TLS=tcp, UCX_NET_DEVICES=eth0; $(ucx_info -v | head -1 | sed 's/# //')"

. scripts/bench/lib/daemons.sh  # (from the repository root)
wait_healthy() { bench_wait_healthy "$bin/client/refitctl" "$@"; }

# All cores' jiffies since boot: "total idle+iowait".
cpu_ticks() { awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print t, $5 + $6 }' /proc/stat; }
# utime + stime of the processes named, in clock ticks (those gone count 0).
proc_ticks() {
  local pid total=0 t
  for pid in "$@"; do
    t=$(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total"
}

tx_bytes() { ip netns exec "$(node_ns 0)" cat /sys/class/net/eth0/statistics/tx_bytes; }

# refitd on nodes 0..$1, every one peering all the others; then fanout_bench.
run_refit() {
  local k="$1" i j peers sockets="" extra_args=() base_args=()
  read -r -a extra_args <<<"$refitd_args"
  for i in $(seq 1 "$k"); do base_args[$i]="--delta-base=destination"; done
  for i in $(seq 0 "$k"); do
    peers=""
    for j in $(seq 0 "$k"); do
      [ "$j" = "$i" ] || peers+="${peers:+,}$(node_ip "$j"):$port"
    done
    ip netns exec "$(node_ns "$i")" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
      UCX_WARN_UNUSED_ENV_VARS=n "$bin/daemon/refitd" --node="$(node_name "$i")" \
      --listen="$(node_ip "$i"):$port" --peers="$peers" --socket="$out/k$k-$i.sock" \
      --retain=1 --allow-plaintext-peers ${base_args[$i]:-} "${extra_args[@]}" \
      >"$out/k$k-$(node_name "$i").log" 2>&1 9>&- &
    pids+=("$!")
  done
  for i in $(seq 0 "$k"); do
    wait_healthy "$out/k$k-$i.sock" "$out/k$k-$(node_name "$i").log"
    [ "$i" = 0 ] || sockets+="${sockets:+,}$out/k$k-$i.sock"
  done
  local tx0 ok=1 cpu0 daemons0 daemon_pids=("${pids[@]}")
  tx0=$(tx_bytes)
  cpu0=$(cpu_ticks)
  daemons0=$(proc_ticks "${daemon_pids[@]}")
  ip netns exec "$(node_ns 0)" "$bin/tests/bench/fanout_bench" \
    --trainer-socket="$out/k$k-0.sock" --engine-sockets="$sockets" --versions="$versions" \
    --mib="$mib" --warmup="$warmup" --timeout=$((60 + 3 * k * $(line_s "$mib"))) >"$out/refit-k$k.out" 2>&1 9>&- &
  pids+=("$!")
  wait "$!" || ok=0  # in the background: a signal's trap runs at once, not after the bench
  local cpu1 daemons1 busy daemon_s
  cpu1=$(cpu_ticks)
  daemons1=$(proc_ticks "${daemon_pids[@]}")
  busy=$(awk -v a="$cpu0" -v b="$cpu1" 'BEGIN { split(a, x, " "); split(b, y, " ");
         t = y[1] - x[1]; i = y[2] - x[2]; printf "%.2f", (t > 0 ? (t - i) / t : 0) }')
  daemon_s=$(awk -v a="$daemons0" -v b="$daemons1" -v n="$versions" -v hz="$(getconf CLK_TCK)" \
             'BEGIN { printf "%.2f", (b - a) / hz / n }')
  echo "cpu: the machine was ${busy} busy (all cores, /proc/stat) while K=$k ran;" \
    "its $((k + 1)) daemons used ${daemon_s} CPU s per version (all versions)"
  local wire
  wire=$(awk -v a="$tx0" -v b="$(tx_bytes)" -v n="$versions" -v m="$mib" \
         'BEGIN { printf "%.3f", (b - a) / n / (m * 1048576) }')
  stop_pids
  cat "$out/refit-k$k.out"
  if [ "$ok" = 0 ]; then
    echo "fanout_bench FAILED for K=$k; the daemons' warnings and errors:"
    grep -hE ' [EW] \[|UCX  ERROR' "$out"/k"$k"-*.log | sort -u | head -10 | sed 's/^/  /' ||
      true
    echo "k=$k refit_failed=1" >>"$out/results.txt"
    return 0
  fi
  # A peer channel closed by its server (gRPC GOAWAY) loses the calls on it, among them the pin
  # release that carries a puller's byte count to refit_data_bytes_sent_total.
  local goaways
  goaways=$(cat "$out"/k"$k"-*.log | grep -c 'GOAWAY' || true)
  echo "trainer link (eth0) transmitted ${wire} models per version (IP level, all traffic);" \
    "gRPC GOAWAYs in the daemons' logs: $goaways"
  echo "$(grep '^RESULT' "$out/refit-k$k.out" | sed 's/^RESULT //') wire_models=$wire" \
    "goaways=$goaways busy=$busy daemon_cpu_s=$daemon_s" >>"$out/results.txt"
}

# A gloo broadcast from rank 0 on the trainer's node to ranks 1..$1 on the engines' nodes.
run_gloo() {
  local k="$1" r ok=1
  local limit=$((300 + 3 * k * $(line_s "$mib") * (gloo_rounds + gloo_warmup)))
  for r in $(seq 1 "$k"); do
    ip netns exec "$(node_ns "$r")" timeout "$limit" "$python" tests/bench/gloo_broadcast.py \
      --rank "$r" --world-size $((k + 1)) --master-addr "$(node_ip 0)" --port "$gloo_port" \
      --ifname eth0 --mib "$mib" --rounds "$gloo_rounds" --warmup "$gloo_warmup" >"$out/gloo-k$k-$r.out" \
      2>&1 9>&- &
    pids+=("$!")
  done
  ip netns exec "$(node_ns 0)" timeout "$limit" "$python" \
    tests/bench/gloo_broadcast.py --rank 0 --world-size $((k + 1)) --master-addr "$(node_ip 0)" \
    --port "$gloo_port" --ifname eth0 --mib "$mib" --rounds "$gloo_rounds" --warmup "$gloo_warmup" \
    >"$out/gloo-k$k-0.out" 2>&1 9>&- &
  pids+=("$!")
  for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
  pids=()
  cat "$out/gloo-k$k-0.out"
  if [ "$ok" = 0 ]; then
    echo "gloo broadcast FAILED for K=$k:"
    tail -n 3 "$out"/gloo-k"$k"-*.out | sed 's/^/  /'
    echo "k=$k gloo_failed=1" >>"$out/results.txt"
    return 0
  fi
  echo "k=$k $(grep '^RESULT' "$out/gloo-k$k-0.out" | sed 's/^RESULT //')" >>"$out/results.txt"
}

for mib in "${fitted[@]}"; do
out="$work/$mib"
mkdir -p "$out"
: >"$out/results.txt"
for k in "${runs[@]}"; do
  echo
  echo "=== K=$k, ${mib} MiB: refit, 1 trainer node -> $k engine node(s)"
  run_refit "$k"
  if [ "$gloo" = 1 ] && { [ -z "$gloo_sizes" ] || [[ " $gloo_sizes " == *" $mib "* ]]; }; then
    echo "--- K=$k: gloo broadcast (torch $("$python" -c 'import torch; print(torch.__version__)'))"
    run_gloo "$k"
  fi
done

echo
echo "=== summary: model ${mib} MiB, links $rate; medians; $(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - started )) s"
"$python" - "$out/results.txt" <<'EOF'
import sys
by_k = {}
for line in open(sys.argv[1]):
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    by_k.setdefault(int(fields["k"]), {}).update(fields)
one = float(by_k.get(1, {}).get("t_s", 0) or 0)
print(f"{'K':>3} {'T(K) s':>8} {'1st s':>7} {'T(K)/T(1)':>9} {'trainer':>8} {'engines':>8} "
      f"{'trainer':>8} {'gloo':>7} {'refit/':>6} {'cpu':>5} {'daemons':>8} {'daemons':>8}")
print(f"{'':>3} {'':>8} {'':>7} {'':>9} {'models':>8} {'models':>8} {'link':>8} {'T(K) s':>7} "
      f"{'gloo':>6} {'busy':>5} {'cpu s/v':>8} {'all v':>8}")
for k in sorted(by_k):
    r = by_k[k]
    if r.get("refit_failed"):
        refit = f"{'FAILED':>8} {'':>7} {'':>9} {'':>8} {'':>8} {'':>8}"
        t = 0.0
    else:
        t = float(r["t_s"])
        ratio = f"{t / one:.2f}" if one else "n/a"
        refit = (f"{t:>8.3f} {float(r['first_s']):>7.3f} {ratio:>9} "
                 f"{float(r['trainer_models']):>8.3f} {float(r['engines_models']):>8.3f} "
                 f"{float(r['wire_models']):>8.3f}")
    if r.get("gloo_s"):
        g = float(r["gloo_s"])
        gloo = f"{g:>7.3f} {t / g if t else 0:>6.2f}"
    else:
        gloo = f"{'FAILED' if r.get('gloo_failed') else '-':>7} {'':>6}"
    cpu = f"{r.get('busy', '-'):>5} {r.get('cpu_s', '-'):>8} {r.get('daemon_cpu_s', '-'):>8}"
    print(f"{k:>3} {refit} {gloo} {cpu}")
print("trainer/engines models: refit_data_bytes_sent_total per version / model bytes "
      "(engines: summed); trainer link: eth0 tx bytes per version / model bytes; daemons cpu "
      "s/v: the K+1 daemons' CPU s per version, median after the warm-up (Publish to settled "
      "counters), and over all versions (Apply included)")
for k in sorted(by_k):
    r = by_k[k]
    if r.get("trainer_mean_models") and float(r["wire_models"]) > 0:
        counted, wire = float(r["trainer_mean_models"]), float(r["wire_models"])
        if abs(counted - wire) > 0.05 * wire:
            print(f"WARNING K={k}: the trainer's refit_data_bytes_sent_total grew by {counted:.2f} "
                  f"models per version (mean of all versions), its link carried {wire:.2f}; the "
                  f"daemons' logs have "
                  f"{r['goaways']} gRPC GOAWAY(s) (a pin release lost on a closed peer channel "
                  f"is a puller's bytes not counted)")
print("goals (issues 16 and 36, not asserted): T(K)/T(1) <= 1.15 up to K = 8; trainer <= 1.05 "
      "models per version; refit T(4) <= 0.35x gloo T(4)")
met = lambda ok: "met" if ok else "NOT met"
for k in sorted(by_k):
    r = by_k[k]
    if k == 1 or not one or not r.get("t_s"):
        continue
    t = float(r["t_s"])
    print(f"  K={k}: T({k})/T(1) = {t / one:.2f} ({met(t / one <= 1.15)}); trainer "
          f"{float(r['trainer_models']):.3f} models, link {float(r['wire_models']):.3f} "
          f"({met(max(float(r['trainer_models']), float(r['wire_models'])) <= 1.05)})"
          + (f"; refit/gloo = {t / float(r['gloo_s']):.2f}" if r.get("gloo_s") else "")
          + (f" ({met(t / float(r['gloo_s']) <= 0.35)})" if r.get("gloo_s") and k == 4 else ""))
EOF
# The simulator (daemon/fleet/fanout_sim) beside the real table: the same K, model and link,
# chunks of the relays' grain, every link at the goodput fitted once (docs/fanout-simulator.md),
# not refitted per run.
sim="$bin/daemon/fleet/fanout_sim"
rate_gbit=$(echo "$rate" | awk '/gbit$/ { sub(/gbit$/, ""); print; next }
                                /mbit$/ { sub(/mbit$/, ""); print $0 / 1000; next }')
if [ -x "$sim" ] && [ -n "$rate_gbit" ]; then
  measured=$(for k in "${runs[@]}"; do
                t=$(grep "^k=$k " "$out/results.txt" | grep -o ' t_s=[0-9.]*' | head -1 |
                    cut -d= -f2 || true)
                printf '%s,' "${t:--}"
              done | sed 's/,$//')
  # At the grain relays forward in (refitd's --relay-chunk-bytes, 256 KiB unless given).
  relay_chunk=$(echo " $refitd_args " | grep -o -- ' --relay-chunk-bytes=[0-9]*' | cut -d= -f2 |
                tail -1 || true)
  "$sim" --model-bytes "${mib}MiB" --link-gbit "$rate_gbit" --k 1 --kimi=false \
    --chunk-bytes "${relay_chunk:-262144}" \
    --goodput "$sim_goodput" --calibrate-measured "$measured" \
    --calibrate-k "$(echo "${runs[*]}" | tr ' ' ',')" | sed -n '/^Calibration/,/^$/p' || true
fi
done

if [ "$extras" = 1 ]; then
  # Run from bazel-bin: the tests find daemon/refitd_testing there. Each makes its own
  # namespaces (fleets-<pid>-*) and removes them.
  echo
  echo "=== relay replacement, timed (tests/fleet_netns_test: 4 engine nodes, 200 Mbit/s, 64 MiB)"
  (cd "$bin" && tests/fleet_netns_test "netns fleet: a relay killed mid-version is replaced*" \
    9>&- 2>&1) | grep -E '^relay killed|test cases|FAILED' || true
  echo
  echo "=== sites (tests/fleet_sites_test: 3 nodes in site a, 3 in b, 100 Mbit/s between, 32 MiB)"
  (cd "$bin" && tests/fleet_sites_test "netns sites: each version crosses the slow link once*" \
    9>&- 2>&1) | grep -E '^sites|^  |test cases|FAILED' || true
fi
