#!/usr/bin/env bash
# Builds the GPU bundle (docs/cuda.md "The GPU bundle"): on a machine with the CUDA toolkit
# ($CUDA_PATH, else /usr/local/cuda; no GPU needed), builds the GPU tests, the GPU benchmark and
# a CUDA refitd with --config=cuda, and packs them with every shared library they load (but the
# driver's libcuda), the Python client with the vLLM engine check (client/python/tests/
# test_vllm_gpu.py; run.sh runs it when given a Python with torch and vLLM), and
# the real bf16 deltas that fit into DIR (default gpu-bundle/ in the
# checkout; a relative DIR is taken from the current directory), at most 80 MiB in all, and
# packs it into DIR.tar.xz (about 25 MiB: what travels to a GPU machine; unpack it there with
# `tar -xJf` and run DIR/run.sh).
# DIR/run.sh then runs the checks on a machine with a GPU and nothing else.
#
# Usage: scripts/gpu-bundle.sh [DIR]
#   REFIT_SHARED_DIR=DIR   where data/deltas is (default ../shared beside the checkout)
#   GPU_BUNDLE_MAX_BYTES=N the size limit (default 80 MiB: the tools, their libraries and one
#                          folder of real deltas, for the kernels' real-data checks)
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
root=$PWD
dir="${1:-$root/gpu-bundle}"
max_bytes=${GPU_BUNDLE_MAX_BYTES:-$((80 << 20))}
cuda="${CUDA_PATH:-/usr/local/cuda}"
say() { echo "gpu-bundle: $*"; }
die() { echo "gpu-bundle: $*" >&2; exit 1; }

[ -x "$cuda/bin/nvcc" ] || die "no CUDA toolkit at $cuda (set CUDA_PATH)"
command -v bazel >/dev/null || die "no bazel on PATH"

# bundle path -> Bazel target; the bundle mirrors the source tree, so that the tests find
# daemon/refitd and cuda/ipc_exporter relative to the bundle as they do in Bazel's runfiles.
declare -A targets=(
  [daemon/refitd]=//daemon:refitd
  [cuda/gpu_kernels_test]=//cuda:gpu_kernels_test
  [cuda/gpu_quantize_test]=//cuda:gpu_quantize_test
  [daemon/store/quant_gpu_test]=//daemon/store:quant_gpu_test
  [daemon/store/sparse_gpu_test]=//daemon/store:sparse_gpu_test
  [daemon/store/sparse_apply_bench]=//daemon/store:sparse_apply_bench
  [cuda/cuda_runtime_test]=//cuda:cuda_runtime_test
  [cuda/ipc_exporter]=//cuda:ipc_exporter
  [cuda/gpu_bench]=//cuda:gpu_bench
  [tests/gpu_e2e_test]=//tests:gpu_e2e_test
)
# --dynamic_mode=off: the tests link refit's own libraries statically (cc_test's default is one
# shared object per cc_library), so the bundle holds only system libraries.
build_flags=(--config=cuda --dynamic_mode=off)
say "building ${targets[*]} with ${build_flags[*]}"
bazel build "${build_flags[@]}" --experimental_convenience_symlinks=ignore "${targets[@]}"
bin=$(bazel info "${build_flags[@]}" bazel-bin 2>/dev/null)

