#!/usr/bin/env bash
# Builds the container image the Kubernetes manifests run, refit/refitd:TAG, as an OCI archive
# DIR/refitd-TAG.oci.tar (DIR defaults to dist/), offline, with buildah and no container daemon:
#
#   FROM scratch: /usr/bin/refitd (the entrypoint) and /usr/bin/refitctl, stripped, and exactly
#   the shared libraries they load: what ldd lists for them, for the UCX transport modules UCX
#   dlopens (ucx/libuct_*.so: cma, InfiniBand verbs, rdmacm) and for the verbs providers those
#   load; the copyright files of the Debian packages the libraries come from; a passwd/group
#   naming the user it runs as, 65532:65532 (non-root, as the manifests' securityContext).
#
# TAG is `refitd --version` with '~' written as '-' (OCI tags allow no '~'):
# scripts/ship/version.sh --image-tag. Load it into a registry with
#   skopeo copy oci-archive:dist/refitd-TAG.oci.tar docker://REGISTRY/refit/refitd:TAG
# (docs/deploy.md, "The image").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/ship/lib/ship.sh
. "$root/scripts/ship/lib/ship.sh"

ship_args "$@"
out_dir="${1:-$root/dist}"
ship_need bazel bazel-bootstrap
ship_need buildah buildah
ship_need ldd libc-bin
ship_need dpkg-query dpkg
ship_need strip binutils

work="$(mktemp -d)"
storage=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
ctr=""
cleanup() {
  if [ -n "$ctr" ]; then buildah "${storage[@]}" rm "$ctr" > /dev/null 2>&1 || true; fi
  # vfs layers hold read-only copies; buildah's own storage is removed with the rest.
  rm -rf "$work"
}
trap cleanup EXIT
rootfs="$work/rootfs"
umask 022

ship_build_binaries "$root" "$rootfs"
tag="$("$root/scripts/ship/version.sh" --image-tag)"
if [ "${REFIT_VERSION/\~/-}" != "$tag" ]; then
  echo "build-image.sh: refitd says $REFIT_VERSION, the tag would be $tag" >&2
  exit 1
fi
epoch="$(ship_source_date_epoch "$root")"

# put PATH: the host's PATH in rootfs, with every symbolic link on the way (a directory like
# /lib64 -> usr/lib64, a soname like libfoo.so.1 -> libfoo.so.1.2.3) made again as a link.
put() {
  local p="$1" dir target
  if [ -e "$rootfs$p" ] || [ -L "$rootfs$p" ]; then return 0; fi
  dir="$(dirname "$p")"
  if [ "$dir" != / ]; then put "$dir"; fi
  if [ -L "$p" ]; then
    target="$(readlink "$p")"
    ln -s "$target" "$rootfs$p"
    case "$target" in
      /*) put "$target" ;;
      *) put "$(dirname "$p")/$target" ;;
    esac
  elif [ -d "$p" ]; then
    install -d -m 0755 "$rootfs$p"
  else
    cp -p "$p" "$rootfs$p"
  fi
}

# What UCX and libibverbs dlopen, besides what the binaries link (none where not installed).
shopt -s nullglob
multiarch=/usr/lib/x86_64-linux-gnu
modules=("$multiarch"/ucx/libuct_*.so.0 "$multiarch"/libibverbs/*.so)
libs="$(ldd "$rootfs/usr/bin/refitd" "$rootfs/usr/bin/refitctl" "${modules[@]}" |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}
       NF == 2 && $1 ~ /^\// && $2 ~ /^\(/ {print $1}' | sort -u)"
if grep -q "not found" <(ldd "$rootfs/usr/bin/refitd" "$rootfs/usr/bin/refitctl"); then
  echo "build-image.sh: a library of refitd or refitctl is not installed:" >&2
  ldd "$rootfs/usr/bin/refitd" "$rootfs/usr/bin/refitctl" | grep "not found" >&2
  exit 1
fi
for p in $libs "${modules[@]}" /etc/libibverbs.d/*.driver; do
  put "$p"
done

# The copyright file of each Debian package a library comes from.
# shellcheck disable=SC2086  # one argument per library
for pkg in $(dpkg-query -S $libs 2> /dev/null | cut -d: -f1 | tr ',' '\n' | sort -u); do
  if [ -f "/usr/share/doc/$pkg/copyright" ]; then
    install -D -m 0644 "/usr/share/doc/$pkg/copyright" "$rootfs/usr/share/doc/$pkg/copyright"
  fi
done

install -d -m 0755 "$rootfs/etc" "$rootfs/run/refit" "$rootfs/etc/refit" "$rootfs/var/cache/refit"
install -d -m 1777 "$rootfs/tmp"
{
  echo 'root:x:0:0:root:/:/sbin/nologin'
  echo 'refit:x:65532:65532:refit weight-sync daemon:/:/sbin/nologin'
} > "$rootfs/etc/passwd"
printf 'root:x:0:\nrefit:x:65532:\n' > "$rootfs/etc/group"
printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$rootfs/etc/nsswitch.conf"
chmod 0644 "$rootfs/etc/passwd" "$rootfs/etc/group" "$rootfs/etc/nsswitch.conf"
# Every file with the commit's time, so two builds of one commit give the same layer.
find "$rootfs" -exec touch -h -d "@$epoch" {} +

ctr="$(buildah "${storage[@]}" from scratch)"
buildah "${storage[@]}" copy --quiet "$ctr" "$rootfs/" / > /dev/null
buildah "${storage[@]}" config \
  --entrypoint '["/usr/bin/refitd"]' --cmd '' \
  --user 65532:65532 --workingdir / --env PATH=/usr/bin \
  --port 7070/tcp --port 7071/tcp --port 9464/tcp \
  --os linux --arch amd64 \
  --label org.opencontainers.image.title=refitd \
  --label "org.opencontainers.image.description=refit: policy weights from trainers to engines" \
  --label "org.opencontainers.image.version=$tag" \
  --label "io.refit.version=$REFIT_VERSION" \
  "$ctr"

mkdir -p "$out_dir"
archive="$out_dir/refitd-$tag.oci.tar"
rm -f "$archive"
buildah "${storage[@]}" commit --quiet --format oci --disable-compression=false \
  --timestamp "$epoch" --rm "$ctr" "oci-archive:$archive:refit/refitd:$tag" > /dev/null
ctr=""
echo "build-image.sh: wrote $archive (refit/refitd:$tag, $(du -h "$archive" | cut -f1);" \
  "$(du -sh "$rootfs" | cut -f1) unpacked, $(echo "$libs" | wc -l) libraries)"
