#!/usr/bin/env bash
# Builds the NVFP4 GPU tests, the kernel benchmark and the L2 reuse probe and stages them,
# stripped, with their non-system shared libraries (libcudart, and libcupti for the CUPTI test's
# dlopen) into one folder to carry to a GPU machine (default .devbin/kernels, git-ignored), where
# device_run.sh runs them.
# Usage: bench/kernels/stage_devbin.sh [BUILD_DIR] [DEST]   (from the repository root)
set -euo pipefail
BUILD=${1:-build-k}
DEST=${2:-.devbin/kernels}
CUDA=${CUDA_HOME:-/usr/local/cuda}
BINS=(tests/kernels_gpu/kernels_gpu_test bench/kernels/nvfp4_kernels_bench
  bench/kernels/l2_reuse_bench)
cmake --build "$BUILD" --target "${BINS[@]##*/}" -j2
rm -rf "$DEST"
mkdir -p "$DEST"
for bin in "${BINS[@]}"; do cp "$BUILD/$bin" "$DEST/"; strip "$DEST/${bin##*/}"; done
# Every resolved library except the C runtime, libstdc++/libgcc (the GPU image's are newer and
# compatible) and the CUDA driver (it comes with the machine).
for bin in "${BINS[@]}"; do
  ldd "$DEST/${bin##*/}" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda)\.so' \
  | while read -r lib; do cp -L "$lib" "$DEST/"; done
cupti=$(ls "$CUDA"/lib/libcupti.so.1[0-9]* "$CUDA"/lib64/libcupti.so.1[0-9]* \
  "$CUDA"/extras/CUPTI/lib64/libcupti.so.1[0-9]* 2>/dev/null | head -1 || true)
if [ -n "$cupti" ]; then
  cp -L "$cupti" "$DEST/$(basename "$cupti" | sed -E 's/^(libcupti\.so\.[0-9]+).*/\1/')"
fi
ls -la "$DEST"
du -sh "$DEST"
