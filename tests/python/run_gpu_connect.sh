#!/usr/bin/env bash
# Runs rollout_group_test and tests/python/test_gpu_connect_publish.py (plus the
# client's fake-service and protobuf-compatibility tests) on a GPU host (the engine on GPU 1, or
# sharing GPU 0 on a machine of one: harness.nccl_env; tests/gpu/run_one_gpu.sh runs the same
# test with every other one) with the binaries staged by `deploy/stage_devbin.sh <build> gpu_path`
# (carry .devbin/gpu_path.tgz). The binaries get the staged libraries (and torch's NCCL wheel)
# through small wrapper scripts, so the Python process itself keeps the host's own libraries.
# Writes summary.log and the tests' work folders (wpubd and engine logs, no safetensors) as
# logs.tar.gz to $OUT. Exit status: the Python tests'.
# Usage (from the repository root): bash tests/python/run_gpu_connect.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_py_gpu_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/summary.log") 2>&1
# NVLink multicast stays off on these machines, also for child processes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BIN=${WPUB_DEVBIN:-$ROOT/.devbin/gpu_path}  # staged binaries (lib/ beside them)
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
NCCL_LIB=$(python3 -c "import os, nvidia.nccl as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true)
if [[ ! -e $NCCL_LIB/libnccl.so.2 ]]; then
  NCCL_LIB=$(dirname "$(find / -xdev -name libnccl.so.2 2>/dev/null | head -1)")
fi
WRAP=$(mktemp -d /tmp/wpub_wrap.XXXXXX)
for b in wpubd wpub-recv wpub-quantize-ref; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' \
    "$BIN/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}" "$BIN/$b" >"$WRAP/$b"
  chmod +x "$WRAP/$b"
done
nvidia-smi -L
python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "grpcio", grpc.__version__, "protobuf", p.__version__)'
echo "NCCL_LIB=$NCCL_LIB"
echo "=== rollout_group_test (one GPU: ConnectEngines failure paths, no-engine publication)"
LD_LIBRARY_PATH="$BIN/lib${NCCL_LIB:+:$NCCL_LIB}:${LD_LIBRARY_PATH:-}" timeout 120 \
  "$BIN/rollout_group_test" --gtest_color=no 2>&1 | tail -25
echo "--- rollout_group_test: exit ${PIPESTATUS[0]}"
echo "=== Python: connect_engines + CUDA IPC publications to wpub-recv on GPU 1"
KEEP=$(mktemp -d /tmp/wpub_py_keep.XXXXXX)
cd "$ROOT/tests/python" || exit 1
PYTHONPATH=$ROOT/clients/python PYTHONDONTWRITEBYTECODE=1 WPUB_TEST_KEEP=1 TMPDIR=$KEEP \
  WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv WPUB_QUANTIZE_REF=$WRAP/wpub-quantize-ref \
  timeout 540 python3 -m unittest -v test_gpu_connect_publish test_connect_engines.FakeDaemonTest \
  test_proto_compat
rc=$?
echo "--- exit $rc"
tar -czf "$OUT/logs.tar.gz" --exclude="*.safetensors" -C "$KEEP" . 2>/dev/null
exit $rc
