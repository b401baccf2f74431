#!/usr/bin/env bash
# Runs the one-GPU Python tests of the client on a GPU host (e.g. nvidia-h200) with the binaries
# staged by `deploy/stage_devbin.sh <build> gpu_path` (carry .devbin/gpu_path.tgz):
# test_local_gather.LocalGatherCudaTest (two trainer processes on GPU 0; rank 1's CUDA shards
# reach rank 0 as CUDA IPC references over gloo; rank 0 publishes through a GPU-path wpubd to
# a gRPC-pull wpub-recv, bit-exact against the reference), test_gpu_ipc, and the CPU-side
# client tests that need no daemon (protobuf/grpcio compatibility, argument checks).
# Writes summary.log and the tests' work folders (logs, no safetensors) as logs.tar.gz to $OUT.
# Exit status: the Python tests'.
# Usage (from the repository root): bash tests/python/run_gpu_gather.sh
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_py_gather_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/summary.log") 2>&1
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
python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "gloo", torch.distributed.is_gloo_available(), "grpcio", grpc.__version__, "protobuf", p.__version__)'
KEEP=$(mktemp -d /tmp/wpub_py_keep.XXXXXX)
cd "$ROOT/tests/python" || exit 1
PYTHONPATH=$ROOT/clients/python PYTHONDONTWRITEBYTECODE=1 WPUB_TEST_KEEP=1 TMPDIR=$KEEP \
  WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv WPUB_QUANTIZE_REF=$WRAP/wpub-quantize-ref \
  timeout 540 python3 -m unittest -v test_local_gather.LocalGatherCudaTest \
  test_local_gather.LocalGatherDTensorTest test_gpu_ipc test_gpu_group \
  test_proto_compat test_client_glue.TargetAndVersionTest
rc=$?
echo "--- exit $rc"
tar -czf "$OUT/logs.tar.gz" --exclude="*.safetensors" -C "$KEEP" . 2>/dev/null
exit $rc
