#!/usr/bin/env bash
# The two-node benchmark on this one machine: two refitd on temporary sockets act as the
# trainer's node and the engine's node (the engine's daemon has --peers=<the trainer's>), both
# with the same UCX_TLS. For each UCX_TLS it runs tests/bench:two_node_bench with 1 tensor and
# with 20,000 tensors of the same ~1 GiB, and in the same run the references:
#   ucx_perftest -t ucp_get with the daemon's chunk size (4 MiB), two processes on 127.0.0.1,
#     same UCX_TLS, twice before and twice after the refit runs of that UCX_TLS (median of 4);
#   a torch.distributed gloo broadcast of the same bytes, one sender and one receiver on
#     loopback (tests/bench/gloo_broadcast.py, Debian's python3-torch), before the first and
#     after the last UCX_TLS (median over all rounds).
# References are interleaved with the refit runs because this kind of machine is noisy.
# ucx_perftest reads the same 4 MiB buffer every iteration (cache-warm, UCX-allocated memory);
# refit moves 1 GiB of distinct bytes. A second ucx_perftest moves the whole model as one
# message (not cache-resident): the memory-bandwidth ceiling of a get of those bytes.
# It prints every figure next to the others with the ratios refit/ucx_perftest (goal >= 0.9)
# and refit/gloo (goal >= 3), and which UCX lanes the data went over (from UCX_LOG_LEVEL=info).
#
# refitd's UCX endpoints use peer-failure handling, which UCX 1.13's shared-memory transports
# refuse unless UCX_POSIX_ERROR_HANDLING=y / UCX_SYSV_ERROR_HANDLING=y; a --tls entry ending in
# "+eh" (e.g. sm,tcp+eh) sets both, for ucx_perftest and the daemons alike.
# The first --warmup versions are left out of the medians: each of the first retain+1 (3)
# versions allocates a new staging slot on the engine's node.
#
# --mtls "off on" runs every refit case with the peer plane in plaintext and with mutual TLS
# (certificates made here with openssl: one CA, one certificate per node; --tls-cert/-key/-ca),
# in that order, and the summary gives on/off per case; repeat entries ("off on off on") to
# interleave them on a noisy machine (medians per mode). The default is "off". TLS covers
# the gRPC peer plane (announcements, pins, checksums); the UCX data plane is not TLS.
#
# --engine "bf16 fp8" runs every refit case once per engine dtype, in that order: bf16 (the
# engine holds the trainer's bf16) and fp8 (FP8_E4M3 destinations with [128, 128] block scales
# in FP32 "<name>_scale_inv" tensors, quantized on the engine's node as the pulled bytes land).
# With fp8 in the list both use the same 2-D tensors [rows, 8192], and the summary gives
# fp8 / bf16 for publish -> complete, Apply and both (issue 34's goal: <= 1.3x), and beside them
# each daemon's CPU seconds per version and the bytes the engine's node pulled (fp8 / bf16). The
# default is "bf16" (1-D tensors, as before). Every two_node_bench row prints both daemons' CPU
# seconds for that version (publish -> complete -> Apply) beside its wall times.
#
# --density F makes every version after the first an RL-like step (F of the elements move by one
# unit in the last place) so that deltas carry them; the default 0 changes every byte.
#
# Usage: scripts/bench/bench-two-node.sh [--tls "tcp sm,tcp sm,tcp+eh"] [--tensors "1 20000"]
#                                  [--versions 5] [--warmup 3] [--mib 1024] [--density 0]
#                                  [--engine-shard none|rows|cols] [--engine "bf16 fp8"]
#                                  [--no-build] [--keep]
#                                  [--bin DIR] [--mtls "off on"]
# --bin DIR: the binaries of another build (a bazel-bin directory holding daemon/refitd,
# client/refitctl and tests/bench/two_node_bench), not built here: run it once per build, in
# turn, for a before/after (tests/bench/ab-two-node.sh does that for the refit runs alone).
# --engine-shard rows|cols: the engine holds half of one 2-D tensor, contiguous (rows) or
# resharded (cols: one range per row); compare the two for resharded / unresharded.
# Environment: BAZEL_OUTPUT_BASE=<dir> builds in that Bazel output base, without convenience
# symlinks (for machines where other builds share the checkout).
set -euo pipefail
cd "$(dirname "$0")/../.."

