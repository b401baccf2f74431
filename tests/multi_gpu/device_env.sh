# Sourced by the device run scripts (run_h200x2.sh, run_fanout.sh) after they set ROOT and LOGS:
# the environment of a lent GPU machine (NCCL and CUPTI from the machine's Python wheels, staged
# libraries for wpub's binaries only, a python3 wrapper that keeps the machine's own), and the
# helpers tmo (step timeouts within WPUB_RUN_BUDGET_S), guarded (timeout + kill the process
# group), step (a timestamped heading) and brief (the lines of a gtest log worth reading).
# The staged binaries travel packed (deploy/stage_devbin.sh <build dir> gpu_path): unpacked when the folder
# is missing or older than the tarball.
# WPUB_DEVBIN names another staged set (e.g. $ROOT/.devbin/onegpu on a one-GPU call).
BIN=${WPUB_DEVBIN:-$ROOT/.devbin/gpu_path}
if [[ -f $BIN.tgz && ( ! -d $BIN || $BIN.tgz -nt $BIN ) ]]; then
  rm -rf "$BIN"
  tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")" && touch "$BIN"
fi
# NVLink multicast stays off on these machines (KINDS.md), also for child processes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
wheel_lib() {  # the lib folder of an nvidia.* wheel package, or nothing
  python3 -c "import os, $1 as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true
}
NCCL_LIB=$(wheel_lib nvidia.nccl)
if [[ ! -e $NCCL_LIB/libnccl.so.2 ]]; then  # fall back to whatever libnccl.so.2 is there
  NCCL_LIB=$(dirname "$(find / -xdev -name libnccl.so.2 2>/dev/null | head -1)")
fi
CUPTI_LIB=$(wheel_lib nvidia.cuda_cupti)  # dlopened by gpu_backend_test's CUPTI counter
# Python children (the SGLang emulator, the baseline) keep the machine's own libraries: the
# staged ones (Debian builds of zlib, OpenSSL, cudart) are for wpub's binaries only.
PYWRAP=$(mktemp /tmp/wpub_python.XXXXXX)
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec python3 "$@"\n' "${LD_LIBRARY_PATH:-}" >"$PYWRAP"
chmod +x "$PYWRAP"
export LD_LIBRARY_PATH=$BIN/lib${NCCL_LIB:+:$NCCL_LIB}${CUPTI_LIB:+:$CUPTI_LIB}:${LD_LIBRARY_PATH:-}
export WPUB_SOURCE_DIR=$ROOT WPUB_PYTHON=$PYWRAP WPUB_TEST_LOG_DIR=$LOGS
START=$(date +%s)
# Every step's timeout fits a total of WPUB_RUN_BUDGET_S seconds (default 570): min(its cap,
# what is left minus what the later steps are guaranteed). Reserves are written for the default
# budget and scale with a smaller or larger one, so a short budget shortens every step alike
# instead of starving the first ones.
tmo() {
  local cap=$1 budget=${WPUB_RUN_BUDGET_S:-570} reserve left
  reserve=$(($2 * budget / 570))
  left=$((budget - ($(date +%s) - START) - reserve))
  ((left < 10)) && left=10
  ((cap < left)) && echo "$cap" || echo "$left"
}
# shellcheck source=tests/gpu/guarded.sh
source "$ROOT/tests/gpu/guarded.sh"
step() { echo; echo "=== $(date -u +%H:%M:%S) (+$(($(date +%s) - START)) s) $*"; }
brief() {  # the lines of a gtest log worth reading
  grep -E '^\[ *(PASSED|FAILED|SKIPPED) *\]|Failure|Expected|Which is|Value of|error|Skipped|^version|^engine|experts/layer|aborted after|Stats|status|^TP=|engines, one killed|re-formed' "$1" | head -60
}

