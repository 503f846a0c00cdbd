#!/usr/bin/env bash
# Checks that every relative link in README.md, CHANGELOG.md and docs/*.md names a file or
# folder inside this repository (anchors are not checked; http(s) and mailto links are
# skipped), and so does every "../....md" path they mention. Prints each broken link as FILE: TARGET and exits 1 if there is any.
# Usage: scripts/check/check-doc-links.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd -P)

broken=0
for doc in README.md CHANGELOG.md docs/*.md; do
  [ -f "$doc" ] || continue
  dir=$(dirname "$doc")
  # Inline links and images: ](target) or ](target "title"); code spans are not links.
  while IFS= read -r target; do
    target=${target%% *}
    target=${target%%#*}
    case "$target" in
      '' | http://* | https://* | mailto:*) continue ;;
    esac
    resolved=$(realpath -m "$dir/$target")
    if [[ "$resolved" != "$root" && "$resolved" != "$root"/* ]]; then
      echo "$doc: $target (outside the repository)"
      broken=1
    elif [ ! -e "$resolved" ]; then
      echo "$doc: $target (no such file)"
      broken=1
    fi
  done < <(sed -e 's/`[^`]*`//g' "$doc" | grep -oE '\]\([^)]+\)' | sed -e 's/^](//' -e 's/)$//')
  # Documents named by a path that climbs out of the folder (e.g. `../shared/design/x.md`),
  # links or not: they must be in the repository too.
  while IFS= read -r target; do
    resolved=$(realpath -m "$dir/$target")
    if [[ "$resolved" != "$root"/* ]]; then
      echo "$doc: $target (a document outside the repository)"
      broken=1
    elif [ ! -e "$resolved" ]; then
      echo "$doc: $target (no such file)"
      broken=1
    fi
  done < <(grep -oE '\.\./[^ `)"]*\.md' "$doc" || true)
done
if [ "$broken" -ne 0 ]; then
  echo "check-doc-links: broken links above" >&2
  exit 1
fi
echo "check-doc-links: every link resolves inside the repository"
