#!/usr/bin/env bash
# Runs the NVFP4 GPU tests, a compute-sanitizer memcheck subset, the kernel benchmark and the L2
# reuse probe on a GPU machine from prebuilt binaries in $BIN (default .devbin/kernels, staged by
# `deploy/stage_devbin.sh <build dir> kernels`: kernels_gpu_test, nvfp4_kernels_bench,
# l2_reuse_bench, and libcudart and libcupti in $BIN/lib; unpacked from $BIN.tgz when only that
# was carried).
# Logs go to $OUT (default ./device-out). Usage: device_run.sh [tests|sanitize|bench|l2]...
set -uo pipefail
BIN=${BIN:-.devbin/kernels}
[[ $BIN == /* ]] || BIN=$PWD/$BIN
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize bench)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
rc=0
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      start=$(date +%s)
      timeout 300 "$BIN/kernels_gpu_test" > "$OUT/tests.log" 2>&1
      r=$?
      grep -E "^\[ *(FAILED|PASSED|SKIPPED) *\]|Failure|tests? ran|Segmentation|Abort" "$OUT/tests.log" | tail -40
      grep -E "^\[ RUN" "$OUT/tests.log" | tail -1
      echo "tests rc=$r in $(( $(date +%s) - start )) s"; [ $r -ne 0 ] && rc=1 ;;
    sanitize)
      timeout 200 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \
        "$BIN/kernels_gpu_test" --gtest_brief=1 \
        --gtest_filter='Spec/StrictMatrixTest.*/bfloat16_31x128_*:Spec/StrictMatrixTest.*/float16_3x48_*:ListTest.MultiPart*:ListTest.Rank3*:ListTest.RejectsBad*:ListTest.GateUp*:ListTest.QdqComputeAmaxResident*' \
        > "$OUT/sanitize.log" 2>&1
      r=$?; tail -15 "$OUT/sanitize.log"; echo "sanitize rc=$r"; [ $r -ne 0 ] && rc=1 ;;
    bench)
      timeout 300 "$BIN/nvfp4_kernels_bench" --iters 50 --warmup 5 --json "$OUT/bench.json" \
        2>&1 | tee "$OUT/bench.log"
      r=${PIPESTATUS[0]}; echo "bench rc=$r"; [ $r -ne 0 ] && rc=1 ;;
    l2)
      timeout 120 "$BIN/l2_reuse_bench" 2>&1 | tee "$OUT/l2_reuse.log"
      r=${PIPESTATUS[0]}; echo "l2 rc=$r"; [ $r -ne 0 ] && rc=1 ;;
  esac
done
exit $rc
