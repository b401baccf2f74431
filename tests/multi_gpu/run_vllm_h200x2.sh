#!/usr/bin/env bash
# vLLM engines over NCCL on a two-GPU host (nvidia-h200-x2): wpubd on GPU 0 to the vLLM emulator
# on GPU 1 over vLLM's weight-transfer protocol
# (tests/multi_gpu/vllm_nccl.py). Needs the binaries staged by
# `deploy/stage_devbin.sh <build dir> gpu_path` in .devbin/gpu_path.tgz (carried). Writes
# summary.log, vllm_nccl.json and the logs to $OUT.
# Usage (from the repository root): bash tests/multi_gpu/run_vllm_h200x2.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_vllm_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/summary.log") 2>&1
# shellcheck source=tests/multi_gpu/device_env.sh
source "$ROOT/tests/multi_gpu/device_env.sh"
WRAP=$(mktemp -d /tmp/wpub_wrap.XXXXXX)
for b in wpubd wpub-recv wpub-quantize-ref; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$LD_LIBRARY_PATH" "$BIN/$b" >"$WRAP/$b"
  chmod +x "$WRAP/$b"
done
nvidia-smi -L
WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv WPUB_QUANTIZE_REF=$WRAP/wpub-quantize-ref \
  timeout 500 "$PYWRAP" "$ROOT/tests/multi_gpu/vllm_nccl.py" "$OUT/run"
rc=$?
cp "$OUT/run/vllm_nccl.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" --exclude=expect -C "$OUT/run" . 2>/dev/null
echo "--- exit $rc"
exit $rc
