#!/usr/bin/env bash
# Every GPU test of the project on ONE GPU (a lent nvidia-h200), NCCL paths included, within one
# device call (< 10 minutes). NCCL refuses two ranks on one device only when they report the same
# host: every process of an NCCL test gets a host identity of its own (NCCL_HOSTID) and NCCL's
# loopback socket transport (tests/multi_gpu/shared_gpu.h, tests/python/harness.nccl_env), so
# publisher and engine ranks share GPU 0 -- correct bytes and protocol, a socket's bandwidth.
#
# Staged binaries: deploy/stage_devbin.sh build onegpu (carry .devbin/onegpu.tgz).
# Two lanes run side by side (the GPU has room for both):
#   lane A, the GPU unit tests: kernels against the CPU reference, status kernels, the bucket diff against the host diff, the CUDA IPC
#     cache, the converter's CUDA path and its output read by the real `safetensors` library
#     (when importable) and `wpubctl inspect`, the GPU backend, rendezvous, the rollout group,
#     SGLang driver, dirty engines and GPU path; then vLLM's rendezvous refusal
#     (vllm_handshake.py) and the Python client's one-GPU tests (CUDA IPC, the two-rank gather,
#     two GPU-path daemons as one group to a pull receiver);
#   lane B, the NCCL tests: tests/multi_gpu (byte-exact versions from trainer IPC memory,
#     non-finite rejection, receiver killed mid-publication, host syncs flat in experts, the
#     engine with GPU components, C++ engines with host and device checksums, a C++ engine that
#     keeps its weights taking device-made bucket patches (format 3), mismatched channel
#     counts), the multi-rank tests (2 engines, 2 TP=2 engines with a process per rank, 3 engines
#     with one killed), publication groups over NCCL (group_nccl.py: two publishers, a shared
#     engine, a follower killed), the vLLM emulator and C++ vLLM engine (vllm_nccl.py: three
#     versions byte for byte per release, non-finite rejection, an engine killed), SGLang and
#     vLLM engines in one publication, a dirty SGLang engine whose retry commits, and SGLang
#     and vLLM engines restored from the retained copy (in device, pinned and host memory)
#     after an abort, restarted and caught up (engines_nccl.py), bucket patches from a device
#     copy to a wpub-recv receiver, byte-identical to one pulling whole buckets (patches_gpu.py), colocated SGLang engines taking
#     three versions in wpub's GPU memory over CUDA IPC, one killed mid-handover, an aborted attempt
#     retried (colocated_gpu.py), and ConnectEngines + CUDA IPC publications from Python
#     (test_gpu_connect_publish).
# Writes to $OUT: verdicts.txt (one line per test: PASS/FAIL/SKIP, seconds, the test's own
# summary), summary.log, the JSON results of the Python runs, logs.tar.gz (every log).
# Exit status 0 when every test passed.
# Usage (from the repository root): bash tests/gpu/run_one_gpu.sh [A|B|TEST ...]
#   (default: both lanes; TEST names run only those tests, e.g. group_nccl multi_gpu_publish_test)
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_one_gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/wpub_one_gpu.XXXXXX)
: >"$OUT/verdicts.txt"
exec > >(tee -a "$OUT/summary.log") 2>&1
BIN=${WPUB_DEVBIN:-$ROOT/.devbin/onegpu}
if [[ -f $BIN.tgz && (! -d $BIN || $BIN.tgz -nt $BIN) ]]; then
  rm -rf "$BIN" && tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")" && touch "$BIN"
fi
# NVLink multicast stays off on these machines, also for child processes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
wheel_lib() {  # the lib folder of an nvidia.* wheel package, or nothing
  python3 -c "import os, $1 as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true
}
NCCL_LIB=$(wheel_lib nvidia.nccl)
CUPTI_LIB=$(wheel_lib nvidia.cuda_cupti)  # dlopened by gpu_backend_test's CUPTI counter
LIBS=$BIN/lib${NCCL_LIB:+:$NCCL_LIB}${CUPTI_LIB:+:$CUPTI_LIB}
# wpub's binaries get the staged libraries through wrappers; Python keeps the machine's own.
WRAP=$(mktemp -d /tmp/wpub_wrap.XXXXXX)
for b in wpubd wpub-recv wpub-quantize-ref; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$LIBS:${LD_LIBRARY_PATH:-}" \
    "$BIN/$b" >"$WRAP/$b"
  chmod +x "$WRAP/$b"
