#!/usr/bin/env bash
# One-GPU run of publication groups and of vLLM's rendezvous (nvidia-h200) with binaries staged by
# `deploy/stage_devbin.sh build-gpu group server/wpubd/wpubd clients/recv/wpub-recv
# tests/python/wpub-quantize-ref tests/rollout/... tests/gpu/gpu_backend_test` (carry
# .devbin/group.tgz): the GPU-side unit tests touched by groups (rollout group, SGLang driver
# with and without lifecycle calls, dirty engines, GPU path, GPU backend), then the Python GPU
# tests -- two GPU-path wpubd publishing CUDA IPC inputs as one group version to a wpub-recv
# subscribed to both (test_gpu_group), CUDA IPC and the two-rank gather. Logs to $OUT.
# Usage (from the repository root): bash tests/python/run_gpu_group.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_gpu_group_out}
mkdir -p "$OUT"
BIN=${WPUB_DEVBIN:-$ROOT/.devbin/group}  # staged binaries (lib/ beside them)
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
NCCL_LIB=$(python3 -c "import os, nvidia.nccl as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true)
rc=0
for t in rollout_group_test rollout_sglang_driver_test rollout_sglang_dirty_test \
  rollout_gpu_path_test gpu_backend_test; do
  LD_LIBRARY_PATH="$BIN/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}" NCCL_NVLS_ENABLE=0 \
    timeout 200 "$BIN/$t" --gtest_color=no >"$OUT/$t.log" 2>&1
  r=$?
  echo "--- $t: exit $r $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
  ((r != 0)) && rc=1
done
# vLLM's rendezvous against the daemon's TCPStore, and the emulator's packed decoding (one GPU).
WRAP=$(mktemp -d /tmp/wpub_wrap.XXXXXX)
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' \
  "$BIN/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}" "$BIN/wpubd" >"$WRAP/wpubd"
chmod +x "$WRAP/wpubd"
NCCL_NVLS_ENABLE=0 WPUBD=$WRAP/wpubd timeout 120 python3 "$ROOT/tests/multi_gpu/vllm_handshake.py" \
  "$OUT/vllm" >"$OUT/vllm_handshake.log" 2>&1
r=$?
tail -1 "$OUT/vllm_handshake.log"
echo "--- vllm handshake: exit $r"
((r != 0)) && rc=1
OUT=$OUT/python WPUB_DEVBIN=$BIN bash "$ROOT/tests/python/run_gpu_gather.sh" >"$OUT/python.log" 2>&1
r=$?
grep -E "\.\.\. |^Ran |^OK|^FAILED" "$OUT/python.log" | tail -40
echo "--- python GPU tests: exit $r"
((r != 0)) && rc=1
exit $rc
