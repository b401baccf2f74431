#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs the dependencies, configures and
# builds, then runs what was asked.
#   deploy/dev.sh demo [DIR [wpubctl demo flags]]
#                        -- the main job (see README): builds wpubd, wpub-recv and wpubctl alone
#                           (CPU only, into build-demo) and runs `wpubctl demo`, keeping its files
#                           in DIR (default ./wpub-demo)
#   deploy/dev.sh test   -- the whole test suite (CPU tests; GPU tests skip without a GPU), then
#                           the sanitizer step: a second CPU tree built with ASan+UBSan
#                           (-DWPUB_SANITIZE=ON, into build-asan) running the tests of the
#                           modules that parse untrusted input (DEVELOPERS.md, "Fuzzing and
#                           sanitizers")
#   deploy/dev.sh build  -- install and build only
# BUILD_DIR (default build), DEMO_BUILD_DIR (default build-demo), CMAKE_ARGS, ASAN_BUILD_DIR
# (default build-asan) and SANITIZE
# (1, the default; 0 skips the sanitizer step) may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-build}
build_dir=${BUILD_DIR:-build}
jobs=$(nproc)

bash deploy/install_deps.sh

# The demo runs the CPU path only (wpubd, two wpub-recv, wpubctl): a tree of its own without CUDA
# or benchmarks, and only those three targets -- minutes on 2 cores instead of the whole build.
if [ "$what" = demo ]; then
  demo_dir=${DEMO_BUILD_DIR:-build-demo}
  if [ ! -x "$demo_dir/server/wpubctl/wpubctl" ]; then
    echo "dev.sh: building wpubd, wpub-recv and wpubctl into $demo_dir (CPU only; the first build" \
      "takes about 3 minutes on 2 cores, later runs rebuild only what changed)"
  fi
  cmake -S . -B "$demo_dir" -G Ninja -DWPUB_ENABLE_CUDA=OFF -DWPUB_BUILD_BENCH=OFF ${CMAKE_ARGS:-}
  cmake --build "$demo_dir" -j "$jobs" --target wpubd wpub-recv wpubctl
  files=${2:-$PWD/wpub-demo}
  exec "$demo_dir/server/wpubctl/wpubctl" demo --demo_dir="$files" "${@:3}"
fi

cmake -S . -B "$build_dir" -G Ninja ${CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$jobs"

# The sanitizer step of `test`: no CUDA, no benchmarks; every UBSan finding is fatal
# (-fno-sanitize-recover) and ASan stops at the first error. It builds and runs the unit tests
# of the test folders in sanitize_dirs: the modules that take bytes from outside (trainer
# streams, checkpoints and receivers' files, engine answers, TCPStore clients, policy text) and
# the fuzz targets' short runs. DEVELOPERS.md says why not the whole unit label.
sanitize_dirs=(fuzz policy transport engine group rollout rendezvous convert inspect)
sanitize_targets=(fuzz_publish_test fuzz_safetensors_test fuzz_tcp_store_test
  fuzz_update_request_test fuzz_sglang_answers_test fuzz_policy_test policy_test
  transport_unit_test engine_unit_test rendezvous_test rollout_sglang_driver_test
  rollout_update_request_test engine_connect_engines_test rollout_sglang_dirty_test
  policy_bounds_test convert_test group_unit_test rollout_vllm_driver_test
  rollout_family_router_test inspect_test rollout_sglang_releases_test rollout_engine_requests_test
  rollout_group_cpu_test rollout_vllm_engine_test group_decision_test group_protocol_model_test
  group_in_doubt_test)
sanitize() {
  local dir=${ASAN_BUILD_DIR:-build-asan}
  # Debug (-O0 -g): instrumented -O2 code takes ~6x longer to compile (77 s against 13.5 s for
  # tests/inspect/inspect_test.cc on the 2-core CI machine; the whole step was 13.4 min of build),
  # and ASan+UBSan catch at least as much unoptimized.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DWPUB_SANITIZE=ON -DWPUB_ENABLE_CUDA=OFF \
    -DWPUB_BUILD_BENCH=OFF
  cmake --build "$dir" -j "$jobs" --target "${sanitize_targets[@]}"
  local d
  for d in "${sanitize_dirs[@]}"; do
    ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      ctest --test-dir "$dir/tests/$d" --output-on-failure -j "$jobs" --timeout 900 -L unit
  done
}

case "$what" in
  build) ;;
  test)
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900
    if [ "${SANITIZE:-1}" != 0 ]; then sanitize; fi
    ;;
  *) echo "usage: $0 {build|test|demo}" >&2; exit 2 ;;
esac