done
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec python3 "$@"\n' "${LD_LIBRARY_PATH:-}" >"$WRAP/python"
chmod +x "$WRAP/python"
export WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv WPUB_QUANTIZE_REF=$WRAP/wpub-quantize-ref
export WPUB_SOURCE_DIR=$ROOT WPUB_PYTHON=$WRAP/python PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
echo "NCCL_LIB=$NCCL_LIB"
echo "engines on GPU ${WPUB_TEST_ENGINE_GPU:-(1 when there are two GPUs, else 0: shared)}"

ONLY=()  # test names given on the command line: run only those
# want NAME: whether NAME runs (every test when none was named).
want() {
  ((${#ONLY[@]} == 0)) && return 0
  local n
  for n in "${ONLY[@]}"; do [[ $n == "$1" ]] && return 0; done
  return 1
}
# verdict NAME RC SECONDS SUMMARY: one line of verdicts.txt (rc 77: skipped).
verdict() {
  local v=PASS
  (($2 == 77)) && v=SKIP
  (($2 != 0 && $2 != 77)) && v=FAIL
  printf '%-34s %s %4ss  %s\n' "$1" "$v" "$3" "$4" | tee -a "$OUT/verdicts.txt"
}
# shellcheck source=tests/gpu/guarded.sh
source "$ROOT/tests/gpu/guarded.sh"
# gtest NAME TIMEOUT: a staged gtest binary; the verdict carries its counts.
gtest() {
  want "$1" || return 0
  local t0=$SECONDS log=$LOGS/$1.log
  LD_LIBRARY_PATH="$LIBS:${LD_LIBRARY_PATH:-}" WPUB_TEST_LOG_DIR=$LOGS/$1.d \
    guarded "$2" "$BIN/$1" --gtest_color=no >"$log" 2>&1
  local rc=$?
  local passed failed skipped
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$')
  failed=$(grep -cE '^\[  FAILED  \] [A-Za-z]' "$log")
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$')
  if ((rc == 0)) && [[ -n $skipped && ${passed:-0} == 0 ]]; then rc=77; fi
  local note="passed ${passed:-0}, failed $((failed / 2)), skipped ${skipped:-0}"
  ((rc == 124)) && note+=", TIMED OUT"
  verdict "$1" "$rc" $((SECONDS - t0)) "$note"
  grep -E '^\[  FAILED  \]|^\[  SKIPPED \] [A-Za-z]|Skipped|Failure$' "$log" | head -8 |
    sed 's/^/    /'
  return "$rc"
}
# script NAME TIMEOUT CMD...: a Python run writing OUT_DIR/NAME.json (copied to $OUT).
script() {
  local name=$1 t=$2 t0=$SECONDS
  shift 2
  want "$name" || return 0
  guarded "$t" "$@" "$LOGS/$name" >"$LOGS/$name.log" 2>&1
  local rc=$?
  cp "$LOGS/$name/$name.json" "$OUT/" 2>/dev/null
  verdict "$name" "$rc" $((SECONDS - t0)) "$(tail -1 "$LOGS/$name.log" | cut -c1-150)"
  return "$rc"
}
# unittest NAME TIMEOUT MODULE...: Python client tests (tests/python).
unittest_run() {
  local name=$1 t=$2 t0=$SECONDS log=$LOGS/$1.log
  shift 2
  want "$name" || return 0
  (cd "$ROOT/tests/python" && PYTHONPATH=$ROOT/clients/python WPUB_TEST_KEEP=1 \
    TMPDIR=$LOGS guarded "$t" python3 -m unittest -v "$@") >"$log" 2>&1
  local rc=$?
  verdict "$name" "$rc" $((SECONDS - t0)) "$(grep -E '^Ran |^OK|^FAILED' "$log" | tr '\n' ' ')"
  grep -E '(ERROR|FAIL):' "$log" | head -8 | sed 's/^/    /'
  return "$rc"
}

lane_a() {
  local rc=0
  for t in kernels_gpu_test:300 kernels_status_test:60 kernels_bucket_diff_test:120 gpu_ipc_cache_test:60 \
    convert_gpu_test:120 gpu_backend_test:120 rendezvous_test:60 rollout_group_test:120 \
    rollout_sglang_driver_test:120 rollout_sglang_dirty_test:120 rollout_gpu_path_test:60; do
    gtest "${t%%:*}" "${t##*:}" || rc=1
  done
  if ! want convert_read_by_safetensors; then
    :
  elif python3 -c "import numpy, torch, safetensors" 2>/dev/null; then
    local t0=$SECONDS d
    d=$(mktemp -d /tmp/wpub_convert.XXXXXX)
    {
      LD_LIBRARY_PATH="$LIBS" "$BIN/convert_bench_checkpoint" --dir "$d/in" --gb 0.05 \
        --hidden_size 512 --moe_intermediate_size 256 --experts 16 --vocab_size 1024 \
        --shard_gb 0.01 --threads 8 &&
        LD_LIBRARY_PATH="$LIBS" "$BIN/wpubctl" convert --model_dir "$d/in" --save_dir "$d/out" \
          --device cuda --num_layers_at_start_in_bf16 1 --progress never &&
        python3 "$ROOT/tests/convert/check_output.py" --input "$d/in" --output "$d/out" \
          --samples 16 --require-safetensors &&
        LD_LIBRARY_PATH="$LIBS" "$BIN/wpubctl" inspect "$d/out"
    } >"$LOGS/convert_safetensors.log" 2>&1
    local r=$?
    rm -rf "$d"
    verdict convert_read_by_safetensors "$r" $((SECONDS - t0)) \
      "$(grep -E '^OK|Error|problem' "$LOGS/convert_safetensors.log" | head -2 | tr '\n' ' ')"
    ((r != 0)) && rc=1
  else
    verdict convert_read_by_safetensors 77 0 "numpy, torch or safetensors not importable"
  fi
  script vllm_handshake 120 python3 "$ROOT/tests/multi_gpu/vllm_handshake.py" || rc=1
  unittest_run python_gpu_one_gpu 300 test_local_gather.LocalGatherCudaTest \
    test_local_gather.LocalGatherDTensorTest test_gpu_ipc \
    test_gpu_group test_proto_compat test_client_glue.TargetAndVersionTest || rc=1
  return $rc
}

lane_b() {
  local rc=0
  gtest multi_gpu_publish_test 300 || rc=1
  gtest multi_gpu_multi_rank_test 240 || rc=1
  script group_nccl 240 python3 "$ROOT/tests/multi_gpu/group_nccl.py" || rc=1
  script vllm_nccl 300 python3 "$ROOT/tests/multi_gpu/vllm_nccl.py" || rc=1
  script engines_nccl 480 python3 "$ROOT/tests/multi_gpu/engines_nccl.py" || rc=1
  script patches_gpu 180 python3 "$ROOT/tests/multi_gpu/patches_gpu.py" || rc=1
  script colocated_gpu 240 python3 "$ROOT/tests/multi_gpu/colocated_gpu.py" || rc=1
  unittest_run python_gpu_connect_publish 240 test_gpu_connect_publish || rc=1
  # The GPU-path benchmark on the shared GPU, only when named: its figures are a socket's.
  if [[ " ${ONLY[*]} " == *" gpu_path_bench "* ]]; then
    local t0=$SECONDS
    LD_LIBRARY_PATH="$LIBS:${LD_LIBRARY_PATH:-}" guarded 300 "$BIN/gpu_path_bench" \
      --layers 4 --experts 32 --iters 2 --bucket_mib 64 --json "$OUT/gpu_path_bench.json" \
      --cpp_receiver "$BIN/multi_gpu_cpp_receiver" --log_dir "$LOGS" >"$LOGS/gpu_path_bench.log" 2>&1
    local r=$?
    verdict gpu_path_bench "$r" $((SECONDS - t0)) "$(grep -E '^\(a\)|^device' "$LOGS/gpu_path_bench.log" |
      head -2 | tr '\n' ' ' | cut -c1-150)"
    ((r != 0)) && rc=1
  fi
  return $rc
}

lanes=()
for a in "$@"; do
  case $a in
    A | B) lanes+=("$a") ;;
    *) ONLY+=("$a") ;;
  esac
done
((${#lanes[@]} == 0)) && lanes=(A B)
pids=()
for lane in "${lanes[@]}"; do
  case $lane in
    A) lane_a >"$LOGS/lane_A.log" 2>&1 & pids+=($!) ;;
    B) lane_b >"$LOGS/lane_B.log" 2>&1 & pids+=($!) ;;
  esac
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo
echo "=== verdicts (+$(($(date +%s) - START)) s)"
cat "$OUT/verdicts.txt"
for lane in "${lanes[@]}"; do
  echo "--- lane $lane"
  grep -E '^    ' "$LOGS/lane_$lane.log" | head -40
done
tar -czf "$OUT/logs.tar.gz" --exclude='expect*' --exclude='*.safetensors' --exclude='*.bin' \
  -C "$LOGS" . 2>/dev/null
echo "--- all: exit $rc"
exit $rc
