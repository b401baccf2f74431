// Device-side fill of the benchmark's synthetic weights (tens of GB: a host fill would dominate
// the run): bf16 values from a counter-based hash, roughly N(0, 0.02)-sized with outliers.
#include "bench/gpu_path/fill.h"

#include <cuda_bf16.h>

namespace wpub::bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void FillKernel(uint16_t* out, uint64_t n, uint64_t seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const uint64_t r = Mix(seed ^ i);
    float v = static_cast<float>(static_cast<int64_t>(r >> 11) - (int64_t{1} << 52)) *
              (1.0f / 4503599627370496.0f);
    v *= (r & 0xFF) == 0 ? 0.5f : 0.02f;
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    out[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

}  // namespace

cudaError_t FillBf16(void* data, uint64_t elements, uint64_t seed, cudaStream_t stream) {
  if (elements == 0) return cudaSuccess;
  FillKernel<<<132 * 16, 256, 0, stream>>>(static_cast<uint16_t*>(data), elements, seed);
  return cudaGetLastError();
}

}  // namespace wpub::bench
