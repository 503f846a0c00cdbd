#!/usr/bin/env bash
# Checks the GPU bundle the way a GPU machine will meet it: copied out of the checkout, run with
# a bare environment. Builds it first (scripts/gpu-bundle.sh, needs the CUDA toolkit; a few
# minutes) unless given one. Without a GPU, run.sh must exit 77; with one, 0. Either way: at
# most 80 MiB, at most 8 result files with summary.txt first, nothing that points back into the
# checkout, and every library a bundled binary loads (but glibc and the driver) from the bundle.
# Not part of `bazel test //...` (it needs --config=cuda); run it after changing the bundle.
#
# Usage: scripts/gpu/gpu-bundle-test.sh [BUNDLE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
work=$(mktemp -d /tmp/bundle-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "gpu-bundle-test: FAILED: $*"; failures=$((failures + 1)); }
ok() { echo "gpu-bundle-test: ok: $*"; }
# expect OK_MESSAGE FAIL_MESSAGE COMMAND...: ok or fail as COMMAND succeeds.
expect() {
  local ok_message=$1 fail_message=$2
  shift 2
  if "$@"; then ok "$ok_message"; else fail "$fail_message"; fi
}

src="${1:-}"
if [ -z "$src" ]; then
  src="$work/built"
  scripts/gpu-bundle.sh "$src" >"$work/build.log" 2>&1 || {
    tail -n 30 "$work/build.log"
    fail "scripts/gpu-bundle.sh"
    exit 1
  }
  tail -n 2 "$work/build.log"
fi
copy="$work/bundle"
cp -a "$src" "$copy" || exit 1

size=$(du -sb "$copy" | cut -f1)
expect "size $size bytes <= 80 MiB" "size $size bytes > 80 MiB" [ "$size" -le $((80 << 20)) ]
if grep -rlI -- "$root" "$copy" --exclude=MANIFEST.txt >/dev/null 2>&1; then
  fail "files in the bundle name the checkout ($root): $(grep -rlI -- "$root" "$copy" --exclude=MANIFEST.txt | head -n 3)"
else
  ok "nothing in the bundle names the checkout"
fi
outside=""
while read -r binary; do
  outside+=$(LD_LIBRARY_PATH="$copy/lib" ldd "$binary" |
    awk -v c="$copy/" '$2 == "=>" && index($3, c) != 1 { print $1, $3 }' |
    grep -Ev '^(libc|libm|libpthread|libdl|librt|libresolv)\.so' |
    sed "s|^|$(basename "$binary"): |; s|\$|; |")
done < <(find "$copy/libexec" -type f)
expect "every non-glibc library comes from the bundle" \
  "libraries from outside the bundle: $outside" [ -z "$outside" ]

# A bare environment: no Bazel, no toolkit, no checkout on PATH.
out="$work/out"
start=$(date +%s)
env -i PATH=/usr/bin:/bin HOME="$work" OUT="$out" timeout 600 "$copy/run.sh" >"$work/run.log" 2>&1
rc=$?
took=$(($(date +%s) - start))
if nvidia-smi -L >/dev/null 2>&1; then want=0; else want=77; fi
expect "run.sh exited $rc (want $want) in ${took}s" \
  "run.sh exited $rc, want $want: $(cat "$work/run.log")" [ "$rc" -eq "$want" ]
[ "$took" -le 540 ] || fail "run.sh took ${took}s, more than 9 minutes"
files=$(find "$out" -type f | wc -l)
expect "$files result file(s)" "$files result files, more than 8" [ "$files" -le 8 ]
if [ -f "$out/summary.txt" ] && head -n 1 "$out/summary.txt" | grep -q '^refit GPU bundle run'; then
  # Created first (it is appended to until the end): the oldest birth time, where the file
  # system records one.
  first=$(stat -c '%.9W %n' "$out"/* | sort -n | sed -n '1s|.*/||p')
  if stat -c %W "$out/summary.txt" | grep -qv '^0$'; then
    expect "summary.txt was created first" "$first was created before summary.txt" \
      [ "$first" = summary.txt ]
  fi
  ok "summary.txt: $(tail -n 1 "$out/summary.txt")"
else
  fail "no summary.txt, or not run.sh's"
fi
# Without a GPU: a dry run, every step, to see each binary start and get as far as asking for
# a device (libraries, wrappers, the tests finding daemon/refitd and cuda/ipc_exporter).
if [ "$want" -eq 77 ]; then
  dry="$work/dry"
  env -i PATH=/usr/bin:/bin HOME="$work" OUT="$dry" REFIT_BUNDLE_DRY_RUN=1 timeout 600 \
    "$copy/run.sh" >"$work/dry.log" 2>&1
  rc=$?
  expect "dry run exited 1" "dry run exited $rc, want 1: $(cat "$work/dry.log")" [ "$rc" -eq 1 ]
  # A wrapper that cannot find its binary or launcher exits 126/127: every step must start.
  expect "dry run: every bundle binary started" \
    "dry run: a step could not start its binary: $(grep -E 'exit 12[67]' "$dry/summary.txt")" \
    bash -c "! grep -qE 'exit 12[67]' '$dry/summary.txt'"
  expect "dry run: quantize.log holds both quantize tests" "dry run: quantize.log: $(head -c 2000 "$dry/quantize.log")" \
    [ "$(grep -c 'test cases:' "$dry/quantize.log")" -ge 2 ]
  expect "dry run: runtime.log holds the runtime and the store's sparse GPU test" \
    "dry run: runtime.log: $(head -c 2000 "$dry/runtime.log")" \
    [ "$(grep -c 'test cases:' "$dry/runtime.log")" -ge 2 ]
  expect "dry run: sparse_apply_bench said why" "dry run: bench.txt: $(head -c 2000 "$dry/bench.txt")" \
    grep -q 'sparse Apply bench: gpu' "$dry/bench.txt"
  for log in kernels.log quantize.log runtime.log e2e.log; do
    expect "dry run: $log reached the GPU check" "dry run: $log did not: $(head -c 2000 "$dry/$log")" \
      grep -q 'HaveGpu\|DeviceCount() >= 1' "$dry/$log"
  done
  expect "dry run: gpu_bench said why" "dry run: bench.txt: $(head -c 2000 "$dry/bench.txt")" \
    grep -q 'no usable CUDA device' "$dry/bench.txt"
  files=$(find "$dry" -type f | wc -l)
  expect "dry run: $files result files" "dry run: $files result files, more than 8" [ "$files" -le 8 ]
  expect "the bundle's own glibc runs refitd too" "REFIT_BUNDLE_LOADER=1 refitd --version failed" \
    env REFIT_BUNDLE_LOADER=1 "$copy/daemon/refitd" --version
fi
[ "$failures" -eq 0 ] && echo "gpu-bundle-test: PASS" || echo "gpu-bundle-test: $failures check(s) FAILED"
[ "$failures" -eq 0 ]
