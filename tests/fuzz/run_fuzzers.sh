#!/usr/bin/env bash
# Long libFuzzer runs of every fuzz target, one after another, from a WPUB_FUZZ=ON build:
#   cmake -S . -B build-fuzz -G Ninja -DWPUB_FUZZ=ON -DCMAKE_C_COMPILER=clang \
#     -DCMAKE_CXX_COMPILER=clang++ -DWPUB_ENABLE_CUDA=OFF -DWPUB_BUILD_BENCH=OFF
#   cmake --build build-fuzz --target fuzz_publish fuzz_safetensors ...   (or: all)
#   tests/fuzz/run_fuzzers.sh build-fuzz 240 [target...]
# Each target starts from a copy of its seed corpus (tests/fuzz/corpus/<target>) in
# OUT/<target>/corpus, so the checked-in seeds stay as they are. The run is libFuzzer's fork
# mode with one job at a time (-fork=1 -ignore_crashes=1): a crash is saved under
# OUT/<target>/ (artifact_prefix) and fuzzing goes on, so one known crash does not end the run.
# The log is OUT/<target>.log; the summary line per target (executions, exec/s, coverage,
# features, corpus size, crashes) is what bench/results/fuzz.md records. OUT defaults to
# <build>/fuzz-runs.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: $0 BUILD_DIR SECONDS [target...]}
seconds=${2:?usage: $0 BUILD_DIR SECONDS [target...]}
shift 2
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(publish safetensors tcp_store update_request sglang_answers policy)
fi
out=${OUT:-$build/fuzz-runs}
mkdir -p "$out"
# Leaks are reported by the sanitizer unit tests; a fuzz run stops only for crashes.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

for t in "${targets[@]}"; do
  bin=$(find "$build" -name "fuzz_$t" -type f -perm -u+x | head -1)
  if [ -z "$bin" ]; then
    echo "$t: no fuzz_$t binary under $build (configure with -DWPUB_FUZZ=ON)" >&2
    exit 2
  fi
  rm -rf "$out/$t" && mkdir -p "$out/$t/corpus"
  cp "$here/corpus/$t"/* "$out/$t/corpus/"
  dict=()
  [ -f "$here/dict/$t.dict" ] && dict=(-dict="$here/dict/$t.dict")
  max_len=4096
  case "$t" in publish) max_len=16384 ;; safetensors | update_request | policy) max_len=8192 ;; esac
  start=$(date +%s)
  nice "$bin" "$out/$t/corpus" "${dict[@]}" -max_total_time="$seconds" -max_len=$max_len \
    -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 -timeout=30 \
    -rss_limit_mb=4096 -artifact_prefix="$out/$t/" >"$out/$t.log" 2>&1
  rc=$?
  wall=$(($(date +%s) - start))
  # Fork mode's progress lines: "#N: cov: C ft: F corp: K exec/s: R oom/timeout/crash: a/b/c ..."
  last=$(grep -E '^#[0-9]+: cov' "$out/$t.log" | tail -1)
  field() { echo "$last" | grep -oE "$1 [0-9/]+" | awk '{print $NF}'; }
  execs=$(echo "$last" | grep -oE '^#[0-9]+' | tr -d '#')
  artifacts=$(find "$out/$t" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' \
    -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  # Fork mode's own exec/s is the last job's rate; the average over the run is execs / wall.
  avg=$(( ${execs:-0} / (wall > 0 ? wall : 1) ))
  echo "$t: rc=$rc wall=${wall}s execs=${execs:-?} exec/s(avg)=$avg cov=$(field 'cov:')" \
    "ft=$(field 'ft:') corpus=$(field 'corp:') oom/timeout/crash=$(field 'crash:')" \
    "artifacts=$artifacts"
done
