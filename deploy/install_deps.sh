#!/usr/bin/env bash
# Installs wpub's build and test dependencies from Debian 12 packages. Idempotent: packages
# already present are skipped, so a second run costs only the dpkg query. Needs root (or sudo).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libspdlog-dev libfmt-dev prometheus-cpp-dev nlohmann-json3-dev libsimdjson-dev libcpp-httplib-dev libre2-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  python3 python3-numpy python3-grpcio python3-protobuf python3-yaml
  python3-torch python3-build python3-venv python3-pip python3-wheel python3-setuptools
  prometheus openssl python3-jsonschema libsystemd-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
