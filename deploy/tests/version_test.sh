#!/usr/bin/env bash
# //deploy:version_test: refitd --version and refitctl --version print the top-level VERSION
# (plus "~dirty" where Bazel built from an unclean git tree, and nothing else), the version
# scripts/ship/package-deb.sh, scripts/ship/build-image.sh and client/python ship under.
#   version_test.sh VERSION REFITD REFITCTL
set -euo pipefail
base="$(tr -d '[:space:]' < "$1")"
[[ "$base" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "FAIL: VERSION holds '$base'" >&2; exit 1; }

check() {  # check WHAT LINE PATTERN
  if ! [[ "$2" =~ $3 ]]; then
    echo "FAIL: $1 printed '$2'; want it to match $3" >&2
    exit 1
  fi
  echo "ok: $1: $2"
}
v="${base//./\\.}"
check "refitd --version" "$("$2" --version)" "^refitd $v(~dirty)? \(cuda: [^)]*\)$"
check "refitctl --version" "$("$3" --version)" "^refitctl $v(~dirty)?$"
# Both binaries carry the same version, dirty mark included.
[ "$("$2" --version | awk '{print $2}')" = "$("$3" --version | awk '{print $2}')" ] ||
  { echo "FAIL: refitd and refitctl disagree" >&2; exit 1; }
