#!/usr/bin/env bash
# Long libFuzzer runs of every fuzz target, one after another, from a WPUB_FUZZ=ON build:
#   cmake -S . -B build-fuzz -G Ninja -DWPUB_FUZZ=ON -DCMAKE_C_COMPILER=clang \
#     -DCMAKE_CXX_COMPILER=clang++ -DWPUB_ENABLE_CUDA=OFF -DWPUB_BUILD_BENCH=OFF
#   cmake --build build-fuzz --target fuzz_publish fuzz_safetensors ...   (or: all)
#   tests/fuzz/run_fuzzers.sh build-fuzz 240 [target...]
# Each target starts from a copy of its seed corpus (tests/fuzz/corpus/<target>) in
# OUT/<target>/corpus, so the checked-in seeds stay as they are; crashes land in
# OUT/<target>/ (artifact_prefix) and the log in OUT/<target>.log. The summary line per target
# (executions, exec/s, coverage, corpus size, crashes) is what bench/results/fuzz.md records.
# OUT defaults to <build>/fuzz-runs.
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
    -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$out/$t/" \
    >"$out/$t.log" 2>&1
  rc=$?
  wall=$(($(date +%s) - start))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/$t.log" | grep -o '[0-9]*$')
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$out/$t.log" | grep -o '[0-9]*$')
  last=$(grep -E '^#[0-9]+' "$out/$t.log" | tail -1)
  cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*')
  ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*')
  corp=$(echo "$last" | grep -o 'corp: [0-9]*' | grep -o '[0-9]*')
  crashes=$(find "$out/$t" -maxdepth 1 -name 'crash-*' -o -maxdepth 1 -name 'leak-*' \
    -o -maxdepth 1 -name 'timeout-*' -o -maxdepth 1 -name 'oom-*' | wc -l)
  echo "$t: rc=$rc wall=${wall}s execs=${execs:-?} exec/s=${rate:-?} cov=${cov:-?} ft=${ft:-?}" \
    "corpus=${corp:-?} artifacts=$crashes"
done
