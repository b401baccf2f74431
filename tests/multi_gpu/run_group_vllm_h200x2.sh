#!/usr/bin/env bash
# The NCCL runs of publication groups and of vLLM engines on a two-GPU host (nvidia-h200-x2):
# tests/multi_gpu/group_nccl.py (two GPU-path wpubd on GPU 0, each its own weight-update group
# to one SGLang emulator on GPU 1 joined to both) and tests/multi_gpu/vllm_nccl.py (wpubd on GPU 0
# to the vLLM emulator on GPU 1, both packing placements). Needs the binaries staged by
# `deploy/stage_devbin.sh <build dir> gpu_path` in .devbin/gpu_path.tgz (carried). Writes
# summary.log, group_nccl.json, vllm_nccl.json and the logs to $OUT.
# Usage (from the repository root): bash tests/multi_gpu/run_group_vllm_h200x2.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_group_vllm_out}
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
rc=0
for run in group_nccl vllm_nccl; do
  WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv WPUB_QUANTIZE_REF=$WRAP/wpub-quantize-ref \
    timeout 280 "$PYWRAP" "$ROOT/tests/multi_gpu/$run.py" "$OUT/$run"
  r=$?
  echo "--- $run: exit $r"
  ((r != 0)) && rc=1
  cp "$OUT/$run/$run.json" "$OUT/" 2>/dev/null
  tar -czf "$OUT/$run-logs.tar.gz" --exclude='expect*' -C "$OUT/$run" . 2>/dev/null
done
exit $rc