tls_list="tcp sm,tcp sm,tcp+eh"
tensor_list="1 20000"
versions=5
warmup=3
mib=1024
density=0
engine_shard=none
build=1
keep=0
bin_dir=
mtls_list=off
engine_list=bf16
while [ $# -gt 0 ]; do
  case "$1" in
    --tls) tls_list="$2"; shift 2 ;;
    --tls=*) tls_list="${1#*=}"; shift ;;
    --tensors) tensor_list="$2"; shift 2 ;;
    --tensors=*) tensor_list="${1#*=}"; shift ;;
    --versions) versions="$2"; shift 2 ;;
    --versions=*) versions="${1#*=}"; shift ;;
    --warmup) warmup="$2"; shift 2 ;;
    --warmup=*) warmup="${1#*=}"; shift ;;
    --mib) mib="$2"; shift 2 ;;
    --mib=*) mib="${1#*=}"; shift ;;
    --engine-shard) engine_shard="$2"; shift 2 ;;
    --engine-shard=*) engine_shard="${1#*=}"; shift ;;
    --density) density="$2"; shift 2 ;;
    --density=*) density="${1#*=}"; shift ;;
    --no-build) build=0; shift ;;
    --bin) bin_dir="$2"; build=0; shift 2 ;;
    --bin=*) bin_dir="${1#*=}"; build=0; shift ;;
    --keep) keep=1; shift ;;
    --engine) engine_list="$2"; shift 2 ;;
    --engine=*) engine_list="${1#*=}"; shift ;;
    --mtls) mtls_list="$2"; shift 2 ;;
    --mtls=*) mtls_list="${1#*=}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-two-node: unknown argument $1" >&2; exit 2 ;;
  esac
done

bazel_cmd=(bazel)
build_flags=()
if [ -n "${BAZEL_OUTPUT_BASE:-}" ]; then
  bazel_cmd+=(--output_base="$BAZEL_OUTPUT_BASE")
  build_flags+=(--experimental_convenience_symlinks=ignore)
fi
if [ "$build" = 1 ]; then
  ./scripts/install/install-deps.sh
  "${bazel_cmd[@]}" build "${build_flags[@]}" //daemon:refitd //client:refitctl \
    //tests/bench:two_node_bench
fi
bin="${bin_dir:-$("${bazel_cmd[@]}" info bazel-bin 2>/dev/null)}"
python=/usr/bin/python3
chunk=$((4 << 20))  # the data plane's chunk (daemon/peer/data_plane.h, DataPlaneOptions)

