#!/usr/bin/env bash
# Stages what tests/python/test_gpu_connect_publish.py needs on a GPU host that has Python,
# torch and grpcio but no wpub build: wpubd, wpub-recv and wpub-quantize-ref (and the one-GPU
# gpu_path_nccl_connect_test) from a CUDA build
# folder, and every shared library they need that such a host does not provide (found with ldd;
# glibc, libstdc++, libgcc_s, libnccl and the driver's libcuda are skipped: the host has its
# own), stripped, into .devbin/py_gpu/ (binaries) and .devbin/py_gpu/lib/. Then
# tests/python/run_gpu_connect.sh runs the test there.
# Usage: tests/python/stage_gpu_connect.sh [build dir, default build-p]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build-p}
DEST=$ROOT/.devbin/py_gpu
BINS=(server/wpubd/wpubd clients/recv/wpub-recv tests/python/wpub-quantize-ref
  tests/gpu_path/gpu_path_nccl_connect_test)
SKIP='^(libc|libm|libdl|libpthread|librt|libutil|libresolv|ld-linux[^ ]*|linux-vdso|libstdc\+\+|libgcc_s|libnccl|libcuda)\.so'
rm -rf "$DEST"
mkdir -p "$DEST/lib"
for b in "${BINS[@]}"; do
  if [[ ! -x $BUILD/$b ]]; then
    echo "missing $BUILD/$b (build wpubd wpub-recv wpub-quantize-ref gpu_path_nccl_connect_test first)" >&2
    exit 1
  fi
  cp "$BUILD/$b" "$DEST/"
  strip --strip-debug "$DEST/$(basename "$b")"
  ldd "$BUILD/$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ $SKIP ]]; then continue; fi
    if [[ ! -e $DEST/lib/$name ]]; then
      cp -L "$path" "$DEST/lib/$name"
      strip --strip-debug "$DEST/lib/$name" 2>/dev/null || true
    fi
  done
done
HELP=$("$BUILD/server/wpubd/wpubd" --helpfull 2>&1 || true)
if [[ $HELP != *--gpu_path* ]]; then
  echo "$BUILD/server/wpubd/wpubd has no --gpu_path flag (stale build?)" >&2
  exit 1
fi
grep -qx '/.devbin/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.devbin/' >>"$ROOT/.git/info/exclude"
SIZE=$(du -sm "$DEST" | cut -f1)
echo "staged ${#BINS[@]} binaries and $(ls "$DEST/lib" | wc -l) libraries: ${SIZE} MB in $DEST"
if ((SIZE >= 60)); then
  echo "too large for a carried path (>= 60 MB)" >&2
  exit 1
fi
