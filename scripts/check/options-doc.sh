#!/usr/bin/env bash
# Rewrites the flag reference in docs/api.md (between "<!-- options:begin -->" and
# "<!-- options:end -->") from refitd's option table (daemon/config/option_table.cc).
# daemon/config:options_doc_test fails until this has been run after a change to the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
bazel build //daemon/config:options_doc >/dev/null
generated=$(bazel-bin/daemon/config/options_doc)
python3 - "$generated" <<'PY'
import re, sys
path = "docs/api.md"
text = open(path).read()
begin, end = "<!-- options:begin -->\n", "<!-- options:end -->"
a, b = text.index(begin) + len(begin), text.index(end)
open(path, "w").write(text[:a] + sys.argv[1] + "\n" + text[b:])
PY
echo "docs/api.md: flag reference rewritten"