case "$dir" in /*) ;; *) dir="$caller/$dir" ;; esac
# Replaces an earlier bundle, never anything else.
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/MANIFEST.txt" ]; then
  die "$dir exists and is not a GPU bundle; give an empty or new directory"
fi
rm -rf "$dir"
mkdir -p "$dir/libexec" "$dir/lib/ucx" "$dir/lib/glibc"
echo "refit GPU bundle, being built" >"$dir/MANIFEST.txt"  # marks it as one from the start

# ---- binaries: stripped into libexec/, a wrapper at the path the tests expect ----
for path in "${!targets[@]}"; do
  mkdir -p "$dir/libexec/$(dirname "$path")" "$dir/$(dirname "$path")"
  strip -o "$dir/libexec/$path" "$bin/$path"
  up=$(dirname "$path" | sed 's|[^/][^/]*|..|g')  # daemon/store -> ../..
  cat >"$dir/$path" <<EOF
#!/bin/sh
# The bundle's $path (libexec/$path), with the bundle's libraries.
exec "\$(dirname "\$0")/$up/lib/launch.sh" "\$(dirname "\$0")/$up/libexec/$path" "\$@"
EOF
  chmod 755 "$dir/$path"
done

cat >"$dir/lib/launch.sh" <<'EOF'
#!/bin/sh
# Runs a bundle binary with the bundle's libraries (lib/), under the host's glibc, or, with
# REFIT_BUNDLE_LOADER=1, under the bundle's own (lib/glibc/, for hosts with an older glibc;
# the driver's libcuda.so.1 is then looked for on LD_LIBRARY_PATH and the usual driver paths).
lib="$(cd "$(dirname "$0")" && pwd)"
if [ "${REFIT_BUNDLE_LOADER:-0}" = 1 ]; then
  driver="${LD_LIBRARY_PATH:-}:/usr/lib64:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu"
  driver="$driver:/usr/local/nvidia/lib64:/usr/lib/wsl/lib"
  exec "$lib/glibc/ld-linux-x86-64.so.2" --library-path "$lib/glibc:$lib:$driver" "$@"
fi
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$@"
EOF
chmod 755 "$dir/lib/launch.sh"
install -m 755 scripts/gpu/gpu-bundle-run.sh "$dir/run.sh"

# ---- shared libraries: whatever the binaries and UCX's transport modules load ----
glibc_libs='^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libresolv\.so\.2)$'
cache=$(ldconfig -p)
ucx_modules=$(dirname "$(sed -n 's/.*libucs\.so\.0 (.*) => //p' <<<"$cache" | sed -n 1p)")/ucx
# Only the modules that shared memory and tcp need (cma); ib and rdmacm would pull in verbs.
mapfile -t objects < <(find "$dir/libexec" -type f)
if [ -e "$ucx_modules/libuct_cma.so.0" ]; then
  cp -L "$ucx_modules/libuct_cma.so.0" "$dir/lib/ucx/"
  objects+=("$dir/lib/ucx/libuct_cma.so.0")
fi
needed=$(for object in "${objects[@]}"; do ldd "$object"; done |
  awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u)
while read -r name path; do
  [ -n "$name" ] || continue
  case "$name" in
    libcuda.so*|libnvidia*) die "$name is linked; the driver provides it and it must not be" ;;
  esac
  if [[ "$name" =~ $glibc_libs ]]; then
    cp -L "$path" "$dir/lib/glibc/$name"
  else
    cp -L "$path" "$dir/lib/$name"
  fi
done <<<"$needed"
# The loader and the glibc pieces that are dlopened or used by the loader mode.
for name in ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1; do
  path=$(awk -v n="$name" '$1 == n && /x86-64/ { print $NF }' <<<"$cache" | sed -n 1p)
  [ -n "$path" ] && cp -L "$path" "$dir/lib/glibc/$name"
done
[ -e "$dir/lib/glibc/ld-linux-x86-64.so.2" ] ||
  cp -L /lib64/ld-linux-x86-64.so.2 "$dir/lib/glibc/ld-linux-x86-64.so.2"
chmod 755 "$dir/lib/glibc/ld-linux-x86-64.so.2"

# Every library a bundled object needs must be in the bundle now.
missing=$(for object in "${objects[@]}" "$dir"/lib/*.so* "$dir"/lib/ucx/*; do
  LD_LIBRARY_PATH="$dir/lib" ldd "$object" 2>/dev/null | grep 'not found' || true
done | sort -u)
[ -z "$missing" ] || die "libraries not found for the bundle: $missing"

# The newest glibc symbol version the non-glibc objects need: hosts with an older glibc use
# the bundle's own (run.sh finds that out by trying).
glibc_needed=$(for object in "${objects[@]}" "$dir"/lib/*.so* "$dir"/lib/ucx/*; do
  objdump -T "$object" 2>/dev/null | grep -o 'GLIBC_[0-9.]*'
done | sort -uV | tail -n 1)

# ---- the real bf16 deltas: whole folders, as many as fit; else the first versions of one ----
shared="${REFIT_SHARED_DIR:-$root/../shared}"
data_note="none (no $shared/data/deltas)"
if [ -d "$shared/data/deltas" ]; then
  data_note=""
  mkdir -p "$dir/shared/data/deltas"
  for folder in tiny-llama-lr1e-6 tiny-llama-lr1e-5; do
    src="$shared/data/deltas/$folder"
    [ -d "$src" ] || continue
    have=$(du -sb "$dir" | cut -f1)
    want=$(du -sbL "$src" | cut -f1)
    # Room for MANIFEST.txt and a margin.
    if [ $((have + want + 65536)) -le "$max_bytes" ]; then
      cp -rL "$src" "$dir/shared/data/deltas/$folder"
      chmod -R u+w "$dir/shared/data/deltas/$folder"
      data_note="$data_note $folder"
    elif [ -z "$data_note" ]; then
      # A sample: the manifest and v000, v001, ... while they fit (a base and one step at least).
      sample="$dir/shared/data/deltas/$folder"
      mkdir -p "$sample"
      cp -L "$src/manifest.json" "$sample/"
      kept=0
      for version in "$src"/v0*.bin; do
        have=$(du -sb "$dir" | cut -f1)
        [ $((have + $(stat -Lc %s "$version") + 65536)) -le "$max_bytes" ] || break
        cp -L "$version" "$sample/"
        kept=$((kept + 1))
      done
      if [ "$kept" -ge 2 ]; then
        data_note="$data_note $folder (a sample: its first $kept versions)"
      else
        rm -rf "$sample"
        data_note="$data_note (left out for size: $folder, $want bytes)"
      fi
    else
      data_note="$data_note (left out for size: $folder, $want bytes)"
    fi
  done
fi

# ---- the vLLM engine check (client/python/tests/test_vllm_gpu.py): the Python client with its
# stubs and the test files; run.sh runs it with $REFIT_PYTHON (torch + vllm 0.33, CUDA) ----
bazel build "${build_flags[@]}" --experimental_convenience_symlinks=ignore \
  //client/python:refit_py_stubs
mkdir -p "$dir/client/python/refit/v1" "$dir/client/python/tests"
cp client/python/refit/*.py "$dir/client/python/refit/"
cp "$bin"/client/python/refit/v1/*.py "$dir/client/python/refit/v1/"
cp client/python/pyproject.toml "$dir/client/python/"
cp VERSION "$dir/VERSION"
for f in test_torch_gpu.py test_zero_copy.py bench_zero_copy.py test_vllm_gpu.py test_vllm.py \
  test_fp8.py daemons.py vllm_models.py; do
  cp "client/python/tests/$f" "$dir/client/python/tests/"
done

total=$(du -sb "$dir" | cut -f1)
{
  echo "refit GPU bundle, built $(date -u +%FT%TZ) on $(hostname)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "cuda: $("$cuda/bin/nvcc" --version | grep -o 'release [0-9.]*')"
  echo "glibc: built with $(getconf GNU_LIBC_VERSION); objects need up to $glibc_needed (the bundle's own is in lib/glibc)"
  echo "real deltas:${data_note}"
  echo "size: $total bytes"
  for path in $(printf '%s\n' "${!targets[@]}" | sort); do
    echo "  $path  $(stat -c %s "$dir/libexec/$path") bytes  (${targets[$path]})"
  done
  echo "  lib/: $(find "$dir/lib" -type f | wc -l) files, $(du -sb "$dir/lib" | cut -f1) bytes"
} >"$dir/MANIFEST.txt"
total=$(du -sb "$dir" | cut -f1)
[ "$total" -le "$max_bytes" ] || die "the bundle is $total bytes, over the $max_bytes limit"
rm -f "$dir.tar.xz"
tar -C "$(dirname "$dir")" -cf - "$(basename "$dir")" | xz -T0 -6 >"$dir.tar.xz.part"
mv "$dir.tar.xz.part" "$dir.tar.xz"
say "packed $dir.tar.xz: $(stat -c %s "$dir.tar.xz") bytes"
say "wrote $dir: $total bytes ($(awk -v t="$total" 'BEGIN { printf "%.1f", t / 1048576 }') MiB); real deltas:${data_note}"
say "run it on a GPU machine: OUT=/some/dir $dir/run.sh (exits 0 / 77 no GPU / 1)"
