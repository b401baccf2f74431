#!/usr/bin/env bash
# Offline conversion on a GPU machine (kind nvidia-h200), from binaries staged by
# `deploy/stage_devbin.sh <build dir> convert` (unpacked from $BIN.tgz when only that was
# carried): the gpu-labelled CUDA-vs-CPU test, then a synthetic checkpoint of $GB GB (default 8)
# generated on local disk, converted with --device cuda and --device cpu, the two
# outputs compared byte for byte, the output loaded with Python's safetensors and checked
# against an independent numpy quantizer, throughput of both paths printed; then `wpubctl
# inspect` of the output and `wpubctl diff` of the two outputs (identical) and of the output
# against a 4over6 conversion (every NVFP4 tensor changes), timed against `cat` of the same
# files (the page cache's read rate). Logs go to $OUT.
# Usage: BIN=.devbin/convert OUT=$OUT bash bench/convert/run_h200.sh
# (GEN_ARGS adds generator flags, e.g. a small dry run: GB=0.02 GEN_ARGS="--hidden_size 256
# --moe_intermediate_size 128 --experts 8 --vocab_size 512 --shard_gb 0.004")
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-.devbin/convert}
[[ $BIN == /* ]] || BIN=$PWD/$BIN
OUT=${OUT:-device-out}
GB=${GB:-8}
WORK=${WORK:-/tmp/wpub-convert-bench}
PY=${PY:-python3}
mkdir -p "$OUT"
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
rc=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "cores: $(nproc)"; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$OUT/machine.txt"

echo "== gpu test"
timeout 150 "$BIN/convert_gpu_test" > "$OUT/gpu_test.log" 2>&1
r=$?; grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) *\]" "$OUT/gpu_test.log" | tail -8
echo "gpu test rc=$r"; [ $r -ne 0 ] && rc=1

echo "== generate ${GB} GB"
rm -rf "$WORK"; mkdir -p "$WORK"
start=$SECONDS
timeout 150 "$BIN/convert_bench_checkpoint" --dir "$WORK/in" --gb "$GB" ${GEN_ARGS:-} 2>&1 | tee "$OUT/generate.log"
echo "generate: $((SECONDS - start)) s" | tee -a "$OUT/generate.log"

for dev in cuda cpu; do
  echo "== convert --device $dev"
  timeout 240 "$BIN/wpubctl" convert --model_dir "$WORK/in" --save_dir "$WORK/out_$dev" \
    --device "$dev" --progress never > "$OUT/convert_$dev.log" 2>&1
  r=$?; cat "$OUT/convert_$dev.log"; echo "convert $dev rc=$r"; [ $r -ne 0 ] && rc=1
done

echo "== compare cuda vs cpu"
{
  n=0; bad=0
  for f in $(cd "$WORK/out_cuda" && find . -type f | sort); do
    n=$((n + 1))
    cmp -s "$WORK/out_cuda/$f" "$WORK/out_cpu/$f" || { bad=$((bad + 1)); echo "DIFFERS: $f"; }
  done
  [ "$(cd "$WORK/out_cuda" && find . -type f | wc -l)" = "$(cd "$WORK/out_cpu" && find . -type f | wc -l)" ] \
    || { bad=$((bad + 1)); echo "file lists differ"; }
  echo "compared $n files, $bad differ; bytes: $(du -sb "$WORK/out_cuda" | cut -f1)"
} 2>&1 | tee "$OUT/compare.txt"
grep -q " 0 differ" "$OUT/compare.txt" || rc=1

echo "== python safetensors check"
checked=$WORK/out_cuda; [ -d "$checked" ] || checked=$WORK/out_cpu
timeout 120 "$PY" "$ROOT/tests/convert/check_output.py" --input "$WORK/in" --output "$checked" \
  --samples 6 ${REQUIRE_ST:+--require-safetensors} 2>&1 | tee "$OUT/python_check.log"
[ "${PIPESTATUS[0]}" -ne 0 ] && rc=1

echo "== inspect and diff"
timeout 240 "$BIN/wpubctl" convert --model_dir "$WORK/in" --save_dir "$WORK/out_4o6" \
  --device cuda --recipe 4over6 --progress never > "$OUT/convert_4o6.log" 2>&1 || rc=1
{
  timed() {  # label, expected exit code, command...
    local label=$1 want=$2 t0 r
    shift 2
    t0=$(date +%s%N)
    "$@" > "$OUT/$label.txt" 2>&1
    r=$?
    echo "$label: $((($(date +%s%N) - t0) / 1000000)) ms, exit $r (want $want)"
    [ $r -eq "$want" ] || echo "FAILED: $label"
  }
  cat "$checked"/*.safetensors > /dev/null  # warm
  timed cat 0 sh -c "cat '$checked'/*.safetensors > /dev/null"
  timed inspect 0 "$BIN/wpubctl" inspect "$checked"
  timed diff_cuda_cpu 0 "$BIN/wpubctl" diff "$WORK/out_cuda" "$WORK/out_cpu"
  timed diff_4over6 1 "$BIN/wpubctl" diff "$checked" "$WORK/out_4o6"
  timed diff_4over6_1thread 1 "$BIN/wpubctl" diff "$checked" "$WORK/out_4o6" --cpu_threads 1
  echo "bytes: $(du -sb "$checked" | cut -f1) and $(du -sb "$WORK/out_4o6" | cut -f1)"
  head -12 "$OUT/diff_4over6.txt"
} 2>&1 | tee "$OUT/inspect_diff.txt"
grep -q FAILED "$OUT/inspect_diff.txt" && rc=1

echo "== summary"
for dev in cuda cpu; do echo "$dev: $(grep -E 'throughput|^seconds' "$OUT/convert_$dev.log" | tr -s ' ' | paste -sd ';')"; done \
  | tee "$OUT/summary.txt"
rm -rf "$WORK"
echo "run_h200 rc=$rc"
exit $rc