work=$(mktemp -d /tmp/refit-bench-XXXXXX)
pids=()
. scripts/bench/lib/daemons.sh  # (from the repository root)
cleanup() {
  bench_stop_pids
  if [ "$keep" = 1 ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$(date +%s)
echo "bench-two-node: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  $(ucx_info -v | head -1 | sed 's/# //'), model ${mib} MiB bf16, ${versions} versions (+${warmup} warm-up), tensors: ${tensor_list}"

# The environment of every UCX process for --tls entry $1: UCX_TLS, info logging (it names the
# lanes UCX picked), the TCP send and receive segments refitd sets by default (2 MiB: so
# ucx_perftest runs with the same tuning; an operator's UCX_TCP_TX_SEG_SIZE /
# UCX_TCP_RX_SEG_SIZE win for both), and shared-memory peer-failure support for "+eh" entries.
set_ucx_env() {
  ucx_env=(UCX_TLS="${1%+eh}" UCX_LOG_LEVEL=info UCX_WARN_UNUSED_ENV_VARS=n
           UCX_TCP_TX_SEG_SIZE="${UCX_TCP_TX_SEG_SIZE:-2m}"
           UCX_TCP_RX_SEG_SIZE="${UCX_TCP_RX_SEG_SIZE:-2m}")
  case "$1" in
    *+eh) ucx_env+=(UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y) ;;
  esac
}

# ucx_perftest ucp_get between two processes on 127.0.0.1; prints "<GB/s> <lanes>". With a
# second argument, messages of that size (the whole model: 4 iterations, 1 warm-up) instead of
# the chunk size.
perftest() {
  local tag="$1" size="${2:-$chunk}" port=$((20000 + RANDOM % 20000))
  local n=$(( (mib << 20) / size )) w=16
  if [ "$size" != "$chunk" ]; then n=4; w=1; fi
  [ "$n" -lt 4 ] && n=4
  env "${ucx_env[@]}" timeout 180 ucx_perftest -t ucp_get -s "$size" -n "$n" -w "$w" -p "$port" \
    >"$work/perftest-$tag-server.log" 2>&1 &
  local server=$!
  local out="$work/perftest-$tag-client.log"
  for _ in $(seq 50); do
    if env "${ucx_env[@]}" timeout 120 ucx_perftest 127.0.0.1 -t ucp_get \
         -s "$size" -n "$n" -w "$w" -p "$port" -f >"$out" 2>&1; then
      break
    fi
    sleep 0.2
  done
  wait "$server" 2>/dev/null || true
  # The last row: iterations, latency 50%/avg/overall, bandwidth avg/overall (MiB/s), rates.
  local mibs
  mibs=$({ grep -E '^ +[0-9]+ ' "$out" || true; } | tail -1 | awk '{print $6}')
  local lanes
  lanes=$(lanes_in "$out")
  awk -v m="${mibs:-0}" 'BEGIN { printf "%.4f ", m * 1048576 / 1e9 }'
  echo "${lanes:-none}"
}

wait_healthy() { bench_wait_healthy "$bin/client/refitctl" "$@"; }

# A CA and a certificate for each node (CN = its --node), for --mtls on.
make_certificates() {
  local d="$work/pki" n
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=bench-ca -keyout "$d/ca.key" \
    -out "$d/ca.crt" >/dev/null 2>&1
  for n in trainer-node engine-node; do
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$n" -keyout "$d/$n.key" -out "$d/$n.csr" \
      >/dev/null 2>&1
    openssl x509 -req -in "$d/$n.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
      -days 2 -out "$d/$n.crt" >/dev/null 2>&1
  done
}
# The --tls-* flags of node $2 for mode $1 (off: none).
tls_flags() {
  [ "$1" = on ] || return 0
  echo "--tls-cert=$work/pki/$2.crt --tls-key=$work/pki/$2.key --tls-ca=$work/pki/ca.crt"
}

# Starts the two daemons (environment: ucx_env) into $work/$1-{trainer,engine}.{sock,log}, with
# mutual TLS when $2 is "on".
start_daemons() {
  local tag="$1" mtls="${2:-off}"
  # shellcheck disable=SC2046  # the flags are words
  env "${ucx_env[@]}" "$bin/daemon/refitd" --socket="$work/$tag-trainer.sock" \
    --listen=127.0.0.1:0 --node=trainer-node $(tls_flags "$mtls" trainer-node) \
    >"$work/$tag-trainer.log" 2>&1 &
  trainer=$!
  pids+=("$trainer")
  wait_healthy "$work/$tag-trainer.sock" "$work/$tag-trainer.log"
  port=$("$bin/client/refitctl" --socket="$work/$tag-trainer.sock" status --json |
         "$python" -c 'import json,sys; d=json.load(sys.stdin); print(d.get("listen_port") or d.get("listenPort"))')
  # shellcheck disable=SC2046
  env "${ucx_env[@]}" "$bin/daemon/refitd" --socket="$work/$tag-engine.sock" \
    --listen=127.0.0.1:0 --node=engine-node --peers="127.0.0.1:$port" \
    $(tls_flags "$mtls" engine-node) >"$work/$tag-engine.log" 2>&1 &
  engine=$!
  pids+=("$engine")
  wait_healthy "$work/$tag-engine.sock" "$work/$tag-engine.log"
}

# The peer plane's bytes (gRPC: plaintext or TLS records, headers and all) both ways on the
# engine's connections to the trainer's peer port, from the kernel's TCP counters: what mutual
# TLS encrypts. "<bytes> <connections>".
peer_plane_bytes() {
  ss -tinH "( dport = :$port )" 2>/dev/null |
    grep -o 'bytes_sent:[0-9]*\|bytes_received:[0-9]*' |
    awk -F: '{ s += $2 } /bytes_sent/ { n++ } END { printf "%d %d\n", s, n }'
}

stop_daemons() {
  kill -TERM "$trainer" "$engine" 2>/dev/null || true
  wait "$trainer" "$engine" 2>/dev/null || true
  pids=()
}

# The distinct UCX lanes (ep_cfg lines) in a log; UCX's own lines reach it when the process exits.
lanes_in() {
  grep -ho 'ep_cfg\[[0-9]*\]: .*' "$@" 2>/dev/null | sed 's/ep_cfg\[[0-9]*\]: //' | sort -u |
    paste -sd';' - | tr -s ' ' | tr ' ' '~' || true
}

# torch.distributed gloo broadcast of the same bytes; $1 names the run.
gloo_broadcast() {
  echo "=== gloo broadcast ($1; torch $("$python" -c 'import torch; print(torch.__version__)'))"
  "$python" tests/bench/gloo_broadcast.py --mib "$mib" --rounds "$versions" --warmup 1 \
    >"$work/gloo-$1.out" 2>&1 || echo "gloo_broadcast.py FAILED"
  cat "$work/gloo-$1.out"
}

results="$work/results.txt"
: >"$results"
[[ " $mtls_list " == *" on "* ]] && make_certificates
echo
gloo_broadcast "before"
for tls in $tls_list; do
  tag=${tls//[,+]/_}
  set_ucx_env "$tls"
  echo
  echo "=== UCX_TLS=$tls (environment: ${ucx_env[*]})"
  read -r pt1 pt_lanes <<<"$(perftest "$tag-1")"
  read -r pt2 _ <<<"$(perftest "$tag-2")"
  echo "ucx_perftest -t ucp_get -s ${chunk} -n $(( (mib << 20) / chunk )) -w 16 (before): $pt1 $pt2 GB/s; lanes: ${pt_lanes//\~/ }"
  matrix_flag=
  [[ " $engine_list " == *" fp8 "* ]] && matrix_flag=--matrix
  for tensors in $tensor_list; do
   round=0
   for mtls in $mtls_list; do
   for engine_dtype in $engine_list; do
    round=$((round + 1))
    run="$tag-$tensors-$mtls-$engine_dtype-$round"
    start_daemons "$run" "$mtls"
    if [ "$mtls" = on ]; then
      grep -q "peer plane: mutual TLS" "$work/$run-engine.log" ||
        { echo "bench-two-node: the engine's refitd has no TLS" >&2; exit 1; }
    fi
    echo "--- refit, $tensors tensor(s), mTLS $mtls, $engine_dtype engine:"
    ok=1
    "$bin/tests/bench/two_node_bench" --trainer-socket="$work/$run-trainer.sock" \
      --engine-socket="$work/$run-engine.sock" --versions="$versions" \
      --warmup="$warmup" --mib="$mib" --tensors="$tensors" --density="$density" --engine-shard="$engine_shard" --timeout=60 \
      --engine="$engine_dtype" $matrix_flag \
      >"$work/bench-$run.out" 2>&1 || ok=0
    cat "$work/bench-$run.out"
    read -r peer_bytes peer_conns <<<"$(peer_plane_bytes)"
    reconnects=$(grep -c 'disconnected' "$work/$run-engine.log" || true)  # before the stop's
    stop_daemons
    echo "peer plane (gRPC$([ "$mtls" = on ] && echo ' over mutual TLS')): $peer_bytes bytes both ways over the run on $peer_conns connection(s); the engine's node lost its peer $reconnects time(s)"
    lanes=$(lanes_in "$work/$run-engine.log")
    lanes=${lanes:-none}
    echo "daemon data-plane lanes (engine's UCX log): ${lanes//\~/ }"
    if [ "$ok" = 0 ]; then
      echo "two_node_bench FAILED with UCX_TLS=$tls; the engine's log says:"
      { grep -E ' [EW] \[|UCX  ERROR' "$work/$run-engine.log" || true; } | sort -u |
        head -5 | sed 's/^/  /'
      echo "tls=$tls mtls=$mtls lanes=$lanes failed=1 tensors=$tensors engine=$engine_dtype" >>"$results"
      continue
    fi
    echo "engine's pull times (announce -> pulled + verified; the first ones allocate staging):"
    { grep -o 'version=[0-9]* pulled [0-9]* bytes in [0-9.]* s' \
        "$work/$run-engine.log" || true; } | sed 's/^/  /'
    if [ "$engine_dtype" = fp8 ]; then
      echo "engine's quantization (after the pull's last bytes; the rest ran as they landed):"
      { grep -o 'version=[0-9]* quantized [0-9]* fp8 boxes in [0-9.]* s' \
          "$work/$run-engine.log" || true; } | sed 's/^/  /'
    fi
    r=$(grep '^RESULT' "$work/bench-$run.out")
    echo "tls=$tls mtls=$mtls lanes=$lanes pt_lanes=$pt_lanes peer_bytes=$peer_bytes reconnects=$reconnects $r" >>"$results"
   done
   done
  done
  read -r pt3 _ <<<"$(perftest "$tag-3")"
  read -r pt4 _ <<<"$(perftest "$tag-4")"
  pt_med=$(printf '%s\n' "$pt1" "$pt2" "$pt3" "$pt4" | sort -g | sed -n '2,3p' |
           awk '{ s += $1 } END { printf "%.4f", s / 2 }')
  echo "ucx_perftest (after): $pt3 $pt4 GB/s; median of the 4: $pt_med GB/s"
  # The same bytes as one message: no longer cache-resident, like refit's versions.
  read -r ptw _ <<<"$(perftest "$tag-whole" "$((mib << 20))")"
  echo "ucx_perftest -t ucp_get -s $((mib << 20)) -n 4 -w 1 (the whole model as one message): $ptw GB/s"
  sed -i "s|^tls=$tls |tls=$tls pt_gbs=$pt_med pt_whole=$ptw pt_all=$pt1,$pt2,$pt3,$pt4 |" "$results"
done

echo
gloo_broadcast "after"
gloo_times=$({ grep -h '^RESULT' "$work"/gloo-*.out || true; } | sed 's/.*gloo_times=//' |
             paste -sd, -)

echo
echo "=== summary (medians; GB = 1e9 bytes; model ${mib} MiB; $(date -u '+%Y-%m-%d %H:%M UTC'); $(( $(date +%s) - started )) s)"
"$python" - "$results" "$gloo_times" "$mib" "$versions" "$warmup" <<'EOF'
import statistics, sys
rows = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in open(sys.argv[1])]
times = [float(t) for t in sys.argv[2].split(",") if t]
gloo = (int(sys.argv[3]) << 20) / 1e9 / statistics.median(times) if times else 0.0
print(f"gloo broadcast: median of {len(times)} rounds (before + after) {gloo:.2f} GB/s")
print(f"{'UCX_TLS':<12} {'tensors':>7} {'transfer s':>10} {'refit GB/s':>10} {'apply GB/s':>10} "
      f"{'perftest':>8} {'refit/pt':>8} {'pt whole':>8} {'refit/ptw':>9} {'gloo':>5} "
      f"{'refit/gloo':>10}  daemon lanes | perftest lanes")
print(f"{'':<12} {'':>7} {'':>10} {'':>10} {'':>10} {'GB/s':>8} {'':>8} {'GB/s':>8} {'':>9} "
      f"{'GB/s':>5}")
cycle = {}
by_mode = {}
engines = {}
for r in rows:
    if not r.get("failed") and r.get("mtls", "off") == "off":
        engines.setdefault((r["tls"], r["tensors"], r.get("engine", "bf16")), []).append(r)
    if not r.get("failed"):
        by_mode.setdefault((r["tls"], r["tensors"], r.get("mtls", "off")), []).append(
            float(r["transfer_s"]))
    if r.get("failed"):
        print(f"{r['tls'] + ('' if r.get('engine', 'bf16') == 'bf16' else '>' + r['engine']):<12} "
              f"{r['tensors']:>7} {'FAILED':>10}  daemon lanes: "
              f"{r['lanes'].replace('~', ' ')}")
        continue
    t, pt, ptw = float(r["transfer_gbs"]), float(r["pt_gbs"]), float(r.get("pt_whole", 0))
    if r.get("mtls", "off") == "off" and r.get("engine", "bf16") == "bf16":
        cycle[(r["tls"], r["tensors"])] = (float(r["transfer_s"]),
                                           float(r["e2e_s"]) + float(r["apply_s"]))
    label = r["tls"] + ("" if r.get("mtls", "off") == "off" else "+mTLS")
    label += "" if r.get("engine", "bf16") == "bf16" else ">" + r["engine"]
    print(f"{label:<12} "
          f"{r['tensors']:>7} {float(r['transfer_s']):>10.3f} {t:>10.2f} "
          f"{float(r['apply_gbs']):>10.2f} {pt:>8.2f} {t / pt if pt else 0:>8.2f} {ptw:>8.2f} "
          f"{t / ptw if ptw else 0:>9.2f} {gloo:>5.2f} "
          f"{t / gloo if gloo else 0:>10.2f}  {r['lanes'].replace('~', ' ')} | "
          f"{r['pt_lanes'].replace('~', ' ')}")
for (tls, tensors), (xfer, full) in cycle.items():
    if tensors != "1" and (tls, "1") in cycle:
        one = cycle[(tls, "1")]
        print(f"UCX_TLS={tls}: {tensors} tensors / 1 tensor: transfer {xfer / one[0]:.2f}x, "
              f"publish+transfer+apply {full / one[1]:.2f}x (goal <= 1.2x)")
for (tls, tensors, mtls), times in sorted(by_mode.items()):
    off = by_mode.get((tls, tensors, "off"))
    if mtls == "on" and off:
        on_s, off_s = statistics.median(times), statistics.median(off)
        print(f"UCX_TLS={tls}, {tensors} tensor(s): transfer with mTLS {on_s:.3f} s, without "
              f"{off_s:.3f} s (medians of {len(times)} and {len(off)} runs): "
              f"{(on_s / off_s - 1) * 100:+.1f} % (goal <= +3 %)")
def med(rs, key):
    return statistics.median(float(r[key]) for r in rs)
for (tls, tensors, engine), rs in sorted(engines.items()):
    ref = engines.get((tls, tensors, "bf16"))
    if engine != "fp8" or not ref:
        continue
    e2e, e2e_ref = med(rs, "e2e_s"), med(ref, "e2e_s")
    app, app_ref = med(rs, "apply_s"), med(ref, "apply_s")
    reg, reg_ref = med(rs, "register_s"), med(ref, "register_s")
    print(f"UCX_TLS={tls}, {tensors} tensor(s), fp8 [128, 128] engine / bf16 engine (same run, "
          f"same 2-D tensors): publish -> complete {e2e:.3f} / {e2e_ref:.3f} s = "
          f"{e2e / e2e_ref:.2f}x; Apply {app:.3f} / {app_ref:.3f} s = {app / app_ref:.2f}x; "
          f"publish -> complete + Apply {(e2e + app) / (e2e_ref + app_ref):.2f}x (goal <= 1.3x); "
          f"register {reg:.3f} / {reg_ref:.3f} s")
    if "engine_cpu_s" in rs[0] and "engine_cpu_s" in ref[0]:
        # The daemons' CPU seconds per version (publish -> complete -> Apply) and the bytes the
        # engine's node pulled: what a loaded machine does not blur the way it blurs wall time.
        ecpu, ecpu_ref = med(rs, "engine_cpu_s"), med(ref, "engine_cpu_s")
        tcpu, tcpu_ref = med(rs, "trainer_cpu_s"), med(ref, "trainer_cpu_s")
        pb, pb_ref = med(rs, "pulled_bytes"), med(ref, "pulled_bytes")
        print(f"  refitd CPU per version: engine's node {ecpu:.3f} / {ecpu_ref:.3f} s = "
              f"{ecpu / ecpu_ref if ecpu_ref else 0:.2f}x, trainer's node {tcpu:.3f} / "
              f"{tcpu_ref:.3f} s; bytes pulled per version {pb:.0f} / {pb_ref:.0f} = "
              f"{pb / pb_ref if pb_ref else 0:.3f}x")
peer = {}
for r in rows:
    if not r.get("failed") and "peer_bytes" in r:
        peer.setdefault((r["tls"], r["tensors"], r.get("mtls", "off")), []).append(
            (int(r["peer_bytes"]), int(r.get("reconnects", 0))))
for (tls, tensors, mtls), runs in sorted(peer.items()):
    print(f"UCX_TLS={tls}, {tensors} tensor(s), mTLS {mtls}: peer plane "
          f"{statistics.median(b for b, _ in runs):.0f} bytes per run (median of {len(runs)}; "
          f"{int(sys.argv[4]) + int(sys.argv[5])} versions each), peer lost "
          f"{sum(c for _, c in runs)} time(s) in all")
print("goals: refit/perftest >= 0.9, refit/gloo >= 3; transfer = Publish returned -> "
      "WaitForVersion returned on the other node; perftest = chunk-sized messages re-reading one "
      "cache-resident buffer (the issue's reference), pt whole = the model as one message")
EOF
