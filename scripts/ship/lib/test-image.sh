# shellcheck shell=bash disable=SC2154  # its variables are test-packages.sh's
# Part of scripts/ship/test-packages.sh (sourced; uses its variables and helpers): the OCI archive
# inspected with skopeo, unpacked with umoci and run from its root file system with chroot.

ref="$(tar -xOf "$archive" index.json | /usr/bin/python3 -c 'import json, sys
print(json.load(sys.stdin)["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])')"
same "the archive's image name" "$ref" "refit/refitd:$tag"
manifest_image="$(sed -n 's/^ *image: \(refit\/refitd:.*\)$/\1/p' \
  "$root/deploy/k8s/daemonset.yaml" | sort -u)"
same "the image deploy/k8s/daemonset.yaml's DaemonSets run" "$manifest_image" "refit/refitd:$base"
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
# The CUDA build, and no CUDA library in the image: the static runtime loads the driver's
# libcuda.so.1, which the NVIDIA container runtime mounts in on a GPU node.
[[ "$in_image" =~ cuda:\ 13\.[0-9]+,\ [0-9]+\ device ]] ||
  fail "refitd --version in the image is not the CUDA 13 build: $in_image"
cuda_libs="$(find "$rootfs" -xdev \( -name 'libcuda*' -o -name 'libcudart*' -o -name 'libnvidia*' \) \
  -print)"
[ -z "$cuda_libs" ] || fail "the image carries CUDA libraries: $cuda_libs"
if [ ! -e /dev/nvidiactl ]; then
  [[ "$in_image" == *"0 device(s)"* ]] || fail "no GPU here, yet the image's refitd: $in_image"
fi
chroot --userspec="$uid" "$rootfs" /usr/bin/refitd --socket=/tmp/refitd.sock \
  --listen=127.0.0.1:0 > "$work/refitd-image.log" 2>&1 &
daemon_pid=$!
wait_for_socket "$rootfs/tmp/refitd.sock" "$daemon_pid"
status="$(chroot --userspec="$uid" "$rootfs" /usr/bin/refitctl --socket=/tmp/refitd.sock status)" ||
  { cat "$work/refitd-image.log" >&2; fail "refitctl status inside the image"; }
[[ "$status" == *"refitd $version"* ]] || fail "refitctl status in the image: $status"
grep -q "cuda: 13\.[0-9]*, [0-9]* device(s)" "$work/refitd-image.log" ||
  fail "the image's refitd logged no CUDA line at start: $(tail -5 "$work/refitd-image.log")"
stop_daemon
for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -R "${mounted[$i]}"; done
mounted=()
ok "from the image's root as $uid: refitd --version is $version ($in_image); no CUDA" \
  "library in the image; refitctl status answers"
