#!/usr/bin/env bash
# One device run of the GPU publication path on a lent nvidia-h200-x2 machine (two H200s):
# environment check, the GPU-path unit tests and the one-GPU backend test (CPU reference,
# CUPTI sync count), the multi_gpu tests (wpub GPU 0 -> SGLang emulator GPU 1: byte-exact
# versions from IPC memory, non-finite rejection, receiver killed mid-publication, host syncs
# for 8 vs 128 experts, C++ engines with host and device checksums), the multi-rank tests (as
# many receiving ranks as the machine has GPUs), the benchmark (a) (a1) (a') (b) (d) (e) on the
# Qwen3-30B-A3B-shaped model, the fan-out benchmark and the PyTorch baseline (c). About 8 minutes
# at most.
#
# Needs the binaries staged by `deploy/stage_devbin.sh <build dir> gpu_path` in .devbin/gpu_path.tgz
# (carried), and
# writes 8 files to $OUT: summary.log, env.txt, bench.json, bench_tuned.json (the recommended NCCL
# settings), fanout.json, baseline.json, results.json and
# logs.tar.gz (emulator, trainer, baseline and per-test logs).
# Usage (from the repository root): bash tests/multi_gpu/run_h200x2.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_device_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/wpub_logs.XXXXXX)
exec > >(tee -a "$OUT/summary.log") 2>&1

# shellcheck source=tests/multi_gpu/device_env.sh
source "$ROOT/tests/multi_gpu/device_env.sh"

step "environment"
{
  nvidia-smi -L
  nvidia-smi topo -m
  "$PYWRAP" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  echo "NCCL_LIB=$NCCL_LIB"
  echo "CUPTI_LIB=$CUPTI_LIB"
  for b in "$BIN"/*; do
    if [[ -f $b ]] && ldd "$b" | grep -q "not found"; then
      echo "missing libraries for $b:"
      ldd "$b" | grep "not found"
    fi
  done
  env | grep -E '^(NCCL|TORCH|NVSHMEM|LD_LIBRARY)' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "GPU-path unit tests and the one-GPU backend test (CPU reference, CUPTI sync count)"
for t in rendezvous_test rollout_sglang_driver_test gpu_ipc_cache_test \
  gpu_backend_test kernels_status_test; do
  guarded "$(tmo 60 440)" "$BIN/$t" --gtest_color=no >"$LOGS/$t.log" 2>&1
  echo "--- $t: exit $?"
  brief "$LOGS/$t.log"
done

step "multi_gpu tests (GPU 0 -> SGLang emulator on GPU 1)"
guarded "$(tmo 220 320)" "$BIN/multi_gpu_publish_test" --gtest_color=no >"$LOGS/multi_gpu_publish_test.log" 2>&1
echo "--- multi_gpu_publish_test: exit $?"
brief "$LOGS/multi_gpu_publish_test.log"

step "multi-rank tests (GPU 0 -> C++ engines on every other GPU)"
guarded "$(tmo 90 240)" "$BIN/multi_gpu_multi_rank_test" --gtest_color=no >"$LOGS/multi_gpu_multi_rank_test.log" 2>&1
echo "--- multi_gpu_multi_rank_test: exit $?"
brief "$LOGS/multi_gpu_multi_rank_test.log"

step "benchmark (a) wpub nvfp4, (a') pipelined amax, (b) wpub bf16, (d) plain NCCL broadcast"
guarded "$(tmo 180 140)" "$BIN/gpu_path_bench" --iters 3 --bucket_mib 1024 --sm_sweep 112 --ctas_sweep 0,2 --kernel_trace 1 --json "$OUT/bench.json" \
  --log_dir "$LOGS"
echo "--- gpu_path_bench: exit $?"

step "benchmark with the recommended NCCL settings on every rank (P2P reads, 16 MiB buffers, 32 channels)"
guarded "$(tmo 120 80)" env NCCL_P2P_READ_ENABLE=1 NCCL_BUFFSIZE=16777216 "$BIN/gpu_path_bench" \
  --iters 3 --bucket_mib 1024 --nccl_ctas 32 --json "$OUT/bench_tuned.json" --log_dir "$LOGS"
echo "--- gpu_path_bench (tuned NCCL): exit $?"

step "fan-out benchmark (publication and plain broadcast vs receiving ranks)"
guarded "$(tmo 60 60)" "$BIN/fanout_bench" --iters 3 --bucket_mib 1024 --json "$OUT/fanout.json" \
  --log_dir "$LOGS"
echo "--- fanout_bench: exit $?"

step "benchmark (c) PyTorch per-expert baseline"
guarded "$(tmo 120 5)" "$PYWRAP" "$ROOT/bench/gpu_path/torch_baseline.py" --max_seconds 60 \
  --json "$OUT/baseline.json" >"$LOGS/torch_baseline.log" 2>&1
echo "--- torch_baseline: exit $?"
tail -20 "$LOGS/torch_baseline.log"

step "ratios"
"$PYWRAP" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n)
    return json.load(open(p)) if os.path.exists(p) else None
bench, base, tuned = load("bench.json"), load("baseline.json"), load("bench_tuned.json")
res = {"bench": bench, "baseline": base, "bench_tuned_nccl": tuned}
if tuned:
    print(f"recommended NCCL settings: (a)/max(roofline,(d)) = "
          f"{tuned['summary']['a_over_max_roofline_d']:.2f}")
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
