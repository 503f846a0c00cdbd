#!/usr/bin/env bash
# Every C++ and CUDA source in the repository is as clang-format (.clang-format) writes it.
#   scripts/check/check-format.sh         # check: lists the files that differ, exits 1 if any
#   scripts/check/check-format.sh --fix   # rewrite them in place
# scripts/test.sh runs the check before the Bazel tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v clang-format >/dev/null ||
  { echo "check-format: clang-format not found (scripts/install/install-deps.sh installs it)" >&2; exit 1; }

mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [[ "${1:-}" == "--fix" ]]; then
  printf '%s\0' "${files[@]}" | xargs -0 clang-format -i
  exit 0
fi
bad=$(printf '%s\0' "${files[@]}" | xargs -0 clang-format --dry-run 2>&1 | grep -oE '^[^:]+:[0-9]+:[0-9]+: warning' | cut -d: -f1 | sort -u || true)
if [[ -n "$bad" ]]; then
  echo "check-format: these files are not as clang-format writes them (scripts/check/check-format.sh --fix):" >&2
  echo "$bad" | sed 's/^/  /' >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
