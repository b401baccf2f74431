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

// A N(0, 1)-like draw from one 64-bit hash: four 16-bit uniforms summed, centred and scaled to
// unit variance (Irwin-Hall; no transcendental functions, so a step costs a few instructions).
__device__ __forceinline__ float Normal(uint64_t r) {
  float s = 0.f;
  for (int k = 0; k < 4; ++k) s += static_cast<float>((r >> (16 * k)) & 0xFFFF) + 0.5f;
  return (s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

__global__ void AdamKernel(uint16_t* out, uint64_t n, uint64_t seed, int step, float lr,
                           float init_std) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const uint64_t key = Mix(seed ^ (i * 0xD1B54A32D192ED03ull));
    float w = init_std * Normal(Mix(key));
    float m = 0.f, v = 0.f, b1 = 1.f, b2 = 1.f;
    for (int s = 1; s <= step; ++s) {
      const float g = Normal(Mix(key + static_cast<uint64_t>(s) * 0x9E3779B97F4A7C15ull));
      m = 0.9f * m + 0.1f * g;
      v = 0.999f * v + 0.001f * g * g;
      b1 *= 0.9f;
      b2 *= 0.999f;
      w -= lr * (m / (1.f - b1)) / (sqrtf(v / (1.f - b2)) + 1e-8f);
    }
    const __nv_bfloat16 b = __float2bfloat16_rn(w);
    out[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

}  // namespace

cudaError_t FillAdamBf16(void* data, uint64_t elements, uint64_t seed, int step, float lr,
                         float init_std, cudaStream_t stream) {
  if (elements == 0) return cudaSuccess;
  AdamKernel<<<132 * 16, 256, 0, stream>>>(static_cast<uint16_t*>(data), elements, seed, step, lr,
                                           init_std);
  return cudaGetLastError();
}

cudaError_t FillBf16(void* data, uint64_t elements, uint64_t seed, cudaStream_t stream) {
  if (elements == 0) return cudaSuccess;
  FillKernel<<<132 * 16, 256, 0, stream>>>(static_cast<uint16_t*>(data), elements, seed);
  return cudaGetLastError();
}

}  // namespace wpub::bench
