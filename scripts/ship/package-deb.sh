#!/usr/bin/env bash
# Builds refit's Debian package, DIR/refit_VERSION_amd64.deb (DIR defaults to dist/):
#
#   /usr/bin/refitd, /usr/bin/refitctl            built by Bazel, stripped
#   /lib/systemd/system/refitd.service            deploy/systemd/refitd.service
#   /usr/lib/sysusers.d/refit.conf                deploy/systemd/sysusers-refit.conf
#   /etc/refit/refitd.toml                        deploy/refitd.toml, a conffile
#   /usr/share/man/man8/refitd.8.gz, man1/refitctl.1.gz   from the binaries' --help
#   /usr/share/doc/refit/                         copyright, changelog (from CHANGELOG.md), docs
#
# Depends comes from the binaries (dpkg-shlibdeps); the maintainer scripts are deploy/debian/.
# VERSION is `refitd --version` (scripts/ship/version.sh: ~dirty for an unclean tree). Offline: it
# needs only Debian packages (bazel-bootstrap, dpkg-dev, binutils). See docs/deploy.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/ship/lib/ship.sh
. "$root/scripts/ship/lib/ship.sh"

ship_args "$@"
out_dir="${1:-$root/dist}"
ship_need bazel bazel-bootstrap
ship_need dpkg-deb dpkg
ship_need dpkg-shlibdeps dpkg-dev
ship_need strip binutils
ship_need gzip gzip
ship_need /usr/bin/python3 python3

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# dpkg-shlibdeps wants a source tree: debian/control and the package's files in debian/PACKAGE.
pkg="$work/debian/refit"
umask 022

ship_build_binaries "$root" "$pkg"
version="$REFIT_VERSION"
maintainer="${DEBFULLNAME:-refit maintainers} <${DEBEMAIL:-refit-maintainers@example.org}>"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(ship_source_date_epoch "$root")}"

install -D -m 0644 "$root/deploy/systemd/refitd.service" "$pkg/lib/systemd/system/refitd.service"
install -D -m 0644 "$root/deploy/systemd/sysusers-refit.conf" "$pkg/usr/lib/sysusers.d/refit.conf"
install -D -m 0644 "$root/deploy/refitd.toml" "$pkg/etc/refit/refitd.toml"

# man pages: what --help says, in man(7) form.
man_page() {  # man_page BINARY SECTION SUMMARY OUT
  local name
  name="$(basename "$1")"
  {
    printf '.TH %s %s "%s" "refit %s" "refit"\n' "${name^^}" "$2" \
      "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d)" "$version"
    printf '.SH NAME\n%s \\- %s\n' "$name" "$3"
    printf '.SH SYNOPSIS\n.B %s\n[\\fIOPTIONS\\fR]\n' "$name"
    printf '.SH DESCRIPTION\nThe text of \\fB%s \\-\\-help\\fR:\n.PP\n.nf\n' "$name"
    (exec -a "$name" "$1" --help) | sed -e 's/\\/\\e/g' -e 's/^\([.'\'']\)/\\\&\1/'
    printf '.fi\n.SH FILES\n/etc/refit/refitd.toml, /run/refit/refitd.sock\n'
    printf '.SH SEE ALSO\n.BR refitd (8),\n.BR refitctl (1),\n/usr/share/doc/refit/\n'
  } | gzip -9n > "$4"
}
install -d -m 0755 "$pkg/usr/share/man/man8" "$pkg/usr/share/man/man1"
man_page "$pkg/usr/bin/refitd" 8 \
  "the per-node refit daemon: moves policy weights from trainers to inference engines" \
  "$pkg/usr/share/man/man8/refitd.8.gz"
man_page "$pkg/usr/bin/refitctl" 1 "look at and follow the node's refitd" \
  "$pkg/usr/share/man/man1/refitctl.1.gz"

doc="$pkg/usr/share/doc/refit"
install -d -m 0755 "$doc"
install -m 0644 "$root/deploy/debian/copyright" "$doc/copyright"
/usr/bin/python3 "$root/scripts/ship/lib/debian_changelog.py" "$root/CHANGELOG.md" "$version" \
  "$maintainer" | gzip -9n > "$doc/changelog.gz"
for f in README.md docs/deploy.md docs/operator-guide.md docs/api.md; do
  gzip -9n < "$root/$f" > "$doc/$(basename "$f").gz"
done
chmod 0644 "$doc"/*.gz "$pkg"/usr/share/man/man*/*.gz

install -d -m 0755 "$pkg/DEBIAN"
install -m 0644 "$root/deploy/debian/conffiles" "$pkg/DEBIAN/conffiles"
for s in postinst prerm postrm; do
  install -m 0755 "$root/deploy/debian/$s" "$pkg/DEBIAN/$s"
done

printf 'Source: refit\n\nPackage: refit\nArchitecture: amd64\n' > "$work/debian/control"
# --warnings=1: only missing symbols; pkg-config links more libraries than the binaries use.
shlibs="$(cd "$work" && dpkg-shlibdeps --warnings=1 -O debian/refit/usr/bin/refitd \
  debian/refit/usr/bin/refitctl | sed -n 's/^shlibs:Depends=//p')"
if [ -z "$shlibs" ]; then
  echo "package-deb.sh: dpkg-shlibdeps found no library dependencies" >&2
  exit 1
fi
installed_kb="$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)"
sed -e "s|@VERSION@|$version|" -e "s|@MAINTAINER@|$maintainer|" \
  -e "s|@INSTALLED_SIZE@|$installed_kb|" -e "s|@SHLIBS_DEPENDS@|$shlibs|" \
  "$root/deploy/debian/control.in" > "$pkg/DEBIAN/control"
# md5sums: every file but the conffiles (dpkg keeps theirs itself).
(cd "$pkg" && find . -path ./DEBIAN -prune -o -path ./etc -prune -o -type f -printf '%P\0' |
  sort -z | xargs -0 md5sum) > "$pkg/DEBIAN/md5sums"
chmod 0644 "$pkg/DEBIAN/control" "$pkg/DEBIAN/md5sums"

mkdir -p "$out_dir"
deb="$out_dir/refit_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zxz --build "$pkg" "$deb" > /dev/null
echo "package-deb.sh: wrote $deb ($(du -h "$deb" | cut -f1), installs $installed_kb KiB)"
