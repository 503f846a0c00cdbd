#!/usr/bin/env bash
# Bazel's --workspace_status_command (.bazelrc): the version refitd and refitctl are built with,
# VERSION plus a mark for a dirty git tree (scripts/ship/version.sh). A STABLE_ key: when it changes,
# only the version header and what includes it are rebuilt.
set -euo pipefail
echo "STABLE_REFIT_VERSION $("$(dirname "${BASH_SOURCE[0]}")/../scripts/ship/version.sh")"
