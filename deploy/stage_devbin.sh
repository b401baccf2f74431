#!/usr/bin/env bash
# Stages built binaries for a run on a GPU machine that has none of the build dependencies:
# copies them, stripped of debug info, into .devbin/<set>/ at the repository root, every shared
# library they need that the machine does not provide into .devbin/<set>/lib/ (found with ldd;
# the C runtime, libstdc++, libgcc_s, NCCL and the driver's libcuda are skipped: the machine has
# its own, newer and compatible, and NCCL comes from its Python wheels), plus CUPTI when the
# toolkit has it (the CUPTI sync counters dlopen it, so ldd does not list it), and packs that
# folder into .devbin/<set>.tgz: the one path to carry (it must stay under 60 MB). The run
# scripts unpack it on the device when the folder is missing or older.
#
# Usage: deploy/stage_devbin.sh [--build] BUILD_DIR SET [BINARY...]
#   SET onegpu: every test tests/gpu/run_one_gpu.sh runs on one GPU (GPU unit tests, multi_gpu,
#                multi-rank, groups, vLLM and mixed engines over NCCL, Python GPU tests) plus
#                the GPU-path and NVFP4 kernel benchmarks, and the colocated payload tool
#                (bench/rollout/colocated_decode.py)
#   SET gpu_path (or gpu): every GPU test and benchmark, for tests/multi_gpu/run_all_h200x2.sh,
#                run_h200x2.sh, run_fanout.sh and tests/python/run_gpu_{connect,gather}.sh
#   SET kernels: the NVFP4 GPU tests, kernel benchmark and L2 probe (bench/kernels/device_run.sh)
#   SET convert: wpubctl, the conversion benchmark's generator and its GPU test
#                (bench/convert/run_h200.sh)
#   any other SET (letters, digits, _ and -): exactly the BINARY paths given
#   BINARY: a path relative to BUILD_DIR (or absolute), added to the set's own
#   --build: first builds the binaries' targets (cmake --build BUILD_DIR --target ... -j2)
# e.g. deploy/stage_devbin.sh build-gpu gpu_path
#      deploy/stage_devbin.sh --build build-gpu kernels
#      deploy/stage_devbin.sh build-gpu probe tests/gpu/gpu_backend_test
set -euo pipefail
usage() {
  sed -n '/^# Usage:/,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_FIRST=0
if [[ ${1:-} == --build ]]; then
  BUILD_FIRST=1
  shift
fi
(($# >= 2)) || usage
[[ -d $1 ]] || { echo "no build directory $1" >&2; exit 2; }
BUILD=$(cd "$1" && pwd)
SET=$2
shift 2
case $SET in
  onegpu)
    BINS=(
      tests/kernels_gpu/kernels_gpu_test
      tests/kernels_gpu/kernels_status_test
      tests/kernels_gpu/kernels_bucket_diff_test
      tests/gpu/gpu_ipc_cache_test
      tests/gpu/gpu_backend_test
      tests/convert/convert_gpu_test
      tests/rendezvous/rendezvous_test
      tests/rollout/rollout_group_test
      tests/rollout/rollout_gpu_path_test
      tests/rollout/rollout_sglang_driver_test
      tests/rollout/rollout_sglang_dirty_test
      tests/rollout/wpub-colocated-payload
      tests/multi_gpu/multi_gpu_publish_test
      tests/multi_gpu/multi_gpu_ipc_trainer
      tests/multi_gpu/multi_gpu_cpp_receiver
      tests/multi_gpu/multi_gpu_multi_rank_test
      server/wpubd/wpubd
      server/wpubctl/wpubctl
      clients/recv/wpub-recv
      tests/python/wpub-quantize-ref
      bench/convert/convert_bench_checkpoint
      bench/gpu_path/gpu_path_bench
      bench/gpu_path/delta_bench
      bench/kernels/nvfp4_kernels_bench
      bench/kernels/bucket_diff_bench
    )
    ;;
  gpu | gpu_path)
    SET=gpu_path
    BINS=(
      tests/multi_gpu/multi_gpu_publish_test
      tests/multi_gpu/multi_gpu_ipc_trainer
      tests/multi_gpu/multi_gpu_cpp_receiver
      tests/multi_gpu/multi_gpu_multi_rank_test
      tests/rendezvous/rendezvous_test
      tests/rollout/rollout_sglang_driver_test
      tests/gpu/gpu_ipc_cache_test
      tests/gpu/gpu_backend_test
      tests/kernels_gpu/kernels_status_test
      tests/rollout/rollout_group_test
      tests/rollout/rollout_gpu_path_test
      tests/rollout/rollout_sglang_dirty_test
      tests/rollout/wpub-colocated-payload
      bench/gpu_path/gpu_path_bench
      bench/gpu_path/fanout_bench
      server/wpubd/wpubd
      clients/recv/wpub-recv
      tests/python/wpub-quantize-ref
      tests/kernels_gpu/kernels_gpu_test
      bench/kernels/nvfp4_kernels_bench
      bench/kernels/l2_reuse_bench
      bench/rollout/driver_bench
    )
    ;;
  kernels)
    BINS=(tests/kernels_gpu/kernels_gpu_test tests/kernels_gpu/kernels_bucket_diff_test
      bench/kernels/bucket_diff_bench bench/kernels/nvfp4_kernels_bench
      bench/kernels/l2_reuse_bench)
    ;;
  convert)
    BINS=(server/wpubctl/wpubctl bench/convert/convert_bench_checkpoint
      tests/convert/convert_gpu_test)
    ;;
  *)
    [[ $SET =~ ^[A-Za-z0-9_-]+$ ]] || { echo "set name '$SET': letters, digits, _ and - only" >&2; exit 2; }
    (($# > 0)) || { echo "set '$SET' is not predefined: name its binaries" >&2; exit 2; }
    BINS=()
    ;;
esac
BINS+=("$@")
path_of() { [[ $1 == /* ]] && echo "$1" || echo "$BUILD/$1"; }

if ((BUILD_FIRST)); then
  cmake --build "$BUILD" -j2 --target "${BINS[@]##*/}"
fi
missing=0
for b in "${BINS[@]}"; do
  if [[ ! -x $(path_of "$b") ]]; then
    echo "missing $(path_of "$b") (build it first, or pass --build)" >&2
    missing=1
  fi
done
((missing == 0)) || exit 1

DEST=$ROOT/.devbin/$SET
SKIP='^(libc|libm|libdl|libpthread|librt|libutil|libresolv|ld-linux[^ ]*|linux-vdso|libstdc\+\+|libgcc_s|libnccl|libcuda)\.so'
rm -rf "$DEST" "$DEST.tgz"
mkdir -p "$DEST/lib"
for b in "${BINS[@]}"; do
  bin=$(path_of "$b")
  cp "$bin" "$DEST/"
  strip --strip-debug "$DEST/$(basename "$bin")"
  ldd "$bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ $SKIP ]]; then continue; fi
    if [[ ! -e $DEST/lib/$name || $path -nt $DEST/lib/$name ]]; then
      cp -L "$path" "$DEST/lib/$name"
      strip --strip-debug "$DEST/lib/$name" 2>/dev/null || true
    fi
  done
done
CUDA=${CUDA_HOME:-/usr/local/cuda}
CUPTI=$(ls "$CUDA"/lib64/libcupti.so.1[0-9]* "$CUDA"/lib/libcupti.so.1[0-9]* \
  "$CUDA"/extras/CUPTI/lib64/libcupti.so.1[0-9]* 2>/dev/null | head -1 || true)
if [[ -n $CUPTI ]]; then
  cp -L "$CUPTI" "$DEST/lib/$(basename "$CUPTI" | sed -E 's/^(libcupti\.so\.[0-9]+).*/\1/')"
fi
tar -czf "$DEST.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
SIZE=$(du -sm "$DEST.tgz" | cut -f1)
echo "staged $((${#BINS[@]})) binaries and $(ls "$DEST/lib" | wc -l) libraries: $(du -sm "$DEST" | cut -f1) MB in $DEST, ${SIZE} MB packed in $DEST.tgz (carry that)"
if ((SIZE >= 60)); then
  echo "too large for a carried path (>= 60 MB)" >&2
  exit 1
fi
