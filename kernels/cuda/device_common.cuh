// Device-side building blocks shared by the NVFP4 kernels: tuning constants, 16-byte vector
// loads and stores of one 16-element block, and the CTA -> work-item lookup of multi-tensor
// launches. Private to kernels/cuda (included by .cu files only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/nvfp4.h"

namespace wpub::kernels::cuda::detail {

// Threads per CTA of every streaming kernel: 8 warps keeps 16-byte loads of 8 warps in flight
// per CTA while letting 8 CTAs share one SM.
inline constexpr int kThreads = 256;
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "kThreads must be whole warps");

// 16-byte vectors in one 16-element block of type t.
template <ElemType kType>
inline constexpr int kVecsPerBlock = static_cast<int>(kBlockSize* ElemSize(kType) / 16);
static_assert(kVecsPerBlock<ElemType::kBF16> == 2 && kVecsPerBlock<ElemType::kF32> == 4);

// Raw bytes of one input block, loaded before any arithmetic so that all of a thread's loads
// are in flight together.
template <ElemType kType>
struct RawBlock {
  uint4 v[kVecsPerBlock<kType>];
};

// Streaming load (read once: evict-first in L1/L2).
template <ElemType kType>
__device__ __forceinline__ void LoadRaw(const void* block_ptr, RawBlock<kType>& raw) {
  const uint4* p = static_cast<const uint4*>(block_ptr);
#pragma unroll
  for (int i = 0; i < kVecsPerBlock<kType>; ++i) raw.v[i] = __ldcs(p + i);
}

// Bf16ToFloat / Fp16ToFloat. The fp16 path uses the conversion instruction for finite values
// (widening is exact) and rebuilds inf/NaN from the bits so NaN payloads match Fp16ToFloat;
// fast_math_test.cu checks all 65536 patterns.
template <ElemType kType>
__device__ __forceinline__ float Widen(uint32_t bits16) {
  if constexpr (kType == ElemType::kBF16) {
    return __uint_as_float(bits16 << 16);
  } else {
    const float hw = __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
    const uint32_t special = ((bits16 & 0x8000u) << 16) | 0x7F800000u | ((bits16 & 0x3FFu) << 13);
    return (bits16 & 0x7C00u) == 0x7C00u ? __uint_as_float(special) : hw;
  }
}

// Widens a raw block to 16 fp32 values (exact for every input type).
template <ElemType kType>
__device__ __forceinline__ void Unpack(const RawBlock<kType>& raw, float (&x)[kBlockSize]) {
#pragma unroll
  for (int i = 0; i < kVecsPerBlock<kType>; ++i) {
    const uint32_t w[4] = {raw.v[i].x, raw.v[i].y, raw.v[i].z, raw.v[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kType == ElemType::kF32) {
        x[i * 4 + j] = __uint_as_float(w[j]);
      } else {
        x[i * 8 + 2 * j] = Widen<kType>(w[j] & 0xFFFFu);
        x[i * 8 + 2 * j + 1] = Widen<kType>(w[j] >> 16);
      }
    }
  }
}

// Folds the elements of one 16-byte vector into a running amax m (NaN skipped) and a count of
// non-finite elements (inf and NaN).
template <ElemType kType>
__device__ __forceinline__ void AccumulateAmax(const uint4& v, float& m, uint32_t& bad) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // fmaxf(m, |x|) == MaxSkipNan(m, FAbs(x)): m is never NaN and both are >= +0.
    if constexpr (kType == ElemType::kF32) {
      const float x = __uint_as_float(w[j]);
      m = fmaxf(m, fabsf(x));
      bad += (w[j] & 0x7F800000u) == 0x7F800000u;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t bits = h == 0 ? (w[j] & 0xFFFFu) : (w[j] >> 16);
        m = fmaxf(m, fabsf(Widen<kType>(bits)));
        constexpr uint32_t kExpMask = kType == ElemType::kBF16 ? 0x7F80u : 0x7C00u;
        bad += (bits & kExpMask) == kExpMask;
      }
    }
  }
}

