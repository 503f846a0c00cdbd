# shellcheck shell=bash disable=SC2154,SC2034  # its variables are test-packages.sh's
# Part of scripts/ship/test-packages.sh (sourced; uses its variables and helpers): the Debian
# package installed, run, upgraded, removed and purged on this machine.

# What lies where a package could leave something, by name (contents that change anyway —
# dpkg's database and logs, man-db's index, the account files' backups — are left out).
snapshot() {
  find /etc /usr /lib /var -xdev \( -path /var/lib/dpkg -o -path /var/lib/apt -o -path /var/log \
    -o -path /var/cache/man -o -path /var/cache/apt -o -path /var/tmp \) -prune -o -print \
    2> /dev/null |
    grep -v -E '^/etc/(passwd|group|shadow|gshadow)-$|^/etc/\.pwd\.lock$' | sort
}

same "the .deb's Version" "$(dpkg-deb -f "$deb" Version)" "$version"
depends="$(dpkg-deb -f "$deb" Depends)"
for lib in libc6 libgrpc++1.51 libprotobuf32 libucx0 libspdlog1.10; do
  [[ "$depends" == *"$lib"* ]] || fail "Depends lacks $lib (dpkg-shlibdeps): $depends"
done
# The CUDA runtime is linked in statically and loads the driver at run time: the driver
# comes with the node, so nothing CUDA or NVIDIA is a dependency.
if grep -qiE 'cuda|nvidia' <<< "$depends"; then fail "Depends names CUDA/NVIDIA: $depends"; fi
contents="$(dpkg-deb -c "$deb" | awk '{print $6}')"
for f in ./usr/bin/refitd ./usr/bin/refitctl ./lib/systemd/system/refitd.service \
  ./usr/lib/sysusers.d/refit.conf ./etc/refit/refitd.toml ./usr/share/doc/refit/copyright \
  ./usr/share/doc/refit/changelog.gz ./usr/share/man/man8/refitd.8.gz; do
  grep -qxF "$f" <<< "$contents" || fail "the .deb lacks $f"
done
same "conffiles" "$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)" /etc/refit/refitd.toml
# Secure by default: the conffile keeps every port on loopback and names no plaintext opt-in.
conffile="$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./etc/refit/refitd.toml)"
for key in listen health_listen metrics_listen; do
  grep -qE "^$key = \"127\.0\.0\.1:[0-9]+\"$" <<< "$conffile" ||
    fail "the conffile's $key is not on 127.0.0.1"
done
if grep -qE '^[^#]*(0\.0\.0\.0|allow_plaintext_peers)' <<< "$conffile"; then
  fail "the conffile listens on every interface or allows plaintext peers"
fi

# lintian (started by test-packages.sh) must find no error and no warning; the informational
# tags it can print are explained in docs/packaging.md.
lintian_rc=0
wait "$lintian_pid" || lintian_rc=$?
lintian_pid=""
grep -v '^running with root' "$work/lintian.txt" | sed 's/^/  lintian: /' || true
[ "$lintian_rc" -eq 0 ] || fail "lintian found errors or warnings (above)"
ok "the .deb: version $version, Depends from dpkg-shlibdeps, its files, lintian clean"

before="$(snapshot)"
user_existed=""
getent passwd refit > /dev/null && user_existed=1
installed=1
dpkg -i "$deb" > "$work/dpkg-i.log" 2>&1 || { cat "$work/dpkg-i.log" >&2; fail "dpkg -i"; }
said="$(refitd --version)"
same "installed refitd --version" "$(awk '{print $2}' <<< "$said")" "$version"
[[ "$said" =~ cuda:\ 13\.[0-9]+,\ [0-9]+\ device ]] ||
  fail "the installed refitd is not the CUDA 13 build: $said"
if [ ! -e /dev/nvidiactl ]; then
  [[ "$said" == *"0 device(s)"* ]] || fail "no GPU here, yet the installed refitd: $said"
fi
grep -q '^LoadCredential=tls.key:/etc/refit/tls/tls.key$' /lib/systemd/system/refitd.service ||
  fail "the installed unit does not load /etc/refit/tls/tls.key as a credential"
same "installed refitctl --version" "$(refitctl --version)" "refitctl $version"
same "refitd in /usr/bin" "$(command -v refitd)" /usr/bin/refitd
getent passwd refit | grep -q ':/usr/sbin/nologin$' || fail "no system user refit after install"
getent group refit > /dev/null || fail "no group refit after install"
verify="$(systemd-analyze verify /lib/systemd/system/refitd.service 2>&1)" ||
  fail "systemd-analyze verify: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify warns: $verify"
[ -L /etc/systemd/system/multi-user.target.wants/refitd.service ] ||
  fail "refitd.service was not enabled on install"
ok "installed: refitd/refitctl $version in /usr/bin ($said), user refit, the unit verifies" \
  "and is enabled"

