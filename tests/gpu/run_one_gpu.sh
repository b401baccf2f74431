#!/usr/bin/env bash
# Every test one GPU runs (nvidia-h200), with the binaries staged by
#   deploy/stage_devbin.sh build onegpu server/wpubd/wpubd clients/recv/wpub-recv \
#     server/wpubctl/wpubctl tests/python/wpub-quantize-ref tests/rollout/rollout_group_test \
#     tests/rollout/rollout_sglang_driver_test tests/rollout/rollout_sglang_dirty_test \
#     tests/rollout/rollout_gpu_path_test tests/gpu/gpu_backend_test tests/gpu/gpu_ipc_cache_test \
#     tests/kernels_gpu/kernels_gpu_test tests/kernels_gpu/kernels_status_test \
#     tests/convert/convert_gpu_test bench/convert/convert_bench_checkpoint
# (carry .devbin/onegpu.tgz): the GPU gtests (kernels against the CPU reference, status kernels,
# the IPC cache, the converter's CUDA path), a CUDA conversion read back by the real
# `safetensors` library with torch (check_output.py --require-safetensors, as the engines load
# it) and `wpubctl inspect` of it, then tests/python/run_gpu_group.sh (the rollout group, SGLang
# driver, dirty engines, GPU path, GPU backend, vLLM's rendezvous and the Python GPU tests).
# Logs to $OUT. Exit status 0 when everything passed.
# Usage (from the repository root): bash tests/gpu/run_one_gpu.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_one_gpu_out}
mkdir -p "$OUT"
BIN=${WPUB_DEVBIN:-$ROOT/.devbin/onegpu}
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
NCCL_LIB=$(python3 -c "import os, nvidia.nccl as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH="$BIN/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}" NCCL_NVLS_ENABLE=0
nvidia-smi -L
rc=0
for t in kernels_gpu_test kernels_status_test gpu_ipc_cache_test convert_gpu_test; do
  timeout 400 "$BIN/$t" --gtest_color=no >"$OUT/$t.log" 2>&1
  r=$?
  echo "--- $t: exit $r $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' ')"
  ((r != 0)) && rc=1
done
if python3 -c "import numpy, torch, safetensors" 2>/dev/null; then
  d=$(mktemp -d /tmp/wpub_convert.XXXXXX)
  {
    "$BIN/convert_bench_checkpoint" --dir "$d/in" --gb 0.05 --hidden_size 512 \
      --moe_intermediate_size 256 --experts 16 --vocab_size 1024 --shard_gb 0.01 --threads 8 &&
      "$BIN/wpubctl" convert --model_dir "$d/in" --save_dir "$d/out" --device cuda \
        --num_layers_at_start_in_bf16 1 --progress never &&
      python3 "$ROOT/tests/convert/check_output.py" --input "$d/in" --output "$d/out" \
        --samples 16 --require-safetensors
  } >"$OUT/convert_safetensors.log" 2>&1
  r=$?
  "$BIN/wpubctl" inspect "$d/out" >"$OUT/inspect.txt" 2>&1
  ri=$?
  rm -rf "$d"
  echo "--- convert read by safetensors: exit $r; wpubctl inspect: exit $ri"
  grep -E "^loader|^OK|Error|assert" "$OUT/convert_safetensors.log" | head -5
  ((r != 0 || ri != 0)) && rc=1
else
  echo "--- convert read by safetensors: skipped (numpy, torch or safetensors not importable)"
fi
WPUB_DEVBIN=$BIN OUT=$OUT/group bash "$ROOT/tests/python/run_gpu_group.sh"
r=$?
((r != 0)) && rc=1
echo "--- all: exit $rc"
exit $rc
