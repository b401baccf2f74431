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

// |v| rounded to the E2M1 grid and saturated: the magnitude of E2M1ToFloat(FloatToE2M1(v)).
// One IEEE add of a magic constant C rounds |v| to the grid, because ulp(C) is the grid
// spacing there and round-to-nearest-even of the add is the E2M1 tie rule: C = 2^(e+22) for
// |v| in [2^e, 2^(e+1)), e >= 0 (spacing 0.5 in [1,2), 1 in [2,4), 2 in [4,8)), and C = 2^22
// below 1 (spacing 0.5). From 8 on the result is >= 8 and saturates to 6; for huge |v|, inf and
// NaN, C overflows into a negligible negative value or inf and the result is |v|, inf or NaN,
// which fminf also saturates to 6. Proven for all 2^32 patterns by fast_math_test.cu.
__device__ __forceinline__ float E2M1Magnitude(float v) {
  const uint32_t e = max(__float_as_uint(v) & 0x7F800000u, 0x3F800000u);
  const float c = __uint_as_float(e + 0x0B000000u);
  return fminf(__fsub_rn(__fadd_rn(fabsf(v), c), c), 6.0f);
}

// E2M1ToFloat(FloatToE2M1(FMul(x, inv))): the E2M1 value a product quantizes to, signed.
// The sign is the product's: FMUL returns the canonical (positive) NaN, whose code is +6,
// exactly the FloatToE2M1 rule for NaN (fast_math_test.cu checks all 2^32 x for several inv).
__device__ __forceinline__ float E2M1ValueOfProduct(float x, float inv) {
  const float v = __fmul_rn(x, inv);
  return __uint_as_float(__float_as_uint(E2M1Magnitude(v)) | (__float_as_uint(v) & 0x80000000u));
}

// The E2M1 code of a value E2M1ValueOfProduct returned (the inverse of E2M1ToFloat on its 16
// outputs): |value| * 2^-126 is the fp32 subnormal whose bits 22..24 are the magnitude code.
__device__ __forceinline__ uint32_t E2M1CodeOfValue(float value) {
  const uint32_t t = __float_as_uint(__fmul_rn(value, 0x1p-126f));
  return ((t >> 22) & 0x7u) | ((t >> 28) & 0x8u);
}

// FloatToE4M3 through the sm_89+ conversion instruction (satfinite, RNE), NaN -> 0x7F.
__device__ __forceinline__ uint8_t FastE4M3(float x) {
  if (x != x) return 0x7F;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// E4M3ToFloat for every non-NaN scale byte (quantization never produces 0x7F/0xFF): e4m3 ->
// fp16 -> fp32 through the conversion instructions, both exact (fast_math_test.cu checks all
// 254 bytes).
__device__ __forceinline__ float FastE4M3ToFloat(uint8_t sf) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(sf), __NV_E4M3);
  return __half2float(__half(h));
}

// DecodeFactor<Traits>(sf, amax) with FastE4M3ToFloat.
template <class Traits>
__device__ __forceinline__ float FastDecodeFactor(uint8_t sf, float amax) {
  return __fmul_rn(__fmul_rn(FastE4M3ToFloat(sf), amax), BitsFloat(Traits::kInvSixEBits));
}

// FDiv(1, x): the IEEE round-to-nearest reciprocal instruction sequence.
__device__ __forceinline__ float FastRcp(float x) { return __frcp_rn(x); }

// FDiv(a, kDivisor) for the constant divisors 6*E: q = a * RN(1/d) refined by one exact
// residual (Markstein). The residual is negated twice (rem = -(q*d - a)) so that a zero a keeps
// its sign. Equal to __fdiv_rn whenever a is zero or 2^-100 <= |a| <= 2^112 (the quotient stays
// normal and nothing overflows); fast_math_test.cu checks every such fp32 a. Callers guarantee
// the range per slice (see kExactDivAmaxMin/Max) and use __fdiv_rn otherwise.
template <int kDivisor>
__device__ __forceinline__ float DivByConstant(float a) {
  constexpr float kD = static_cast<float>(kDivisor);
  constexpr float kR = 1.0f / kD;
  const float q = __fmul_rn(a, kR);
  const float rem = -__fmaf_rn(q, kD, -a);
  return __fmaf_rn(rem, kR, q);
}

// DivByConstant's numerators in the exact 4over6 error are E2M1 value x E4M3 scale (0 or
// 2^-10 <= |qs| <= 2688) times amax; for amax = 0 or within these bounds they stay in its range.
inline constexpr float kExactDivAmaxMin = 0x1p-80f;
inline constexpr float kExactDivAmaxMax = 0x1p+100f;

// --- blocks ------------------------------------------------------------------------------------

// Per-tensor values every block of a slice needs.
struct SliceScales {
  float amax;
  float s_enc;
  float s_dec;
  float std_mult;  // S_enc * fl32(1/6), the standard path's multiplier (formed first)
  bool fast_div;   // amax keeps DivByConstant's numerators in its exact range
};

