#!/usr/bin/env bash
# One device run of the GPU publication path on a lent nvidia-h200-x2 machine (two H200s):
# environment check, the GPU-path unit tests, the multi_gpu tests (wpub GPU 0 -> SGLang
# emulator GPU 1: byte-exact versions from IPC memory, non-finite rejection, receiver killed
# mid-publication, host syncs for 8 vs 128 experts), the benchmark (a) (b) (d) on the
# Qwen3-30B-A3B-shaped model, and the PyTorch baseline (c). About 8 minutes at most.
#
# Needs the binaries staged by tests/multi_gpu/stage_devbin.sh in .devbin/ (carried), and
# writes at most 6 files to $OUT: summary.log, bench.json, baseline.json, results.json,
# logs.tar.gz (emulator, trainer and test logs) and env.txt.
# Usage (from the repository root): bash tests/multi_gpu/run_h200x2.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_device_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/wpub_logs.XXXXXX)
SUMMARY=$OUT/summary.log
exec > >(tee -a "$SUMMARY") 2>&1

# NVLink multicast stays off on these machines (KINDS.md), also for child processes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(n.__path__[0], "lib"))' \
  2>/dev/null || true)
if [[ ! -e $NCCL_LIB/libnccl.so.2 ]]; then  # fall back to whatever libnccl.so.2 torch ships
  NCCL_LIB=$(dirname "$(find / -xdev -name libnccl.so.2 2>/dev/null | head -1)")
fi
# Python children (the SGLang emulator, the baseline) keep the machine's own libraries: the
# staged ones (Debian builds of zlib, OpenSSL, cudart) are for wpub's binaries only.
PY_LD=${LD_LIBRARY_PATH:-}
PYWRAP=$(mktemp /tmp/wpub_python.XXXXXX)
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec python3 "$@"\n' "$PY_LD" >"$PYWRAP"
chmod +x "$PYWRAP"
export LD_LIBRARY_PATH=$ROOT/.devbin/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}
export WPUB_SOURCE_DIR=$ROOT WPUB_PYTHON=$PYWRAP WPUB_TEST_LOG_DIR=$LOGS
BIN=$ROOT/.devbin
START=$(date +%s)
step() { echo; echo "=== $(date -u +%H:%M:%S) (+$(($(date +%s) - START)) s) $*"; }

step "environment"
{
  nvidia-smi -L
  nvidia-smi topo -m
  "$PYWRAP" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  echo "NCCL_LIB=$NCCL_LIB"
  ls "$NCCL_LIB" 2>/dev/null
  for b in "$BIN"/*; do [[ -f $b ]] && ldd "$b" | grep -E "not found" && echo "^ missing in $b"; done
  env | grep -E '^(NCCL|TORCH|NVSHMEM|LD_LIBRARY)' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "GPU-path unit tests (no multi-GPU needed)"
for t in gpu_path_rendezvous_test gpu_path_sglang_driver_test gpu_path_ipc_test; do
  timeout 120 "$BIN/$t" --gtest_brief=1 >"$LOGS/$t.log" 2>&1
  echo "$t: exit $? ($(grep -E 'PASSED|FAILED' "$LOGS/$t.log" | head -3 | tr '\n' ' '))"
done

step "multi_gpu tests"
timeout 240 "$BIN/multi_gpu_publish_test" --gtest_color=no 2>&1 | tee "$LOGS/multi_gpu_publish_test.log" |
  grep -vE '^\[ *(RUN|OK) *\]$'
echo "multi_gpu_publish_test: exit ${PIPESTATUS[0]}"

step "benchmark (a) wpub nvfp4, (b) wpub bf16, (d) plain NCCL broadcast"
timeout 200 "$BIN/gpu_path_bench" --iters 3 --bucket_mib 1024 --json "$OUT/bench.json" \
  --log_dir "$LOGS"
echo "gpu_path_bench: exit $?"

step "benchmark (c) PyTorch per-expert baseline"
timeout 150 "$PYWRAP" "$ROOT/bench/gpu_path/torch_baseline.py" --max_seconds 75 \
  --json "$OUT/baseline.json" >"$LOGS/torch_baseline.log" 2>&1
echo "torch_baseline: exit $?"
tail -20 "$LOGS/torch_baseline.log"

step "ratios"
"$PYWRAP" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n)
    return json.load(open(p)) if os.path.exists(p) else None
bench, base = load("bench.json"), load("baseline.json")
res = {"bench": bench, "baseline": base}
if bench and base:
    a = bench["rows"][0]["wall_seconds"]
    res["c_over_a"] = base["wall_seconds"] / a
    print(f"(c)/(a) = {res['c_over_a']:.1f} (goal >= 5); (a)/max(roofline,(d)) = "
          f"{bench['summary']['a_over_max_roofline_d']:.2f} (goal <= 1.3)")
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
PY

step "done"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
ls -la "$OUT"
