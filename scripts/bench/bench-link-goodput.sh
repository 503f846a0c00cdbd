#!/usr/bin/env bash
# What the fan-out's links deliver without refit: the topology of scripts/bench/bench-fanout.sh
# (K + 1 network namespaces on one bridge, a tbf qdisc on both ends of each veth: --rate, burst
# 256 KiB, --latency) and plain TCP between them (tests/bench/tcp_goodput.py), in three patterns:
#   one flow        node 1 -> node 0: the reference (what bench-fanout's K = 1 sees);
#   K into one      nodes 1..K each send MiB/K to node 0 at once (a puller reading from K relays);
#   all to all      nodes 1..K each send MiB/(K-1) to every other (K-1 flows out of and into
#                   each node at once: the relays' mesh at K);
# --runs times each. Prints each receiver's goodput in Mbit/s beside the link rate. Where
# T(K)/T(1) of bench-fanout exceeds the simulator's, this says how much of it the links' TCP
# goodput under many flows explains (docs/benchmarks.md, "Where T(8)/T(1) goes").
# Needs root (namespaces, tc). Usage:
#   scripts/bench/bench-link-goodput.sh [--engines 8] [--rate 100mbit] [--latency 20ms]
#                                       [--mib 48] [--runs 3]
set -uo pipefail
cd "$(dirname "$0")/../.."
k=8 rate=100mbit latency=20ms mib=48 runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --engines) k="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --latency) latency="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-link-goodput: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "bench-link-goodput: needs root (network namespaces, tc)" >&2; exit 1; }
p=refit-goodput
py=/usr/bin/python3
tool=tests/bench/tcp_goodput.py
bytes=$((mib << 20))

remove_network() {
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^$p-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}
trap remove_network EXIT
remove_network
ip netns add "$p-sw"
ip -n "$p-sw" link set lo up
ip -n "$p-sw" link add br0 type bridge
ip -n "$p-sw" link set br0 up
for i in $(seq 0 "$k"); do
  ns="$p-$i"
  ip netns add "$ns"
  ip -n "$p-sw" link add "p$i" type veth peer name "n$i"
  ip -n "$p-sw" link set "n$i" netns "$ns"
  ip -n "$ns" link set "n$i" name eth0
  ip -n "$ns" addr add "198.19.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$p-sw" link set "p$i" master br0
  ip -n "$p-sw" link set "p$i" up
  ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency "$latency"
  ip netns exec "$p-sw" tc qdisc replace dev "p$i" root tbf rate "$rate" burst 256kb \
    latency "$latency"
done
recv() { ip netns exec "$p-$1" "$py" "$tool" recv "$2" "$3" | awk '{print $(NF-4)}'; }
# send FROM TO PORT BYTES [AT]: AT (epoch seconds) lines up the senders of one pattern.
send() { ip netns exec "$p-$1" "$py" "$tool" send "198.19.0.$(($2 + 1))" "$3" "$4" "${5:-0}"; }
at() { echo "$(date +%s.%N) + $1" | bc; }

echo "bench-link-goodput: $(date -u '+%Y-%m-%d %H:%M UTC'), K = $k, links tbf rate $rate burst 256kb latency $latency, ${mib} MiB per receiver, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$runs"); do
  port=$((5000 + 3 * r))
  recv 0 "$port" 1 > "/tmp/$p.one" &
  sleep 0.3
  send 1 0 "$port" "$bytes"
  wait
  recv 0 $((port + 1)) "$k" > "/tmp/$p.into" &
  sleep 0.3
  start=$(at 2)
  for i in $(seq 1 "$k"); do send "$i" 0 $((port + 1)) $((bytes / k)) "$start" & done
  wait
  for i in $(seq 1 "$k"); do recv "$i" $((port + 2)) $((k - 1)) > "/tmp/$p.all$i" & done
  sleep 0.5
  start=$(at 4)
  for i in $(seq 1 "$k"); do
    for j in $(seq 1 "$k"); do
      [ "$i" = "$j" ] || send "$i" "$j" $((port + 2)) $((bytes / (k - 1))) "$start" &
    done
  done
  wait
  echo "run $r: one flow $(cat "/tmp/$p.one") Mbit/s; $k into one $(cat "/tmp/$p.into") Mbit/s;" \
    "all to all, per node: $(cat /tmp/$p.all* | sort -n | tr '\n' ' ')Mbit/s"
done
rm -f /tmp/$p.*
