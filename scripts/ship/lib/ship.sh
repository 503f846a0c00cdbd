# Shared by scripts/ship/package-deb.sh and scripts/ship/build-image.sh (sourced, not run): checking for
# tools, building the two binaries and staging them stripped, the version they carry.

# ship_args "$@": the one argument a build script takes is DIR; -h/--help prints the script's
# leading comment, any other option is refused (exit 2).
ship_args() {
  case "${1:-}" in
    -h | --help)
      sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"
      exit 0
      ;;
    -*)
      echo "usage: $(basename "$0") [DIR]   (see --help)" >&2
      exit 2
      ;;
  esac
  if [ "$#" -gt 1 ]; then
    echo "usage: $(basename "$0") [DIR]   (see --help)" >&2
    exit 2
  fi
}

# ship_need COMMAND DEBIAN_PACKAGE: stop, naming the package to install, if COMMAND is missing.
ship_need() {
  if ! command -v "$1" > /dev/null 2>&1; then
    echo "$(basename "$0"): '$1' not found: install the Debian package $2" \
      "(apt-get install $2, or scripts/install/install-deps.sh as root)" >&2
    exit 1
  fi
}

# ship_need_cuda: stop unless the CUDA toolkit the build uses is there ($CUDA_PATH, else
# /usr/local/cuda, as bazel/cuda_configure.bzl looks for it).
ship_need_cuda() {
  local cuda="${CUDA_PATH:-/usr/local/cuda}"
  if [ ! -x "$cuda/bin/nvcc" ]; then
    echo "$(basename "$0"): no CUDA toolkit at $cuda (no $cuda/bin/nvcc): the shipped refitd" \
      "is the CUDA build (bazel build --config=cuda); install the CUDA 13 toolkit there or" \
      "set CUDA_PATH" >&2
    exit 1
  fi
}

# ship_build_binaries ROOT DEST: builds //daemon:refitd and //client:refitctl in ROOT and puts
# them, stripped, in DEST/usr/bin. refitd is the CUDA build (--config=cuda: nvcc, the static
# CUDA runtime, which loads the driver's libcuda.so.1 at run time), so one binary serves GPU
# nodes and nodes without a GPU or driver ("cuda: 13.x, 0 device(s)"). Sets REFIT_VERSION to
# what `refitd --version` says, after checking it equals scripts/ship/version.sh (so the binaries
# and the thing shipped agree) and that CUDA is compiled in.
ship_build_binaries() {
  local root="$1" dest="$2" bin
  ship_need_cuda
  (cd "$root" && bazel build --config=cuda //daemon:refitd //client:refitctl)
  # The convenience link saves a second Bazel call; bazel info where it is not made.
  bin="$root/bazel-bin"
  [ -d "$bin/daemon" ] || bin="$(cd "$root" && bazel info bazel-bin 2> /dev/null)"
  install -d -m 0755 "$dest/usr/bin"
  local flags=(--strip-unneeded --remove-section=.comment)
  strip "${flags[@]}" -o "$dest/usr/bin/refitd" "$bin/daemon/refitd"
  strip "${flags[@]}" -o "$dest/usr/bin/refitctl" "$bin/client/refitctl"
  chmod 0755 "$dest/usr/bin/refitd" "$dest/usr/bin/refitctl"

  local said
  said="$("$dest/usr/bin/refitd" --version)"
  REFIT_VERSION="$(awk '{print $2}' <<< "$said")"
  if [[ "$said" != *"cuda: 13."* ]]; then
    echo "$(basename "$0"): refitd --version says '$said': not the CUDA 13 build" >&2
    exit 1
  fi
  if ldd "$dest/usr/bin/refitd" | grep -q 'libcuda'; then
    echo "$(basename "$0"): refitd links a CUDA library dynamically; the driver's must be" \
      "loaded at run time (static cudart)" >&2
    exit 1
  fi
  local expected ctl
  expected="$("$root/scripts/ship/version.sh")"
  ctl="$("$dest/usr/bin/refitctl" --version | awk '{print $2}')"
  if [ "$REFIT_VERSION" != "$expected" ] || [ "$ctl" != "$expected" ]; then
    echo "$(basename "$0"): refitd says version '$REFIT_VERSION', refitctl '$ctl'," \
      "scripts/ship/version.sh '$expected' (the tree changed during the build?)" >&2
    exit 1
  fi
}

# ship_source_date_epoch ROOT: seconds since the epoch of the commit checked out (so that two
# builds of one commit carry the same dates), else now.
ship_source_date_epoch() {
  git -C "$1" log -1 --format=%ct 2> /dev/null || date +%s
}
