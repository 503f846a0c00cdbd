#!/usr/bin/env bash
# Where the fan-out's links idle: runs scripts/bench/bench-fanout.sh with the given arguments
# while it samples the byte counters of every port of its switch namespace (p0 = the trainer's
# link, pN = engine N's; rx = the node's upload, tx = its download) about every 0.15 s, then
# prints, per second of the run, the trainer's upload and the engines' mean download as shares
# of --rate (docs/benchmarks.md, "Where T(8)/T(1) goes"). Needs root.
# --flows (taken here, not passed on; one K per run): also samples every engine namespace's TCP
# connections (`ss -tin`, bytes_received per peer address, about every 0.3 s) and prints, per
# version, when the stripes landed at their relays and which relay the last bytes came from,
# then, for the last version, what each relay had received of its stripe from the trainer beside
# what the other engines had read of it from that relay (tests/bench/fanout_flows.py): where the
# readers lag their relays, and whether the stripes arrive evenly.
# Usage: scripts/bench/fanout-link-timeline.sh --rate 100mbit [--flows] [bench-fanout.sh arguments]
#   e.g. scripts/bench/fanout-link-timeline.sh --rate 100mbit --engines 8 --sizes 128 --no-gloo
set -uo pipefail
cd "$(dirname "$0")/../.."
rate_bits=100000000
flows=0
args=()
for a in "$@"; do
  if [ "$a" = --flows ]; then flows=1; else args+=("$a"); fi
done
for ((i = 0; i < ${#args[@]}; i++)); do  # --rate: the shares' denominator
  if [ "${args[$i]}" = --rate ]; then
    r="${args[$((i + 1))]}"
    case "$r" in
      *gbit) rate_bits=$(( ${r%gbit} * 1000000000 )) ;;
      *mbit) rate_bits=$(( ${r%mbit} * 1000000 )) ;;
      *) echo "fanout-link-timeline: --rate as Nmbit or Ngbit" >&2; exit 2 ;;
    esac
  fi
done
prefix=${REFIT_TEST_NETNS_PREFIX:+$REFIT_TEST_NETNS_PREFIX-}fleet-fan
samples=$(mktemp /tmp/fanout-links-XXXXXX)
(
  while ! ip netns list | grep -q "^$prefix-sw"; do sleep 0.05; done
  sleep 0.5
  exec ip netns exec "$prefix-sw" bash -c '
    while :; do
      line="$(date +%s.%N)"
      for d in /sys/class/net/p*; do
        [ -e "$d" ] || continue
        line="$line ${d##*/} $(cat "$d/statistics/rx_bytes") $(cat "$d/statistics/tx_bytes")"
      done
      echo "$line"
      sleep 0.1
    done' > "$samples" 2> /dev/null
) &
sampler=$!
flow_samples=$(mktemp /tmp/fanout-flows-XXXXXX)
if [ "$flows" = 1 ]; then
  (
    while ! ip netns list | awk '{print $1}' | grep -qx "$prefix-e1"; do sleep 0.05; done
    sleep 0.3
    while ip netns list | awk '{print $1}' | grep -qx "$prefix-e1"; do
      now=$(date +%s.%N)
      for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-e[0-9]*$"); do
        ip netns exec "$ns" ss -tinH state established 2> /dev/null |
          awk -v t="$now" -v me="${ns##*-e}" '
            $1 ~ /^[0-9]+$/ { peer = $4 }
            /bytes_received:/ { for (k = 1; k <= NF; k++) if ($k ~ /^bytes_received:/) {
              split($k, a, ":"); print t, me, peer, a[2] } }'
      done
      sleep 0.2
    done > "$flow_samples"
  ) &
  flow_sampler=$!
fi
scripts/bench/bench-fanout.sh "${args[@]}"
rc=$?
kill -- "-$sampler" 2> /dev/null || pkill -P "$sampler" 2> /dev/null || true
kill "$sampler" 2> /dev/null || true
if [ "$flows" = 1 ]; then
  # It stops once the namespaces are gone (bench-fanout removes them on exit): let it finish
  # writing, within 5 s.
  for _ in $(seq 50); do kill -0 "$flow_sampler" 2> /dev/null || break; sleep 0.1; done
  kill "$flow_sampler" 2> /dev/null || true
  wait "$flow_sampler" 2> /dev/null
  /usr/bin/python3 tests/bench/fanout_flows.py "$flow_samples" || rc=1
fi
rm -f "$flow_samples"
/usr/bin/python3 - "$samples" "$rate_bits" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    f = line.split()
    try:
        t = float(f[0])
        d = {f[i]: (int(f[i + 1]), int(f[i + 2])) for i in range(1, len(f), 3)}
    except (ValueError, IndexError):
        continue
    if rows and len(d) != len(rows[0][1]):
        continue
    rows.append((t, d))
rate = float(sys.argv[2]) / 8
if len(rows) < 2:
    sys.exit("fanout-link-timeline: no samples")
ports = sorted(rows[0][1], key=lambda p: int(p[1:]))
engines = [p for p in ports if p != "p0"]
buckets = {}
for (t0, d0), (t1, d1) in zip(rows, rows[1:]):
    dt = t1 - t0
    up = (d1["p0"][0] - d0["p0"][0]) / dt / rate
    down = sum((d1[p][1] - d0[p][1]) / dt / rate for p in engines) / max(1, len(engines))
    buckets.setdefault(int(t0 - rows[0][0]), []).append((up, down))
print("second: trainer upload / engines' mean download, as shares of the link rate")
for k in sorted(buckets):
    b = buckets[k]
    print(f"{k:4d}s  {sum(x[0] for x in b) / len(b):.2f} / {sum(x[1] for x in b) / len(b):.2f}")
PY
rm -f "$samples"
exit "$rc"
