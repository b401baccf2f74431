#!/usr/bin/env bash
# Static SASS instruction counts of the NVFP4 quantize kernels and of one block's worth of each
# block routine, from sm_90 cubins compiled with the library's flags (needs nvcc only; no
# disassembler: every sm_90 instruction is 16 bytes, so a kernel's .text size / 16 is its
# instruction count). Per element = (probe kN=2 - probe kN=1) / 16, see sass_probe.cu.
# Usage: bench/kernels/sass_count.sh [work dir]   (run from the repository root)
set -euo pipefail
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
W=${1:-$(mktemp -d)}
mkdir -p "$W"
FLAGS=(-cubin -arch=sm_90 -O2 -DNDEBUG -fmad=false --expt-relaxed-constexpr -std=c++17 -I.
  -Xcompiler=-Wno-unknown-pragmas)
count() {  # cubin -> "instructions demangled-name" per kernel
  readelf -S -W "$1" 2>/dev/null | awk '$2 ~ /^\.text\./ {print $2, $6}' |
    while read -r name size; do
      echo "$((16#$size / 16)) $(echo "${name#.text.}" | c++filt)"
    done
}
"$NVCC" "${FLAGS[@]}" bench/kernels/sass_probe.cu -o "$W/probe.cubin"
echo "== per 16-element block (probe kN=2 minus kN=1), bf16 input =="
count "$W/probe.cubin" | sed -E 's/wpub::kernels::cuda::detail:://g; s/wpub::kernels:://g' |
  awk '{n=$1; $1=""; key=$0; sub(/, [12]>\(.*/, "", key); split($0, p, ", "); k=substr(p[length(p)-0], 1, 1);
        if ($0 ~ /, 1>\(/) one[key]=n; else two[key]=n}
       END {for (k in two) printf "%6d per block  %5.1f per element  %s\n", two[k]-one[k], (two[k]-one[k])/16, k}' |
  sort -k5
for f in quantize_modes_standard quantize_modes_4o6_mse quantize_modes_4o6_mae; do
  "$NVCC" "${FLAGS[@]}" "kernels/cuda/$f.cu" -o "$W/$f.cubin"
done
echo "== whole QuantizeKernel, bf16 input (both paths, prologue and stores included) =="
for f in quantize_modes_standard quantize_modes_4o6_mse quantize_modes_4o6_mae; do
  count "$W/$f.cubin" | grep "QuantizeKernel<(wpub::kernels::ElemType)0" |
    sed -E 's/wpub::kernels::cuda::detail:://g; s/wpub::kernels:://g; s/\(wpub::kernels::[A-Za-z]+\)//g'
done
