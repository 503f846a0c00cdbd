#!/usr/bin/env bash
# Clang's thread-safety analysis over refitd's sources: every ABSL_GUARDED_BY member read or
# written without its mutex, every ABSL_EXCLUSIVE_LOCKS_REQUIRED function called without it, is an
# error. GCC (the build's compiler) ignores the annotations, so this is where they are checked.
#
#   scripts/check/check-thread-safety.sh            # every daemon source
#   scripts/check/check-thread-safety.sh FILE.cc…   # just these
#
# Syntax only (no code generated): ~2 s a file. Needs clang (install-deps.sh) and the generated
# protobuf headers, which it builds with Bazel first.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLANG=${CLANG:-clang++}
command -v "$CLANG" >/dev/null || { echo "check-thread-safety: $CLANG not found (scripts/install/install-deps.sh installs clang)" >&2; exit 1; }

bazel build ${BAZEL_FLAGS:-} //proto/... >/dev/null 2>&1 || bazel build ${BAZEL_FLAGS:-} //proto/...
GEN=$(bazel info bazel-bin 2>/dev/null)

if [[ $# -gt 0 ]]; then
  FILES=("$@")
else
  # Production sources of the daemon and the C++ client (tests and benches hold no guarded state
  # of their own; client/cuda_ipc.cc is built only with the CUDA toolkit and locks nothing).
  mapfile -t FILES < <(git ls-files 'daemon/*.cc' 'client/*.cc' |
                       grep -v -e '_test\.cc$' -e '_bench\.cc$' -e '^client/cuda_ipc\.cc$')
fi

FLAGS=(-std=c++17 -fsyntax-only -I. -I"$GEN"
       $(pkg-config --cflags grpc++ spdlog ucx libzstd libxxhash protobuf 2>/dev/null)
       -Wthread-safety -Wthread-safety-beta -Werror=thread-safety -Werror=thread-safety-beta
       -Wno-unknown-warning-option -Wno-thread-safety-negative)

export CLANG GEN
status=0
printf '%s\n' "${FILES[@]}" |
  xargs -P "$(nproc)" -I{} sh -c '"$0" "$@" {} 2>&1 || echo "FAILED: {}"' "$CLANG" "${FLAGS[@]}" \
  > /tmp/check-thread-safety.$$ || true
if grep -q -e "FAILED:" -e "error:" /tmp/check-thread-safety.$$; then
  grep -v "^In file included" /tmp/check-thread-safety.$$ >&2
  status=1
fi
rm -f /tmp/check-thread-safety.$$
if [[ $status -eq 0 ]]; then
  echo "check-thread-safety: ${#FILES[@]} files, no lock errors"
fi
exit $status
