#!/usr/bin/env bash
# Prints refit's version. The one source is the top-level VERSION file (N.N.N); a build from a
# git tree with uncommitted or untracked changes says so with a "dirty" mark, written in the
# grammar of where the version goes:
#
#   scripts/ship/version.sh              0.2.0  or 0.2.0~dirty  refitd --version, the .deb (sorts
#                                                          before 0.2.0, so the release upgrades it)
#   scripts/ship/version.sh --image-tag  0.2.0  or 0.2.0-dirty  OCI tags allow no '~' or '+'
#   scripts/ship/version.sh --python     0.2.0  or 0.2.0+dirty  a PEP 440 local version
#
# Bazel reads the same through bazel/workspace_status.sh, so refitd --version prints the first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

base="$(tr -d '[:space:]' < "$root/VERSION")"
if ! [[ "$base" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "version.sh: $root/VERSION holds '$base', not MAJOR.MINOR.PATCH" >&2
  exit 1
fi

dirty=""
if command -v git > /dev/null && git -C "$root" rev-parse --is-inside-work-tree > /dev/null 2>&1
then
  if [ -n "$(git -C "$root" status --porcelain --untracked-files=normal 2> /dev/null)" ]; then
    dirty=1
  fi
fi

case "${1:-}" in
  "" | --deb) echo "$base${dirty:+~dirty}" ;;
  --image-tag) echo "$base${dirty:+-dirty}" ;;
  --python) echo "$base${dirty:++dirty}" ;;
  *)
    echo "usage: scripts/ship/version.sh [--deb|--image-tag|--python]" >&2
    exit 2
    ;;
esac
