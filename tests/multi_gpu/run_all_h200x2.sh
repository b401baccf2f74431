#!/usr/bin/env bash
# Every GPU check of one session on a lent nvidia-h200-x2 machine, within one command (< 600 s):
#   1. tests/multi_gpu/run_h200x2.sh: GPU-path unit and backend tests, multi_gpu and multi-rank
#      tests, the GPU-path benchmark, the fan-out benchmark, the PyTorch baseline ($OUT/gpu_path);
#   2. tests/python/run_gpu_connect.sh: ConnectEngines and torch CUDA tensors published through
#      wpubd to wpub-recv on GPU 1, bit-exact ($OUT/python);
#   3. bench/kernels/device_run.sh tests bench: the NVFP4 GPU tests and kernel benchmark on GPU 0
#      ($OUT/kernels).
# Needs `deploy/stage_devbin.sh <build dir> gpu_path` staged (carry .devbin/gpu_path.tgz).
# Usage (from the repository root): bash tests/multi_gpu/run_all_h200x2.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_device_out}
BIN=$ROOT/.devbin/gpu_path
# The staged binaries travel packed (deploy/stage_devbin.sh): unpacked when the folder
# is missing or older than the tarball.
if [[ -f $ROOT/.devbin/gpu_path.tgz && ( ! -d $ROOT/.devbin/gpu_path ||
  $ROOT/.devbin/gpu_path.tgz -nt $ROOT/.devbin/gpu_path ) ]]; then
  rm -rf "$ROOT/.devbin/gpu_path"
  tar -xzf "$ROOT/.devbin/gpu_path.tgz" -C "$ROOT/.devbin" && touch "$ROOT/.devbin/gpu_path"
fi
START=$(date +%s)
left() { echo $((${WPUB_RUN_BUDGET_S:-570} - ($(date +%s) - START))); }

OUT=$OUT/gpu_path WPUB_RUN_BUDGET_S=${WPUB_GPU_PATH_BUDGET_S:-300} \
  bash "$ROOT/tests/multi_gpu/run_h200x2.sh" >/dev/null 2>&1
echo "gpu_path: exit $? at +$(($(date +%s) - START)) s"

OUT=$OUT/python WPUB_DEVBIN=$BIN timeout "$(($(left) - 150))" \
  bash "$ROOT/tests/python/run_gpu_connect.sh" >/dev/null 2>&1
echo "python: exit $? at +$(($(date +%s) - START)) s"

# The kernels' run script takes the staged libraries from $BIN/lib.
export NCCL_NVLS_ENABLE=0
OUT=$OUT/kernels BIN=$BIN \
  timeout "$(($(left) - 5))" bash "$ROOT/bench/kernels/device_run.sh" tests bench >/dev/null 2>&1
echo "kernels: exit $? at +$(($(date +%s) - START)) s"
