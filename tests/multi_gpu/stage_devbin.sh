#!/usr/bin/env bash
# Stages the GPU-path binaries for a device run: copies them and every shared library they
# need that the device image does not provide (found with ldd; glibc, libstdc++, libgcc_s,
# libnccl and the driver's libcuda are skipped: the device has its own) into
# .devbin/gpu_path/ (binaries) and .devbin/gpu_path/lib/ at the repository root, stripped of
# debug info, and packs that folder into .devbin/gpu_path.tgz: the one path to carry (it must
# stay under 60 MB; the run scripts unpack it on the device).
# Usage: tests/multi_gpu/stage_devbin.sh [build dir, default build-gpu] [--all]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build-gpu}
DEST=$ROOT/.devbin/gpu_path
BINS=(
  tests/multi_gpu/multi_gpu_publish_test
  tests/multi_gpu/multi_gpu_ipc_trainer
  tests/multi_gpu/multi_gpu_cpp_receiver
  tests/multi_gpu/multi_gpu_multi_rank_test
  tests/gpu_path/gpu_path_rendezvous_test
  tests/gpu_path/gpu_path_sglang_driver_test
  tests/gpu_path/gpu_path_ipc_test
  tests/gpu_path/gpu_path_backend_test
  tests/gpu_path/gpu_path_status_kernels_test
  bench/gpu_path/gpu_path_bench
  bench/gpu_path/fanout_bench
)
# With --all: also what tests/python/run_gpu_connect.sh and bench/kernels/device_run.sh run, so
# one carried folder serves tests/multi_gpu/run_all_h200x2.sh.
if [[ ${2:-} == --all ]]; then
  BINS+=(
    server/wpubd/wpubd
    clients/recv/wpub-recv
    tests/python/wpub-quantize-ref
    tests/gpu_path/gpu_path_nccl_connect_test
    tests/kernels_gpu/kernels_gpu_test
    bench/kernels/nvfp4_kernels_bench
    bench/kernels/l2_reuse_bench
    bench/rollout/driver_bench
  )
fi
SKIP='^(libc|libm|libdl|libpthread|librt|libutil|libresolv|ld-linux[^ ]*|linux-vdso|libstdc\+\+|libgcc_s|libnccl|libcuda)\.so'
rm -rf "$DEST"
mkdir -p "$DEST/lib"
for b in "${BINS[@]}"; do
  if [[ ! -x $BUILD/$b ]]; then
    echo "missing $BUILD/$b (build it first)" >&2
    exit 1
  fi
  cp "$BUILD/$b" "$DEST/"
  strip --strip-debug "$DEST/$(basename "$b")"
  ldd "$BUILD/$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ $SKIP ]]; then continue; fi
    if [[ ! -e $DEST/lib/$name || $path -nt $DEST/lib/$name ]]; then
      cp -L "$path" "$DEST/lib/$name"
      strip --strip-debug "$DEST/lib/$name" 2>/dev/null || true
    fi
  done
done
# CUPTI is dlopened by the CUPTI sync counters (no ldd entry): staged when the toolkit has it.
CUDA=${CUDA_HOME:-/usr/local/cuda}
CUPTI=$(ls "$CUDA"/lib64/libcupti.so.1[0-9]* "$CUDA"/extras/CUPTI/lib64/libcupti.so.1[0-9]* 2>/dev/null | head -1 || true)
if [[ -n $CUPTI ]]; then
  cp -L "$CUPTI" "$DEST/lib/$(basename "$CUPTI" | sed -E 's/^(libcupti\.so\.[0-9]+).*/\1/')"
fi
# Keep the staged folder out of git (it travels as a carried path).
grep -qx '/.devbin/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.devbin/' >>"$ROOT/.git/info/exclude"
# Carried as one gzip'd tarball (the run scripts unpack it when the folder is absent).
tar -czf "$DEST.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
SIZE=$(du -sm "$DEST.tgz" | cut -f1)
echo "staged $(ls "$DEST" | wc -l) binaries and $(ls "$DEST/lib" | wc -l) libraries: $(du -sm "$DEST" | cut -f1) MB in $DEST, ${SIZE} MB packed in $DEST.tgz (carry that)"
if ((SIZE >= 60)); then
  echo "too large for a carried path (>= 60 MB)" >&2
  exit 1
fi
