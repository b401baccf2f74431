#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs the dependencies, configures and
# builds, then runs what was asked.
#   deploy/dev.sh demo   -- the main job (see README)
#   deploy/dev.sh test   -- the whole test suite (CPU tests; GPU tests skip without a GPU)
#   deploy/dev.sh build  -- install and build only
# BUILD_DIR (default build) and CMAKE_ARGS may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-build}
build_dir=${BUILD_DIR:-build}
jobs=$(nproc)

bash deploy/install_deps.sh
cmake -S . -B "$build_dir" -G Ninja ${CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$jobs"

case "$what" in
  build) ;;
  test)
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900
    ;;
  demo)
    "$build_dir/server/wpubctl/wpubctl" demo "${@:2}"
    ;;
  *) echo "usage: $0 {build|test|demo}" >&2; exit 2 ;;
esac