# The installed daemon as the service runs it: user refit, the installed config (its addresses
# moved to a temporary socket and free local ports).
rundir="$work/run"
install -d -o refit -g refit -m 0750 "$rundir"
sock="$rundir/refitd.sock"
setpriv --reuid=refit --regid=refit --init-groups \
  refitd --config=/etc/refit/refitd.toml --socket="$sock" --listen=127.0.0.1:0 --health-listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 \
  > "$work/refitd-deb.log" 2>&1 &
daemon_pid=$!
wait_for_socket "$sock" "$daemon_pid"
status="$(refitctl --socket="$sock" status)" || fail "refitctl status against the installed refitd"
[[ "$status" == *"refitd $version"* ]] || fail "refitctl status names no refitd $version: $status"
grep -q "cuda: 13\.[0-9]*, [0-9]* device(s)" "$work/refitd-deb.log" ||
  fail "the installed refitd logged no CUDA line at start: $(tail -5 "$work/refitd-deb.log")"
. "$root/scripts/ship/lib/test-pip.sh"
stop_daemon
rm -rf "$rundir"
ok "the installed refitd runs as refit with /etc/refit/refitd.toml; refitctl status answers"

# The installed config with its peer port moved off loopback and no certificates: refused,
# saying how to fix it, before anything listens.
rc=0
setpriv --reuid=refit --regid=refit --init-groups \
  refitd --config=/etc/refit/refitd.toml --socket="$work/refused.sock" --listen=0.0.0.0:0 \
  --health-listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 > "$work/refitd-refused.log" 2>&1 ||
  rc=$?
[ "$rc" -ne 0 ] || fail "the installed refitd started plaintext on 0.0.0.0"
grep -q "is not a loopback address" "$work/refitd-refused.log" &&
  grep -q -- "--allow-plaintext-peers" "$work/refitd-refused.log" ||
  fail "no fix named when refusing 0.0.0.0: $(cat "$work/refitd-refused.log")"
[ ! -e "$work/refused.sock" ] || fail "the refused refitd made its socket"
ok "the installed config off loopback without certificates: refused (exit $rc), naming the fix"

# An upgrade leaves a conffile the operator edited alone (the package's own copy unchanged).
echo "# edited by the operator" >> /etc/refit/refitd.toml
dpkg-deb -R "$deb" "$work/upgrade"
sed -i "s/^Version: .*/Version: $version+test1/" "$work/upgrade/DEBIAN/control"
dpkg-deb --root-owner-group -b "$work/upgrade" "$work/refit_upgrade.deb" > /dev/null
dpkg -i "$work/refit_upgrade.deb" < /dev/null > "$work/dpkg-upgrade.log" 2>&1 ||
  { cat "$work/dpkg-upgrade.log" >&2; fail "dpkg -i (upgrade)"; }
same "version after upgrade" "$(dpkg-query -W -f='${Version}' refit)" "$version+test1"
grep -qx "# edited by the operator" /etc/refit/refitd.toml ||
  fail "the upgrade replaced the edited conffile"
[ -L /etc/systemd/system/multi-user.target.wants/refitd.service ] ||
  fail "refitd.service no longer enabled after upgrade"
ok "upgrade to $version+test1 keeps the edited /etc/refit/refitd.toml and the enablement"

dpkg -r refit > "$work/dpkg-r.log" 2>&1 || { cat "$work/dpkg-r.log" >&2; fail "dpkg -r"; }
same "status after remove" "$(dpkg-query -W -f='${db:Status-Abbrev}' refit)" "rc "
for f in /usr/bin/refitd /usr/bin/refitctl /lib/systemd/system/refitd.service \
  /usr/lib/sysusers.d/refit.conf /usr/share/doc/refit; do
  [ ! -e "$f" ] || fail "$f left after remove"
done
[ -f /etc/refit/refitd.toml ] || fail "remove took the conffile (only purge may)"
ok "remove: the files go, the conffile stays"

dpkg -P refit > "$work/dpkg-P.log" 2>&1 || { cat "$work/dpkg-P.log" >&2; fail "dpkg -P"; }
installed=""  # nothing for cleanup to purge
if dpkg-query -W refit > /dev/null 2>&1; then fail "dpkg still knows refit after purge"; fi
after="$(snapshot)"
left="$(comm -13 <(echo "$before") <(echo "$after"))"
[ -z "$left" ] || fail "purge left behind: $left"
gone="$(comm -23 <(echo "$before") <(echo "$after"))"
[ -z "$gone" ] || fail "install/purge removed what was there before: $gone"
# Debian keeps system users on purge; the user must own nothing.
getent passwd refit > /dev/null || [ -z "$user_existed" ] ||
  fail "the refit user existed before and is gone"
owned="$(find /etc /usr /var /run /tmp -xdev -user refit 2> /dev/null | head -5)"
[ -z "$owned" ] || fail "files owned by refit after purge: $owned"
ok "purge: nothing left (the refit user stays, owning no file, as Debian keeps system users)"
