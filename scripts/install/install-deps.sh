#!/usr/bin/env bash
# Installs every Debian 12 package that refit's build, tests and demo need.
# Idempotent: safe to run again; installs only what is missing. Run as root.
set -euo pipefail

packages=(
  # build
  bazel-bootstrap bazel-rules-java g++ pkg-config git ca-certificates
  # source checks (scripts/check/check-format.sh, scripts/check/check-thread-safety.sh)
  clang clang-format
  # API and control plane
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # data plane
  libucx-dev ucx-utils
  # libraries
  libspdlog-dev libfmt-dev catch2 libxxhash-dev libzstd-dev libabsl-dev libsystemd-dev
  libcivetweb-dev libcli11-dev nlohmann-json3-dev libtomlplusplus-dev libbenchmark-dev
  # python client, examples and gloo reference benchmark
  python3 python3-grpcio python3-protobuf python3-torch python3-yaml
  # multi-node tests and operations tooling (prometheus: promtool lints /metrics in the tests)
  iproute2 procps systemd prometheus
  # shipping (scripts/ship/package-deb.sh, build-image.sh, test-packages.sh, client/python for pip)
  binutils dpkg-dev lintian buildah skopeo umoci python3-venv python3-setuptools python3-wheel
  util-linux mount
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing ${missing[*]}; run this script as root" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
