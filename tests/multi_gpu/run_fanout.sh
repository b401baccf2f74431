#!/usr/bin/env bash
# One device run of "one publisher, many engines" on a lent machine of 4 or 8 GPUs (it also runs
# on 2): the multi-rank tests (every other GPU a C++ engine: engines of one GPU with two update
# requests in flight, TP=2 engines, one engine killed mid-publication and the survivors commit),
# then the fan-out benchmark for engines of one GPU and of two (publication wall clock and plain
# broadcast busbw vs receiving ranks). About 6 minutes at most.
#
# Needs the binaries staged by `deploy/stage_devbin.sh <build dir> gpu_path` in .devbin/gpu_path.tgz
# (carried);
# writes summary.log, env.txt, fanout_tp1.json, fanout_tp2.json and logs.tar.gz to $OUT.
# Usage (from the repository root): bash tests/multi_gpu/run_fanout.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_device_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/wpub_logs.XXXXXX)
exec > >(tee -a "$OUT/summary.log") 2>&1

# shellcheck source=tests/multi_gpu/device_env.sh
source "$ROOT/tests/multi_gpu/device_env.sh"
GPUS=$(nvidia-smi -L | wc -l)

step "environment ($GPUS GPUs)"
{
  nvidia-smi -L
  nvidia-smi topo -m
  echo "NCCL_LIB=$NCCL_LIB"
  env | grep -E '^(NCCL|LD_LIBRARY)' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "multi-rank tests: GPU 0 -> C++ engines on GPUs 1..$((GPUS - 1))"
guarded "$(tmo 150 200)" "$BIN/multi_gpu_multi_rank_test" --gtest_color=no >"$LOGS/multi_rank.log" 2>&1
echo "--- multi_gpu_multi_rank_test: exit $?"
brief "$LOGS/multi_rank.log"

# Receiving ranks measured: 1, 3 and 7 on 8 GPUs; 1..3 on 4; 1 on 2.
if ((GPUS >= 8)); then RANKS=1,3,7; else RANKS=$(seq -s, 1 $((GPUS - 1))); fi
step "fan-out benchmark, engines of one GPU, ranks $RANKS"
guarded "$(tmo 120 80)" "$BIN/fanout_bench" --ranks "$RANKS" --tp 1 --iters 3 --bucket_mib 1024 \
  --json "$OUT/fanout_tp1.json" --log_dir "$LOGS"
echo "--- fanout_bench tp1: exit $?"
if ((GPUS >= 5)); then
  step "fan-out benchmark, TP=2 engines, ranks $((GPUS - 1 - (GPUS - 1) % 2))"
  guarded "$(tmo 100 10)" "$BIN/fanout_bench" --ranks $((GPUS - 1 - (GPUS - 1) % 2)) --tp 2 \
    --iters 3 --bucket_mib 1024 --json "$OUT/fanout_tp2.json" --log_dir "$LOGS"
  echo "--- fanout_bench tp2: exit $?"
fi

step "done"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
ls -la "$OUT"
