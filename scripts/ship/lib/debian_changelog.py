#!/usr/bin/python3
"""Writes a Debian changelog (deb-changelog(5)) from CHANGELOG.md, for the .deb's
/usr/share/doc/refit/changelog.gz (refit is a native package: that file is its changelog).

    debian_changelog.py CHANGELOG.md VERSION MAINTAINER

CHANGELOG.md has one `## X.Y.Z (YYYY-MM-DD)` heading per release with `- ` items (continued on
indented lines); each becomes an entry dated that day. VERSION is the package's version; when it
is X.Y.Z~dirty, an entry for it comes first: X.Y.Z's items plus a line saying so, dated now.
"""

import email.utils
import re
import sys
import textwrap
from datetime import datetime, timezone

HEADING = re.compile(r"^## (\d+\.\d+\.\d+) \((\d{4})-(\d{2})-(\d{2})\)\s*$")


def releases(text):
    """[(version, datetime, [item, ...])] in file order."""
    out = []
    for line in text.splitlines():
        m = HEADING.match(line)
        if m:
            day = datetime(int(m[2]), int(m[3]), int(m[4]), 12, tzinfo=timezone.utc)
            out.append((m[1], day, []))
        elif out and line.startswith("- "):
            out[-1][2].append(line[2:].strip())
        elif out and out[-1][2] and line.startswith("  ") and line.strip():
            out[-1][2][-1] += " " + line.strip()
    return out


def entry(version, when, items, maintainer):
    lines = [f"refit ({version}) unstable; urgency=medium", ""]
    for item in items:
        plain = item.replace("`", "")
        lines += textwrap.wrap(plain, width=76, initial_indent="  * ",
                               subsequent_indent="    ", break_on_hyphens=False)
    lines += ["", f" -- {maintainer}  {email.utils.format_datetime(when)}", ""]
    return "\n".join(lines)


def main(argv):
    changelog, version, maintainer = argv[1:4]
    with open(changelog, encoding="utf-8") as f:
        found = releases(f.read())
    base = version.split("~", 1)[0]
    if not found or found[0][0] != base:
        sys.exit(f"debian_changelog.py: the newest release in {changelog} is "
                 f"{found[0][0] if found else 'none'}, not {base} (add a '## {base} (date)' "
                 "section)")
    entries = []
    if version != base:
        built = datetime.now(timezone.utc).replace(microsecond=0)
        items = found[0][2] + [f"Built from a git tree with uncommitted changes ({version})."]
        entries.append(entry(version, built, items, maintainer))
    entries += [entry(v, when, items, maintainer) for v, when, items in found]
    sys.stdout.write("\n".join(entries))


if __name__ == "__main__":
    main(sys.argv)
