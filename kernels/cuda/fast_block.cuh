// Device-only block quantization on cheaper instruction sequences that compute the SAME bits as
// the shared scalar functions of nvfp4_math.h. Each primitive replaces one shared function and
// is proven identical over its whole input domain by tests/kernels_gpu/fast_math_test.cu
// (all 2^32 fp32 patterns where the input is a float); the block functions below repeat the
// shared QuantizeBlockStandard / QuantizeBlockFourOverSix / DecodeElement step for step with
// those primitives, and the strict-matrix tests compare the composed kernels with the CPU
// reference byte for byte. Why: the shared functions are written for clarity and host/device
// parity (integer comparisons, a nibble-table decode, IEEE division by 2688); on sm_90 they make
// quantization compute-bound at about a third of memory bandwidth.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/nvfp4_math.h"

namespace wpub::kernels::cuda::detail {

// --- primitives ------------------------------------------------------------------------------

// E2M1 rounding of v returned as the decoded value: E2M1ToFloat(FloatToE2M1(v)) bit for bit.
// |v| is rounded to the E2M1 grid with one IEEE add of a magic constant whose ulp is the grid
// spacing there (0.5 below 2, 1 in [2,4), 2 from 4 on; round-to-nearest-even of the add is the
// E2M1 tie rule), then saturated to 6 (fminf also maps NaN to 6). The sign is v's, except for
// NaN (+6).
__device__ __forceinline__ float E2M1Value(float v) {
  const float a = fabsf(v);
  const float c = a < 2.0f ? 4194304.0f : (a < 4.0f ? 8388608.0f : 16777216.0f);
  const float r = fminf(__fsub_rn(__fadd_rn(a, c), c), 6.0f);
  const uint32_t vb = __float_as_uint(v);
  const uint32_t sign = (vb & 0x7FFFFFFFu) <= 0x7F800000u ? (vb & 0x80000000u) : 0u;
  return __uint_as_float(__float_as_uint(r) | sign);
}

// The E2M1 code of a value E2M1Value returned (the inverse of E2M1ToFloat on its 16 outputs):
// |value| * 2^-126 is the fp32 subnormal whose bits 22..24 are the 3-bit magnitude code.
__device__ __forceinline__ uint32_t E2M1CodeOfValue(float value) {
  const uint32_t mag = __float_as_uint(__fmul_rn(fabsf(value), 0x1p-126f)) >> 22;
  return mag | (__float_as_uint(value) >> 28 & 0x8u);
}

// FloatToE4M3 through the sm_89+ conversion instruction (satfinite, RNE), NaN -> 0x7F.
__device__ __forceinline__ uint8_t FastE4M3(float x) {
  if (x != x) return 0x7F;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// FDiv(1, x): the IEEE round-to-nearest reciprocal instruction sequence.
__device__ __forceinline__ float FastRcp(float x) { return __frcp_rn(x); }

// FDiv(a, kDivisor) for the constant divisors 6*E: q = a * RN(1/d) refined by one exact
// residual (Markstein). Proven equal to __fdiv_rn for every fp32 a (fast_math_test.cu).
template <int kDivisor>
__device__ __forceinline__ float DivByConstant(float a) {
  constexpr float kD = static_cast<float>(kDivisor);
  constexpr float kR = 1.0f / kD;
  const float q = __fmul_rn(a, kR);
  const float rem = __fmaf_rn(-q, kD, a);
  return __fmaf_rn(rem, kR, q);
}

// --- blocks ------------------------------------------------------------------------------------

// Per-tensor values every block of a slice needs.
struct SliceScales {
  float amax;
  float s_enc;
  float s_dec;
  float std_mult;  // S_enc * fl32(1/6), the standard path's multiplier (formed first)
};

template <class Traits>
__device__ __forceinline__ SliceScales MakeSliceScales(float amax) {
  const TensorScales ts = MakeTensorScales(amax, Traits::kE4M3Max);
  return SliceScales{ts.amax, ts.s_enc, ts.s_dec, __fmul_rn(ts.s_enc, BitsFloat(kOneSixthBits))};
}

// min(1 / (float(sf) * S_dec), FLT_MAX): BlockEncodeInverse.
__device__ __forceinline__ float EncodeInverse(float sf_f, float s_dec) {
  return fminf(FastRcp(__fmul_rn(sf_f, s_dec)), FltMax());
}

// One quantized block: the decoded E2M1 values (E2M1ToFloat of the codes) and the scale byte.
struct QuantBlock {
  float q[kBlockSize];
  uint8_t sf;
};

// QuantizeBlock<Traits> of nvfp4_math.h, returning the codes as decoded values.
template <class Traits>
__device__ __forceinline__ void QuantizeBlockFast(const float (&x)[kBlockSize],
                                                  const SliceScales& ss, QuantBlock& out) {
  float bmax = 0.0f;  // BlockAmax: fmaxf skips NaN like MaxSkipNan, and bmax starts at +0
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) bmax = fmaxf(bmax, fabsf(x[i]));

  if constexpr (!Traits::kFourOverSix) {
    const float s = fminf(__fmul_rn(bmax, ss.std_mult), FltMax());
    out.sf = FastE4M3(s);
    const float inv = EncodeInverse(E4M3ToFloat(out.sf), ss.s_dec);
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) out.q[i] = E2M1Value(__fmul_rn(x[i], inv));
  } else {
    const float base = __fmul_rn(__fdiv_rn(bmax, 6.0f), ss.s_enc);
    const uint8_t s6 = FastE4M3(fminf(base, 448.0f));
    const uint8_t s4 = FastE4M3(fminf(__fmul_rn(base, 1.5f), 448.0f));
    const float sf6 = E4M3ToFloat(s6);
    const float sf4 = E4M3ToFloat(s4);
    const float inv6 = EncodeInverse(sf6, ss.s_dec);
    const float inv4 = EncodeInverse(sf4, ss.s_dec);
    float q4[kBlockSize];
    float err6 = 0.0f;
    float err4 = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) {
      out.q[i] = E2M1Value(__fmul_rn(x[i], inv6));
      q4[i] = E2M1Value(__fmul_rn(x[i], inv4));
      const float qs6 = __fmul_rn(out.q[i], sf6);  // exact
      const float qs4 = __fmul_rn(q4[i], sf4);
      float d6;
      float d4;
      if constexpr (Traits::kErr == ErrKind::kExact) {
        d6 = __fsub_rn(DivByConstant<6 * Traits::kE4M3MaxInt>(__fmul_rn(qs6, ss.amax)), x[i]);
        d4 = __fsub_rn(DivByConstant<6 * Traits::kE4M3MaxInt>(__fmul_rn(qs4, ss.amax)), x[i]);
      } else {
        // RoundToFp16(qs) == qs: an E2M1 value times an E4M3 scale has at most 6 significant
        // bits and lies in [2^-10, 2688], so it is exact in fp16 (fast_math_test.cu checks all
        // 16 x 254 products).
        const float xs = __fmul_rn(x[i], ss.s_enc);
        d6 = __fsub_rn(qs6, xs);
        d4 = __fsub_rn(qs4, xs);
      }
      if constexpr (Traits::kMetric == ErrMetric::kMAE) {
        err6 = __fadd_rn(err6, fabsf(d6));
        err4 = __fadd_rn(err4, fabsf(d4));
      } else {
        err6 = __fadd_rn(err6, __fmul_rn(d6, d6));
        err4 = __fadd_rn(err4, __fmul_rn(d4, d4));
      }
    }
    const bool pick4 = err4 < err6;  // strict: ties and NaN keep map-to-6
    out.sf = pick4 ? s4 : s6;
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) out.q[i] = pick4 ? q4[i] : out.q[i];
  }
}

// Packs a block's codes, element 2i in the low nibble of byte i.
__device__ __forceinline__ uint2 PackBlockCodes(const QuantBlock& b) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = kBlockSize - 1; i >= 0; --i) {
    w[i / 8] = (w[i / 8] << 4) | E2M1CodeOfValue(b.q[i]);
  }
  return make_uint2(w[0], w[1]);
}

}  // namespace wpub::kernels::cuda::detail