template <class Traits>
__device__ __forceinline__ SliceScales MakeSliceScales(float amax) {
  const TensorScales ts = MakeTensorScales(amax, Traits::kE4M3Max);
  const bool fast_div =
      ts.amax == 0.0f || (ts.amax >= kExactDivAmaxMin && ts.amax <= kExactDivAmaxMax);
  return SliceScales{ts.amax, ts.s_enc, ts.s_dec, __fmul_rn(ts.s_enc, BitsFloat(kOneSixthBits)),
                     fast_div};
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

// The 4over6 candidate loop (spec 4over6 steps 3-4) for both candidates at once: decoded
// values of map-to-6 into q6 and map-to-4 into q4, accumulated errors into err6 / err4.
// kFastDiv selects DivByConstant for the exact error (the slice's amax keeps its numerators in
// range) over the IEEE division; both give the same bits there.
template <class Traits, bool kFastDiv>
__device__ __forceinline__ void FourOverSixCandidates(const float (&x)[kBlockSize],
                                                      const SliceScales& ss, float sf6, float sf4,
                                                      float (&q6)[kBlockSize],
                                                      float (&q4)[kBlockSize], float& err6,
                                                      float& err4) {
  const float inv6 = EncodeInverse(sf6, ss.s_dec);
  const float inv4 = EncodeInverse(sf4, ss.s_dec);
  err6 = 0.0f;
  err4 = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    q6[i] = E2M1ValueOfProduct(x[i], inv6);
    q4[i] = E2M1ValueOfProduct(x[i], inv4);
    const float qs6 = __fmul_rn(q6[i], sf6);  // exact
    const float qs4 = __fmul_rn(q4[i], sf4);
    float d6;
    float d4;
    if constexpr (Traits::kErr == ErrKind::kExact) {
      // d = fp32_div((E2M1val(q) * float(s_c)) * amax, 6*E) - x_i
      constexpr int kSixE = 6 * Traits::kE4M3MaxInt;
      const float p6 = __fmul_rn(qs6, ss.amax);
      const float p4 = __fmul_rn(qs4, ss.amax);
      if constexpr (kFastDiv) {
        d6 = __fsub_rn(DivByConstant<kSixE>(p6), x[i]);
        d4 = __fsub_rn(DivByConstant<kSixE>(p4), x[i]);
      } else {
        d6 = __fsub_rn(__fdiv_rn(p6, static_cast<float>(kSixE)), x[i]);
        d4 = __fsub_rn(__fdiv_rn(p4, static_cast<float>(kSixE)), x[i]);
      }
    } else {
      // d = float(fp16_rne(E2M1val(q) * float(s_c))) - x_i * S_enc, where fp16_rne(qs) == qs:
      // an E2M1 value times an E4M3 scale has at most 6 significant bits and lies in
      // [2^-10, 2688], so it is exact in fp16 (fast_math_test.cu checks all 16 x 254 products).
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
}

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
    const float inv = EncodeInverse(FastE4M3ToFloat(out.sf), ss.s_dec);
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) out.q[i] = E2M1ValueOfProduct(x[i], inv);
  } else {
    const float base = __fmul_rn(__fdiv_rn(bmax, 6.0f), ss.s_enc);
    const uint8_t s6 = FastE4M3(fminf(base, 448.0f));  // the clamp is 448 even when E = 256
    const uint8_t s4 = FastE4M3(fminf(__fmul_rn(base, 1.5f), 448.0f));
    const float sf6 = FastE4M3ToFloat(s6);
    const float sf4 = FastE4M3ToFloat(s4);
    float q4[kBlockSize];
    float err6;
    float err4;
    if (Traits::kErr != ErrKind::kExact || ss.fast_div) {  // uniform per slice
      FourOverSixCandidates<Traits, true>(x, ss, sf6, sf4, out.q, q4, err6, err4);
    } else {
      FourOverSixCandidates<Traits, false>(x, ss, sf6, sf4, out.q, q4, err6, err4);
    }
    const bool pick4 = err4 < err6;  // strict: ties and NaN keep map-to-6
    out.sf = pick4 ? s4 : s6;
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) out.q[i] = pick4 ? q4[i] : out.q[i];
  }
}

// Packs 8 decoded values into one word of codes (element j in nibble j). Magnitude codes come
// from E2M1CodeOfValue's scaling (bits 22..24), shifted into place; the 8 sign bits are
// gathered with byte permutes (sign = bit 7 of each value's top byte) instead of 8 shifts and
// masks. Equal to packing E2M1CodeOfValue(q[j]) (fast_math_test.cu and the strict matrix).
__device__ __forceinline__ uint32_t PackCodeWord(const float* q) {
  uint32_t mags = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t t = __float_as_uint(__fmul_rn(fabsf(q[j]), 0x1p-126f));
    mags |= 4 * j <= 22 ? t >> (22 - 4 * j) : t << (4 * j - 22);
  }
  uint32_t v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __float_as_uint(q[j]);
  // Top bytes of elements 1,3,5,7 into bytes 0..3 (sign lands on bit 4j+3 = bit 7 of a byte),
  // and of elements 0,2,4,6 likewise, shifted down to bit 3 of each byte.
  const uint32_t odd =
      __byte_perm(__byte_perm(v[1], v[3], 0x0073), __byte_perm(v[5], v[7], 0x7300), 0x7610);
  const uint32_t even =
      __byte_perm(__byte_perm(v[0], v[2], 0x0073), __byte_perm(v[4], v[6], 0x7300), 0x7610);
  return mags | (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

// Packs a block's codes, element 2i in the low nibble of byte i.
__device__ __forceinline__ uint2 PackBlockCodes(const QuantBlock& b) {
  return make_uint2(PackCodeWord(b.q), PackCodeWord(b.q + 8));
}

}  // namespace wpub::kernels::cuda::detail
