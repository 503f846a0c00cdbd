#!/usr/bin/env bash
# Creates (or finds, already made) the Python test environment: a virtual environment of
# Debian's /usr/bin/python3 (python3-venv) holding exactly client/python/requirements-test.txt
# (torch 2.x from PyPI, transformers, ...), at a stable path OUTSIDE the checkout named by the
# hash of that file:
#
#     ${REFIT_VENV_ROOT:-/var/cache/refit-python}/venv-<first 16 hex digits of its sha256>
#
# so fresh clones on one machine share it and it is rebuilt only when the pins change. (Not
# /var/cache/refit: that is refitd's CacheDirectory, which purging the refit .deb removes, as
# scripts/ship/test-packages.sh does.)
# Idempotent: with the stamp file `.refit-complete` in place (written last, after
# `pip check`), it does nothing but print the path. A half-made venv (no stamp) is removed and
# made again. Concurrent runs wait for each other (flock). Without write access to
# /var/cache/refit-python (not root) the default root is ~/.cache/refit-python.
#
# Prints the venv's python as its last line of output; `--print` prints only that path and
# installs nothing (exit 1 when the venv is not complete). A cold install downloads about
# 5 GB (the CUDA builds of torch and vllm 0.33 with their kernels) into a ~10 GB venv and took
# 8.5 minutes on this project's 2-core machine under load (docs/engines.md).
# Environment venvs of older pins are removed when unused for 14 days.
#
# Then, layered over it, the SGLang environment of the engine tests:
#
#     <root>/venv-sglang-<first 16 hex digits of sha256(requirements-test.txt +
#                                                        requirements-sglang.txt)>
#
# a venv whose site-packages holds only client/python/requirements-sglang.txt (sglang 0.5.23
# and the few modules it imports that the main venv lacks, `pip install --no-deps`: sglang's
# own pins conflict with vllm's) and a .pth file appending the main venv's site-packages. About
# 300 MB, made in seconds; its stamp is `.refit-complete` too. `--print-sglang` prints its
# python (exit 1 when not made). client/python/run_python_test.sh --sglang finds it.
set -euo pipefail
root_dir="$(cd "$(dirname "$0")/../.." && pwd)"
req="$root_dir/client/python/requirements-test.txt"
python=/usr/bin/python3

base="${REFIT_VENV_ROOT:-}"
if [ -z "$base" ]; then
  base=/var/cache/refit-python
  if ! mkdir -p "$base" 2> /dev/null || [ ! -w "$base" ]; then
    base="${XDG_CACHE_HOME:-$HOME/.cache}/refit"
  fi
fi
req_sglang="$root_dir/client/python/requirements-sglang.txt"
hash="$(sha256sum "$req" | cut -c1-16)"
venv="$base/venv-$hash"
stamp="$venv/.refit-complete"
sglang_hash="$(cat "$req" "$req_sglang" | sha256sum | cut -c1-16)"
sglang_venv="$base/venv-sglang-$sglang_hash"

if [ "${1:-}" = "--print" ]; then
  [ -f "$stamp" ] || exit 1
  echo "$venv/bin/python"
  exit 0
fi
if [ "${1:-}" = "--print-sglang" ]; then
  [ -f "$sglang_venv/.refit-complete" ] || exit 1
  echo "$sglang_venv/bin/python"
  exit 0
fi

# The SGLang overlay (see the header); the main venv is complete when this runs.
make_sglang_overlay() {
  if [ -f "$sglang_venv/.refit-complete" ]; then
    touch "$sglang_venv/.refit-complete"
    return 0
  fi
  local t0
  t0=$(date +%s)
  echo "install-python-env: creating $sglang_venv from $req_sglang over $venv"
  rm -rf "$sglang_venv"
  "$python" -m venv "$sglang_venv"
  local site main_site
  site="$("$sglang_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  main_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  echo "$main_site" > "$site/_refit_main_venv.pth"
  "$sglang_venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
    --require-virtualenv --no-deps -r "$req_sglang"
  # What the engine tests import, on this machine's CPU (no pip check: sglang's own pins
  # conflict with the main venv's by design).
  "$sglang_venv/bin/python" -c 'import sglang, vllm, torch
import sglang.srt.models.llama, sglang.srt.models.qwen3_moe, sglang.srt.models.deepseek_v2
import sglang.srt.layers.quantization.fp8
import sglang.srt.model_executor.model_runner_components.weight_updater
print("install-python-env: sglang", sglang.__version__, "over torch", torch.__version__,
      "vllm", vllm.__version__)' 2>&1 | grep '^install-python-env' || {
    echo "install-python-env: the SGLang overlay does not import" >&2
    return 1
  }
  cp "$req_sglang" "$sglang_venv/requirements-sglang.txt"
  touch "$sglang_venv/.refit-complete"
  echo "install-python-env: SGLang overlay done in $(($(date +%s) - t0)) s"
}

mkdir -p "$base"
exec 9> "$base/.lock"
flock 9

if [ -f "$stamp" ]; then
  touch "$stamp"
  ln -sfn "venv-$hash" "$base/venv-current"
  echo "install-python-env: up to date ($venv)"
  make_sglang_overlay >&2
  echo "$venv/bin/python"
  exit 0
fi

if ! "$python" -c 'import venv, ensurepip' 2> /dev/null; then
  echo "install-python-env: $python has no venv/ensurepip: apt-get install python3-venv" \
    "(scripts/install/install-deps.sh)" >&2
  exit 1
fi

start=$(date +%s)
echo "install-python-env: creating $venv from $req (a cold install: a few minutes)"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
  --require-virtualenv -r "$req"
"$venv/bin/python" -m pip check
# vLLM's CUDA wheel on a machine without a GPU: its CPU platform (what the tests use).
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import torch, transformers, grpc, google.protobuf
import vllm, vllm.distributed.weight_transfer
print("install-python-env: torch", torch.__version__, "transformers", transformers.__version__,
      "vllm", vllm.__version__)'
cp "$req" "$venv/requirements-test.txt"
touch "$stamp"
# A stable name for the newest complete environment (client/python/run_python_test.sh falls
# back to it when $REFIT_PYTHON is not set).
ln -sfn "venv-$hash" "$base/venv-current"
echo "install-python-env: done in $(($(date +%s) - start)) s"

# Environments of other pins that nobody used for 14 days.
find "$base" -maxdepth 2 -name .refit-complete -mtime +14 -printf '%h\n' 2> /dev/null |
  while read -r old; do
    [ "$old" = "$venv" ] || [ "$old" = "$sglang_venv" ] || rm -rf "$old"
  done
make_sglang_overlay >&2
echo "$venv/bin/python"
