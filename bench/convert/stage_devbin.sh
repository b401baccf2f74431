#!/usr/bin/env bash
# Builds the conversion benchmark's binaries and stages them with their non-system shared
# libraries into a folder to carry to a GPU machine (default .devbin/convert, git-ignored).
# Usage: bench/convert/stage_devbin.sh [BUILD_DIR] [DEST]
set -euo pipefail
BUILD=${1:-build-convert}
DEST=${2:-.devbin/convert}
cmake --build "$BUILD" --target wpubctl convert_bench_checkpoint convert_gpu_test -j2
rm -rf "$DEST"
mkdir -p "$DEST/lib"
cp "$BUILD/server/wpubctl/wpubctl" "$BUILD/bench/convert/convert_bench_checkpoint" \
   "$BUILD/tests/convert/convert_gpu_test" "$DEST/"
# Every resolved library except the C runtime, libstdc++/libgcc (the GPU image's are newer and
# compatible) and the CUDA driver (it comes with the machine).
for bin in "$DEST"/wpubctl "$DEST"/convert_bench_checkpoint "$DEST"/convert_gpu_test; do
  ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda)\.so' \
  | while read -r lib; do cp -L "$lib" "$DEST/lib/"; done
cp tests/convert/check_output.py "$DEST/"
du -sh "$DEST"
