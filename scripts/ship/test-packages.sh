#!/usr/bin/env bash
# Builds what an operator installs and installs it as they would, checking each works:
#
#   deb    scripts/ship/package-deb.sh: lintian (no error or warning), dpkg -i, the versions, the
#          refit user, the unit (systemd-analyze verify) and its enablement, the installed refitd
#          with the installed config answering refitctl and the Python client, an upgrade that
#          keeps an edited conffile, remove (only the conffile stays), purge (nothing stays but
#          the refit user, which owns nothing).
#   image  scripts/ship/build-image.sh: the OCI archive's name, tag, user and entrypoint (skopeo),
#          unpacked with umoci, refitd --version and a Status round trip run from its root
#          file system with chroot, as its non-root user.
#   pip    pip install ./client/python into a fresh venv (system site packages, no network),
#          `import refit` from outside the checkout, its version.
#   and    scripts/ship/version.sh's dirty marks; the build scripts stopping with the Debian package
#          to install when a tool is missing; the checkout left as clean as it was.
#
# Run as root on Debian 12 (scripts/test.sh runs it after bazel test). It installs the package
# `refit` on this machine and purges it at the end, so it refuses to run where refit is
# installed already (REFIT_TEST_PACKAGES_REPLACE=1: purge that first). Takes about a minute.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/ship/lib/ship.sh
. "$root/scripts/ship/lib/ship.sh"

