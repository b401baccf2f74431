#!/usr/bin/env bash
# One device call on a one-GPU host (kind nvidia-h200): the GPU tests of the staged build, then
# the one-GPU figures of two builds alternated (before/after a change): the GPU backend alone and
# to an in-process gRPC-pull receiver (gpu_path_bench --backend_only 1), and the NVFP4 kernels
# (standard and 4over6 quantize, fused QDQ: nvfp4_kernels_bench). Carry .devbin/gpu_path.tgz (the
# build under test, staged by `deploy/stage_devbin.sh <build> gpu_path`) and, for the comparison, a tarball of the
# other build's gpu_path_bench and nvfp4_kernels_bench as .devbin/before.tgz (same lib/ is used).
# Writes every log under $OUT. Usage: bash bench/gpu_path/run_h200_one_gpu.sh [tests] [compare]
# [pause]; pause: the engines' pause windows at the Qwen3-30B-A3B shape (gpu_path_bench
# --pause_windows 1: the C++ engine and the SGLang emulator sharing GPU 0 over NCCL's sockets);
# restore: the retained copy's cost on a publication and its restores, in device, pinned and host
# memory (gpu_path_bench --restore 1, RESTORE_LAYERS layers of the Qwen3-30B-A3B shape, default
# 24 so that two versions' worth of device copies fit an 80 GB card beside the BF16 model).
# colocated: the GPU backend alone against the same publication handed over in GPU memory to
# colocated SGLang emulators on the same GPU (gpu_path_bench --colocated 1, COLOC_LAYERS layers of
# the Qwen3-30B-A3B shape, default 24).
# delta: delta publication against full publications to a gRPC-pull receiver under the AdamW
# update model (delta_bench, DELTA_LAYERS layers of the Qwen3-30B-A3B shape, default 24;
# DELTA_LR, default 1e-6; 2 warm-up + DELTA_VERSIONS patched versions, default 10, and
# DELTA_FULL_VERSIONS full ones, default 3: a full version pulls the whole model, ~12 s;
# DELTA_PATCH_THREADS, the receiver's rebuild threads, default 8); delta_nccl: the same to a
# wpub-recv NCCL engine keeping its weights on GPU 0 (--engine_patches; NCCL's socket transport,
# the GPU shared), patches broadcast in format 3 and applied on its GPU.
# WPUB_DEVBIN=$PWD/.devbin/onegpu runs the one-GPU set (deploy/stage_devbin.sh <build> onegpu).
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_h200_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
source "$ROOT/tests/multi_gpu/device_env.sh"
if [[ -f $ROOT/.devbin/before.tgz && ! -d $ROOT/.devbin/before ]]; then
  tar -xzf "$ROOT/.devbin/before.tgz" -C "$ROOT/.devbin"
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests compare)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
rc=0
run_test() {  # name [gtest args...]
  local name=$1
  shift
  local t0=$(date +%s)
  timeout 300 "$BIN/$name" "$@" >"$LOGS/$name.log" 2>&1
  local r=$?
  echo "$name rc=$r $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/$name.log" | tr '\n' ' ') $(( $(date +%s) - t0 )) s"
  grep -E '^\[  FAILED  \]' "$LOGS/$name.log" | head -10
  [ $r -ne 0 ] && rc=1
}
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      for t in gpu_backend_test kernels_status_test gpu_ipc_cache_test \
        rollout_group_test rollout_gpu_path_test rollout_sglang_driver_test \
        rollout_sglang_dirty_test rendezvous_test kernels_gpu_test; do
        [[ -x $BIN/$t ]] && run_test "$t"
      done
      OUT=$OUT/python bash "$ROOT/tests/python/run_gpu_gather.sh" >"$LOGS/python_gpu.log" 2>&1
      r=$?
      echo "python GPU tests rc=$r: $(grep -E '^(Ran|OK|FAILED)' "$LOGS/python_gpu.log" | tr '\n' ' ')"
      [ $r -ne 0 ] && rc=1 ;;
    colocated)
      timeout 400 "$BIN/gpu_path_bench" --colocated 1 --layers "${COLOC_LAYERS:-24}" --iters 3 \
        --bucket_mib "${COLOC_BUCKET_MIB:-512}" --log_dir "$LOGS" --json "$OUT/colocated.json" \
        >"$LOGS/colocated.log" 2>&1
      r=$?
      echo "colocated rc=$r"
      grep -E '^device|^\((e|g)|goal' "$LOGS/colocated.log" | head -20
      [ $r -ne 0 ] && rc=1 ;;
    pause)
      timeout 300 "$BIN/gpu_path_bench" --pause_windows 1 --iters 3 --log_dir "$LOGS" \
        --json "$OUT/pause_windows.json" >"$LOGS/pause_windows.log" 2>&1
      r=$?
      echo "pause windows rc=$r"
      grep -E '^\(a|paused' "$LOGS/pause_windows.log" | head -20
      grep -E '^ +paused' "$LOGS/pause_windows.log" | head -20
      [ $r -ne 0 ] && rc=1 ;;
    restore)
      timeout 420 "$BIN/gpu_path_bench" --restore 1 --layers "${RESTORE_LAYERS:-24}" --iters 3 \
        --log_dir "$LOGS" --json "$OUT/restore.json" >"$LOGS/restore.log" 2>&1
      r=$?
      echo "restore rc=$r"
      grep -E '^\(|restore' "$LOGS/restore.log" | head -30
      [ $r -ne 0 ] && { tail -20 "$LOGS/restore.log"; rc=1; } ;;
    delta | delta_nccl)
      extra=()
      [[ $step == delta_nccl ]] && extra=(--nccl_engine "$BIN/wpub-recv")
      timeout 540 "$BIN/delta_bench" --layers "${DELTA_LAYERS:-24}" --lr "${DELTA_LR:-1e-6}" \
        --patch_threads "${DELTA_PATCH_THREADS:-8}" \
        --versions "${DELTA_VERSIONS:-10}" --full_versions "${DELTA_FULL_VERSIONS:-3}" \
        "${extra[@]}" --json "$OUT/$step.json" >"$LOGS/$step.log" 2>&1
      r=$?
      echo "$step rc=$r"
      grep -E '^(device|full|patches|median)' "$LOGS/$step.log" | head -40
      [ $r -ne 0 ] && { tail -20 "$LOGS/$step.log"; rc=1; } ;;
    compare)
      B=$ROOT/.devbin/before
      for round in 1 2; do
        for side in before after; do
          d=$BIN
          [[ $side == before ]] && d=$B
          [[ -x $d/gpu_path_bench ]] || continue
          timeout 240 "$d/gpu_path_bench" --backend_only 1 --iters 5 \
            --json "$OUT/backend_${side}_$round.json" >"$LOGS/backend_${side}_$round.log" 2>&1
          echo "backend $side $round rc=$?"
          grep -E '^\((e|f)\)' "$LOGS/backend_${side}_$round.log"
          timeout 240 "$d/nvfp4_kernels_bench" --iters 20 --warmup 3 \
            --json "$OUT/kernels_${side}_$round.json" >"$LOGS/kernels_${side}_$round.log" 2>&1
          echo "kernels $side $round rc=$?"
        done
      done ;;
  esac
done
exit $rc
