# shellcheck shell=bash disable=SC2154  # its variables are test-packages.sh's
# Part of scripts/test-packages.sh (sourced; uses its variables and helpers): the OCI archive
# inspected with skopeo, unpacked with umoci and run from its root file system with chroot.

ref="$(tar -xOf "$archive" index.json | /usr/bin/python3 -c 'import json, sys
print(json.load(sys.stdin)["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])')"
same "the archive's image name" "$ref" "refit/refitd:$tag"
manifest_image="$(sed -n 's/^ *image: \(refit\/refitd:.*\)$/\1/p' \
  "$root/deploy/k8s/daemonset.yaml")"
same "the image deploy/k8s/daemonset.yaml runs" "$manifest_image" "refit/refitd:$base"
skopeo inspect --config "oci-archive:$archive" > "$work/image-config.json"
/usr/bin/python3 - "$work/image-config.json" "$version" <<'PY' || fail "the image's config"
import json, sys
config = json.load(open(sys.argv[1]))["config"]
assert config["Entrypoint"] == ["/usr/bin/refitd"], config
user = config["User"].split(":")
assert user[0].isdigit() and int(user[0]) != 0 and int(user[1]) != 0, config["User"]
assert config["Labels"]["io.refit.version"] == sys.argv[2], config["Labels"]
PY
size_mib=$(($(stat -c %s "$archive") / 1048576))
[ "$size_mib" -lt 40 ] || fail "the image is $size_mib MiB (expected well under 40)"

skopeo copy -q "oci-archive:$archive" "oci:$work/layout:$tag"
umoci unpack --image "$work/layout:$tag" "$work/bundle" > "$work/umoci.log" 2>&1 ||
  { cat "$work/umoci.log" >&2; fail "umoci unpack"; }
rootfs="$work/bundle/rootfs"
[ ! -e "$rootfs/bin/sh" ] || fail "the image has a shell; it should hold refitd, refitctl, libraries"
uid="$(/usr/bin/python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["config"]["User"])' "$work/image-config.json")"
ok "the image: refit/refitd:$tag, $size_mib MiB, entrypoint /usr/bin/refitd, user $uid, no shell"

# What a container runtime provides: /proc, /sys, /dev. The binds are made slaves, so that
# unmounting them never propagates to the host's own mounts.
mkdir -p "$rootfs/proc" "$rootfs/sys" "$rootfs/dev"
mount -t proc proc "$rootfs/proc" || fail "cannot mount /proc in the image's root (for chroot)"
mounted+=("$rootfs/proc")
for d in sys dev; do
  mount --rbind "/$d" "$rootfs/$d" || fail "cannot bind /$d into the image's root (for chroot)"
  mount --make-rslave "$rootfs/$d"
  mounted+=("$rootfs/$d")
done

in_image="$(chroot --userspec="$uid" "$rootfs" /usr/bin/refitd --version 2> /dev/null)"
same "refitd --version in the image" "$(awk '{print $2}' <<< "$in_image")" "$version"
chroot --userspec="$uid" "$rootfs" /usr/bin/refitd --socket=/tmp/refitd.sock \
  --listen=127.0.0.1:0 > "$work/refitd-image.log" 2>&1 &
daemon_pid=$!
wait_for_socket "$rootfs/tmp/refitd.sock" "$daemon_pid"
status="$(chroot --userspec="$uid" "$rootfs" /usr/bin/refitctl --socket=/tmp/refitd.sock status)" ||
  { cat "$work/refitd-image.log" >&2; fail "refitctl status inside the image"; }
[[ "$status" == *"refitd $version"* ]] || fail "refitctl status in the image: $status"
stop_daemon
for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -R "${mounted[$i]}"; done
mounted=()
ok "from the image's root as $uid: refitd --version is $version; refitctl status answers"