fail() { echo "test-packages: FAIL: $*" >&2; exit 1; }
ok() { echo "test-packages: ok: $* (${SECONDS} s)"; }
same() {  # same WHAT GOT WANT
  [ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"
}

[ "$(id -u)" -eq 0 ] || fail "run as root: this installs a .deb and chroots into the image"
for need in "bazel bazel-bootstrap" "dpkg-deb dpkg" "dpkg-shlibdeps dpkg-dev" \
  "lintian lintian" "systemd-analyze systemd" "buildah buildah" "skopeo skopeo" "umoci umoci" \
  "chroot coreutils" "runuser util-linux" "setpriv util-linux" "mount mount" \
  "/usr/bin/python3 python3"; do
  # shellcheck disable=SC2086  # "COMMAND PACKAGE", two arguments
  ship_need $need
done
/usr/bin/python3 -c 'import venv, ensurepip, setuptools, wheel' 2> /dev/null ||
  fail "python3's venv/setuptools/wheel missing: install python3-venv python3-setuptools" \
    "python3-wheel"
if dpkg-query -W -f='${db:Status-Abbrev}' refit 2> /dev/null | grep -q '^[ic]'; then
  if [ "${REFIT_TEST_PACKAGES_REPLACE:-}" = 1 ]; then
    dpkg --purge refit > /dev/null
  else
    fail "the package refit is installed here already; purge it (dpkg --purge refit) or set" \
      "REFIT_TEST_PACKAGES_REPLACE=1"
  fi
fi

# The package's purge removes /var/cache/refit and /var/lib/refit (systemd's CacheDirectory= and
# StateDirectory=); refuse to run over something else kept there.
for d in /var/cache/refit /var/lib/refit; do
  if [ -e "$d" ]; then
    fail "$d exists and purging the package (the end of this test) would delete it: move it" \
      "away first (ls -la $d)"
  fi
done

work="$(mktemp -d /tmp/refit-test-packages.XXXXXX)"
chmod 0755 "$work"
daemon_pid=""
lintian_pid=""
mounted=()
installed=""
cleanup() {
  if [ -n "$daemon_pid" ]; then
    kill "$daemon_pid" 2> /dev/null || true
    wait "$daemon_pid" 2> /dev/null || true
  fi
  if [ -n "$lintian_pid" ]; then kill "$lintian_pid" 2> /dev/null || true; fi
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[$i]}" 2> /dev/null || true
  done
  if [ -n "$installed" ]; then dpkg --purge refit > /dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# wait_for_socket PATH PID: until PATH is a socket, or fail if PID died or 20 s went by.
wait_for_socket() {
  local i
  for ((i = 0; i < 200; i++)); do
    [ -S "$1" ] && return 0
    kill -0 "$2" 2> /dev/null || fail "refitd exited before creating $1"
    sleep 0.1
  done
  fail "no socket at $1 after 20 s"
}
# stop_daemon: SIGTERM, which refitd must answer by exiting 0.
stop_daemon() {
  kill -TERM "$daemon_pid"
  local rc=0
  wait "$daemon_pid" || rc=$?
  daemon_pid=""
  same "refitd's exit status on SIGTERM" "$rc" 0
}

tree_before="$(git -C "$root" status --porcelain --untracked-files=normal 2> /dev/null || true)"
version="$("$root/scripts/ship/version.sh")"
tag="$("$root/scripts/ship/version.sh" --image-tag)"
pyversion="$("$root/scripts/ship/version.sh" --python)"
base="$(tr -d '[:space:]' < "$root/VERSION")"
dist="$work/dist"

# ---- the version and its marks, in a clone of the checkout ------------------------------------
if git -C "$root" rev-parse --verify -q HEAD > /dev/null; then
  git clone -q --no-hardlinks "$root" "$work/clone"
  cv="$work/clone/scripts/ship/version.sh"
  same "version of a clean clone" "$("$cv")" "$base"
  touch "$work/clone/untracked-file"
  same "version of a dirty clone" "$("$cv")" "$base~dirty"
  same "image tag of a dirty clone" "$("$cv" --image-tag)" "$base-dirty"
  same "Python version of a dirty clone" "$("$cv" --python)" "$base+dirty"
  echo "0.2" > "$work/clone/VERSION"
  if "$cv" > /dev/null 2>&1; then fail "VERSION '0.2' was accepted"; fi
  rm -rf "$work/clone"
  ok "scripts/ship/version.sh: $base clean, ~dirty/-dirty/+dirty marks, a malformed VERSION refused"
else
  echo "test-packages: NOT CHECKED: the dirty marks of scripts/ship/version.sh (not a git checkout)"
fi

# ---- a build script without its tools names the package and stops ----------------------------
mkdir "$work/bin"
for t in dirname basename; do ln -s "$(command -v "$t")" "$work/bin/$t"; done
expect_missing() {  # expect_missing SCRIPT DEBIAN_PACKAGE
  local rc=0 err
  err="$(PATH="$work/bin" /bin/bash "$root/scripts/ship/$1" "$work/none" 2>&1 > /dev/null)" || rc=$?
  [ "$rc" -ne 0 ] || fail "$1 without its tools exited 0"
  [[ "$err" == *"install the Debian package $2"* ]] || fail "$1 did not name $2: $err"
  [ ! -e "$work/none" ] || fail "$1 without its tools wrote $work/none"
}
expect_missing package-deb.sh bazel-bootstrap
expect_missing build-image.sh bazel-bootstrap
ln -s "$(command -v bazel)" "$work/bin/bazel"
expect_missing package-deb.sh dpkg
expect_missing build-image.sh buildah
for s in package-deb.sh build-image.sh; do
  "$root/scripts/ship/$s" --help | grep -q "DIR" || fail "$s --help does not describe DIR"
  rc=0
  "$root/scripts/ship/$s" --bogus 2> /dev/null || rc=$?
  same "$s --bogus exit status" "$rc" 2
done
ok "without their tools, package-deb.sh and build-image.sh name the Debian package and stop;" \
  "--help describes them, an unknown option is refused"

# ---- build ------------------------------------------------------------------------------------
"$root/scripts/ship/package-deb.sh" "$dist" > "$work/package-deb.log" 2>&1 ||
  { tail -20 "$work/package-deb.log" >&2; fail "scripts/ship/package-deb.sh"; }
"$root/scripts/ship/build-image.sh" "$dist" > "$work/build-image.log" 2>&1 ||
  { tail -20 "$work/build-image.log" >&2; fail "scripts/ship/build-image.sh"; }
deb="$dist/refit_${version}_amd64.deb"
archive="$dist/refitd-$tag.oci.tar"
[ -f "$deb" ] || fail "no $deb"
[ -f "$archive" ] || fail "no $archive"
ok "built $(basename "$deb") ($(du -h "$deb" | cut -f1))," \
  "$(basename "$archive") ($(du -h "$archive" | cut -f1))"

# lintian (a few seconds) runs meanwhile, as nobody (it warns against root); lib/test-deb.sh
# reads its verdict.
runuser -u nobody -- lintian --fail-on error,warning "$deb" > "$work/lintian.txt" 2>&1 &
lintian_pid=$!

# Built again from the same commit: the same image (manifest digest), and from a clean tree the
# same .deb, byte for byte (a dirty tree's changelog entry is dated at build time).
"$root/scripts/ship/build-image.sh" "$work/again" > "$work/build-image-again.log" 2>&1 ||
  { tail -20 "$work/build-image-again.log" >&2; fail "scripts/ship/build-image.sh, again"; }
again_index="$(tar -xOf "$work/again/$(basename "$archive")" index.json)"
same "the image's manifest, built again" "$again_index" "$(tar -xOf "$archive" index.json)"
if [ "$version" = "$base" ]; then
  "$root/scripts/ship/package-deb.sh" "$work/again" > "$work/package-deb-again.log" 2>&1 ||
    { tail -20 "$work/package-deb-again.log" >&2; fail "scripts/ship/package-deb.sh, again"; }
  same "the .deb's sha256, built again" \
    "$(sha256sum < "$work/again/$(basename "$deb")")" "$(sha256sum < "$deb")"
  ok "built again: the same image manifest and the same .deb"
else
  ok "built again: the same image manifest (the .deb is compared only from a clean tree)"
fi
rm -rf "$work/again"

. "$root/scripts/ship/lib/test-deb.sh"
. "$root/scripts/ship/lib/test-image.sh"

now="$(git -C "$root" status --porcelain --untracked-files=normal 2> /dev/null || true)"
same "git status after the test (the builds must leave the checkout as it was)" "$now" \
  "$tree_before"
echo "test-packages: all passed (refit $version)"