// Folds every thread's running amax m (never NaN, >= +0: AccumulateAmax's) and non-finite count
// into *amax and *nonfinite (may be null) with one atomic each per CTA, none when there is
// nothing to add (the slots start at zero): warp shuffles, the warps' partials in shared memory,
// warp 0 combines them. NaN never enters m, so the unsigned max of the float bit patterns is the
// float max: order independent, deterministic. Every thread of the CTA (kCtaThreads, a multiple
// of 32) must call it; the same CTA may call it again (it waits until the previous call's
// partials were read).
template <int kCtaThreads>
__device__ __forceinline__ void CtaAmaxAtomics(float m, uint32_t bad, float* amax,
                                               unsigned long long* nonfinite) {
  static_assert(kCtaThreads % 32 == 0 && kCtaThreads <= 1024, "whole warps, one CTA");
  __shared__ float warp_max[kCtaThreads / 32];
  __shared__ uint32_t warp_bad[kCtaThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = MaxSkipNan(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  bad = __reduce_add_sync(0xFFFFFFFFu, bad);
  __syncthreads();  // a previous call's partials were read
  if (threadIdx.x % 32 == 0) {
    warp_max[threadIdx.x / 32] = m;
    warp_bad[threadIdx.x / 32] = bad;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kCtaThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
    bad = threadIdx.x < kCtaThreads / 32 ? warp_bad[threadIdx.x] : 0u;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = MaxSkipNan(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    bad = __reduce_add_sync(0xFFFFFFFFu, bad);
    if (threadIdx.x == 0) {
      if (m != 0.0f) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
      if (bad != 0 && nonfinite != nullptr) atomicAdd(nonfinite, bad);
    }
  }
}

// FloatToBf16 / FloatToFp16 through the conversion instructions (RNE, NaN -> 0x7FFF);
// fast_math_test.cu checks all 2^32 inputs.
template <ElemType kType>
__device__ __forceinline__ uint32_t Narrow(float y) {
  static_assert(kType != ElemType::kF32, "outputs are bf16 or fp16");
  if constexpr (kType == ElemType::kBF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(y));
  } else {
    return __half_as_ushort(__float2half_rn(y));
  }
}

// Rounds 16 fp32 values to a 16-bit type and stores them as two 16-byte vectors.
template <ElemType kType>
__device__ __forceinline__ void StoreBlock16(void* block_ptr, const float (&y)[kBlockSize]) {
  uint4* p = static_cast<uint4*>(block_ptr);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = Narrow<kType>(y[i * 8 + 2 * j]) | (Narrow<kType>(y[i * 8 + 2 * j + 1]) << 16);
    }
    __stcs(p + i, make_uint4(w[0], w[1], w[2], w[3]));
  }
}

// Packs 16 unpacked E2M1 codes (element 2i in the low nibble of byte i) into 8 bytes.
__device__ __forceinline__ uint2 PackCodes(const uint8_t (&codes)[kBlockSize]) {
  uint32_t lo = 0;
  uint32_t hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo |= static_cast<uint32_t>(PackE2M1(codes[2 * i], codes[2 * i + 1])) << (8 * i);
    hi |= static_cast<uint32_t>(PackE2M1(codes[8 + 2 * i], codes[8 + 2 * i + 1])) << (8 * i);
  }
  return make_uint2(lo, hi);
}

// Inverse of PackCodes.
__device__ __forceinline__ void UnpackCodes(uint2 packed, uint8_t (&codes)[kBlockSize]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t w = i < 4 ? packed.x : packed.y;
    const uint32_t byte = (w >> (8 * (i % 4))) & 0xFFu;
    codes[2 * i] = static_cast<uint8_t>(byte & 0xFu);
    codes[2 * i + 1] = static_cast<uint8_t>(byte >> 4);
  }
}

// Multi-tensor launches give each work item a contiguous range of CTAs; cta_begin has
// num_items + 1 entries (the last is the grid size). The search index is uniform across the CTA,
// so the parameter-space reads are broadcasts.
__device__ __forceinline__ int FindItem(const uint32_t* cta_begin, int num_items) {
  int lo = 0;
  int hi = num_items - 1;
  const uint32_t cta = blockIdx.x;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cta_begin[mid] <= cta) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace wpub::kernels::cuda::detail
