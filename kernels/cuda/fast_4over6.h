// 4over6 block quantization in few instructions per element, for the blocks where that is
// provably the same as the spec (docs/specs/nvfp4.md, "4over6"), and the standard block on the
// same primitives (points 2, 3 and 7 below); every other block is left to the step-for-step path
// of fast_block.cuh. Host and device compile the same source, so the CPU
// tests (tests/kernels_cpu/fast_4over6_test.cc) prove the formulation exhaustively over the
// domains stated below, and the GPU tests compare the device build with the CPU reference.
//
// Why the cheap formulation is exact (E2M1val(q) = q, sf = float(s_c), W_c = sf * amax / 6E):
// 1. Magnitudes only. inv_c > 0, so the product of x keeps x's sign, E2M1 rounding is symmetric
//    and |d| is the same for (x, q) and (|x|, |q|): both errors are computed on |x|, and the
//    code's sign bit is x's (NaN elements never reach the packing, see 5).
// 2. Scaled grid. With inv' = inv * 2^-6 (exact: inv' stays normal for the slices admitted by
//    CheapSlice), v' = RN(|x| * inv') = RN(|x| * inv) * 2^-6 unless both are far below
//    the first E2M1 boundary. The E2M1 grid times 2^-6 is the E4M3 grid's subset whose E4M3
//    bytes are (code << 2): one E4M3x2 conversion packs two codes.
// 3. Rounding. In a block where RN(bmax * inv') < 7 * 2^-6 (checked per block; monotone in |x|)
//    no element reaches the saturation of E2M1, and q' = (|v'| + C) - C with C = 2^(e + 22) for
//    |v'| in [2^e, 2^(e+1)), C = 2^16 below 2^-6, is the E2M1 rounding: the add rounds to
//    ulp(C) = the grid spacing, ties to even because C / ulp(C) is even, the subtraction is
//    exact. Proven for every fp32 v' below 7 * 2^-6 (RoundE2M1Scaled).
// 4. Exact error without a division per element. When amax has at most 18 significant bits (all
//    bf16 and fp16 amaxes), qs * amax is exact, so the spec's D = fp32_div(qs * amax, 6E) is
//    RN(q * W_c): a single rounding of q times a per-block constant. With A = RN(W_c) and
//    L ~ W_c - A (from the exact division remainder), D = fma(q, A, q * L): for q = 2^k it is
//    2^k * A, for q = 1.5 * 2^k the computed sum is within 2^-44 |D| of q * W_c, while q * W_c
//    is either representable (E = 256) or at least ulp/42 away from every rounding boundary
//    (W_c's denominator has the odd factor 3 or 21). Proven for all q, all scale bytes and all
//    18-bit amax mantissas at the extremes of the admitted exponent range
//    (ErrorValueEqualsSpecDivision).
// 5. NaN elements are skipped by bmax but make both errors NaN; such blocks (err6 is NaN) go back
//    to the step-for-step path, so codes here come from finite elements only.
// 6. Per-slice admission (MakeCheapSlice) and bmax / 6 (DivSix) carry their own ranges;
//    the fused QDQ decodes the chosen codes with the same factor as the spec (DecodeCheapBlock).
// 7. Standard blocks (StandardCheapValues): the spec's scale byte and inv, then points 2 and 3 on
//    inv' = inv * 2^-6 (normal for an admitted slice: inv >= 6 / amax). A NaN element makes the
//    NaN-keeping bmax NaN and the block fails the saturation test; the fused QDQ multiplies q'
//    by the decode factor times 2^6, the same real product as the spec's (DecodeStandardCheap).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

#include "kernels/nvfp4_math.h"

namespace wpub::kernels::cuda::detail {

// --- single operations, same rounding on host and device ---------------------------------------

// a * b + c rounded once.
WPUB_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// max(a + b, c) over uint32 (a + b must not wrap): one DPX instruction on sm_90.
WPUB_HD uint32_t AddMax(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  return __viaddmax_u32(a, b, c);
#else
  return a + b > c ? a + b : c;
#endif
}

// fminf / fmaxf (FMin / FMax of nvfp4_math.h: a NaN operand yields the other one).
WPUB_HD float MinF(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return FMin(a, b);
#endif
}

WPUB_HD float AbsF(float a) {
#if defined(__CUDA_ARCH__)
  return fabsf(a);
#else
  return FAbs(a);
#endif
}

// Running max of |x| skipping NaN (BlockAmax's step; acc is never NaN).
WPUB_HD float MaxAbsSkipNan(float acc, float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(acc, fabsf(x));
#else
  return MaxSkipNan(acc, FAbs(x));
#endif
}

// Running max of |x| that turns NaN for good once an element is NaN (max.NaN.f32 on the device).
WPUB_HD float MaxAbsKeepNan(float acc, float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(acc), "f"(fabsf(x)));
  return r;
#else
  if (IsNan(acc) || IsNan(x)) return BitsFloat(0x7FFFFFFFu);
  return acc > FAbs(x) ? acc : FAbs(x);
#endif
}

// FDiv(1, x): the IEEE round-to-nearest reciprocal on the device.
WPUB_HD float Rcp(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return FDiv(1.0f, x);
#endif
}

// E4M3ToFloat for non-NaN bytes (on the device through e4m3 -> fp16 -> fp32 conversions, both
// exact; fast_math_test.cu checks all 254 bytes).
WPUB_HD float E4M3Value(uint32_t byte) {
#if defined(__CUDA_ARCH__)
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(__half(h));
#else
  return E4M3ToFloat(static_cast<uint8_t>(byte));
#endif
}

// FloatToE4M3(lo) | FloatToE4M3(hi) << 8 for non-NaN inputs: one cvt.rn.satfinite.e4m3x2.f32.
WPUB_HD uint32_t E4M3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#else
  return static_cast<uint32_t>(FloatToE4M3(lo)) | (static_cast<uint32_t>(FloatToE4M3(hi)) << 8);
#endif
}

// --- primitives ------------------------------------------------------------------------------

inline constexpr float kCodeScale = 0x1p-6f;        // q' = E2M1val * 2^-6: E4M3 byte = code << 2
inline constexpr float kSimpleLimit = 7 * 0x1p-6f;  // |v'| below this never saturates

// E2M1val(FloatToE2M1(v' * 2^6)) * 2^-6 for 0 <= |v'| < 7 * 2^-6, as a non-negative value
// (point 3 above). C's exponent is |v'|'s plus 22, at least 2^16's.
WPUB_HD float RoundE2M1Scaled(float v) {
  const float c = BitsFloat(AddMax(FloatBits(v) & 0x7F800000u, 22u << 23, 0x47800000u));
  return FSub(FAdd(AbsF(v), c), c);
}

// Per-slice values of the cheap path; ok is uniform over a slice.
struct CheapSlice {
  float amax;
  float s_enc;
  float s_dec;
  bool ok;  // amax admits the cheap path (and the exact error's identities)
};

// 2^-80 <= amax <= 2^100 keeps every intermediate of points 2, 4 and 7 normal and far from
// overflow, and S_enc <= 2688 * 2^80 (see DivSix); the 4over6 exact error also needs amax's low 6
// mantissa bits clear (<= 18 significant bits, point 4). Anything else (0, NaN, inf, negative,
// fp32 amaxes) takes the step-for-step path.
template <class Traits>
WPUB_HD CheapSlice MakeCheapSlice(const TensorScales& ts) {
  const uint32_t bits = FloatBits(ts.amax);
  bool ok = ts.amax >= 0x1p-80f && ts.amax <= 0x1p100f;
  if (Traits::kFourOverSix && Traits::kErr == ErrKind::kExact) ok = ok && (bits & 0x3Fu) == 0u;
  return CheapSlice{ts.amax, ts.s_enc, ts.s_dec, ok};
}

// fp32_div(k, 6E) by the reciprocal and one exact residual (Markstein); within the admitted
// range k = sf * amax is 0 or in [2^-90, 2^110], where this is the IEEE quotient (part of what
// ErrorValueEqualsSpecDivision proves).
template <class Traits>
WPUB_HD float DivSixE(float k) {
  const float r = BitsFloat(Traits::kInvSixEBits);
  const float q = FMul(k, r);
  const float rem = -Fma(q, Traits::kSixE, -k);
  return Fma(rem, r, q);
}

// What one candidate's elements need: inv' (point 2) and, per error kind, A' and L' (point 4,
// both times 2^6 so that they multiply q') or sf * 2^6 (the FP16 error's q * sf). A function of
// the scale byte and the slice only, so kernels build a table of all 127 per CTA
// (CandidateTable) instead of two reciprocals and two divisions per block.
struct alignas(16) Candidate {
  float inv;  // min(1 / (sf * S_dec), FLT_MAX) * 2^-6
  float a;    // exact error: RN(sf * amax / 6E) * 2^6; FP16 error: sf * 2^6
  float l;    // exact error: the low part of sf * amax / 6E, times 2^6
  float pad;
};

inline constexpr int kCandidateTableSize = 128;  // scale bytes 0..0x7E (0x7F is NaN, unused)

template <class Traits>
WPUB_HD Candidate MakeCandidate(uint32_t byte, const CheapSlice& s) {
  const float sf = E4M3Value(byte);
  Candidate c;
  // A slice the cheap path does not admit gets inv' = NaN: every block's saturation test fails.
  c.inv = s.ok ? FMul(MinF(Rcp(FMul(sf, s.s_dec)), FltMax()), kCodeScale) : BitsFloat(0x7FC00000u);
  if constexpr (Traits::kErr == ErrKind::kExact) {
    const float k = FMul(sf, s.amax);  // exact: <= 4 + 18 significant bits
    const float a = DivSixE<Traits>(k);
    const float rem = Fma(-a, Traits::kSixE, k);  // exact remainder of the division
    c.a = FMul(a, 0x1p6f);
    c.l = FMul(FMul(rem, BitsFloat(Traits::kInvSixEBits)), 0x1p6f);
  } else {
    c.a = FMul(sf, 0x1p6f);
    c.l = 0.0f;
  }
  c.pad = 0.0f;
  return c;
}

// Looks candidates up in a table of MakeCandidate for every byte (device: shared memory).
struct CandidateTable {
  const Candidate* entries;
  WPUB_HD Candidate operator()(uint32_t byte) const { return entries[byte]; }
};

// Computes candidates on the fly (host tests).
template <class Traits>
struct CandidateMaker {
  CheapSlice s;
  WPUB_HD Candidate operator()(uint32_t byte) const { return MakeCandidate<Traits>(byte, s); }
};

// fp32_div(b, 6) by the reciprocal fl32(1/6) and one exact residual (Markstein): the IEEE
// quotient for b = +0 and 2^-100 <= b <= 2^112 (proven for every such fp32 b by the CPU tests).
// Outside, for the block scales of an admitted slice (S_enc <= 2688 * 2^80) it does not matter:
// below 2^-100 both quotients times S_enc stay below 2^-10 and both scale bytes are 0 (proven for
// every such b), above 2^112 both bytes saturate and the block fails the saturation test.
inline constexpr float kDivSixMin = 0x1p-100f;
inline constexpr float kDivSixMax = 0x1p112f;
WPUB_HD float DivSix(float b) {
  const float r = BitsFloat(kOneSixthBits);
  const float q = FMul(b, r);
  const float rem = -Fma(q, 6.0f, -b);
  return Fma(rem, r, q);
}

// The spec's |d| for one element, up to sign: exact error fp32_div(q * sf * amax, 6E) - |x|,
// FP16 error q * sf - |x| * S_enc (xs = |x| * S_enc, shared by both candidates).
template <class Traits>
WPUB_HD float ErrorTerm(float q, float ax, float xs, const Candidate& c) {
  if constexpr (Traits::kErr == ErrKind::kExact) {
    return FSub(Fma(q, c.a, FMul(q, c.l)), ax);
  } else {
    // q * sf is exact (at most 6 significant bits), so one fma rounds what FSub(FMul) rounds.
    return Fma(q, c.a, -xs);
  }
}

template <class Traits>
WPUB_HD float Accumulate(float err, float d) {
  if constexpr (Traits::kMetric == ErrMetric::kMAE) {
    return FAdd(err, AbsF(d));
  } else {
    return FAdd(err, FMul(d, d));
  }
}

// Packs 8 codes, element j in nibble j: even / odd hold the E4M3 bytes (code << 2) of elements
// 0, 2, 4, 6 / 1, 3, 5, 7. The signs are x's (point 1), taken from the E4M3 bytes of x itself
// (bit 7; x is never NaN here): bits 0-2 and 3 of each byte come from even's codes and signs,
// bits 4-6 and 7 from odd's.
WPUB_HD uint32_t PackNibbles(uint32_t even, uint32_t odd, const float* x) {
  const uint32_t even_signs = E4M3x2(x[0], x[2]) | (E4M3x2(x[4], x[6]) << 16);
  const uint32_t odd_signs = E4M3x2(x[1], x[3]) | (E4M3x2(x[5], x[7]) << 16);
  const uint32_t lo = ((even >> 2) & 0x07070707u) | ((even_signs >> 4) & 0x08080808u);
  const uint32_t hi = ((odd << 2) & 0x70707070u) | (odd_signs & 0x80808080u);
  return lo | hi;
}

// One block's outputs: codes of elements 0..7 in lo, 8..15 in hi (element 2i in the low nibble
// of byte i), and the scale byte.
struct PackedBlock {
  uint32_t lo;
  uint32_t hi;
  uint32_t sf;
};

// One block's chosen candidate before packing: the E4M3 bytes (code << 2, unsigned) of elements
// {0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}, and the scale byte.
struct CheapBlock {
  uint32_t w[4];
  uint32_t sf;
};

// The 4over6 block quantization (spec steps 1-5) when the block admits the cheap path; returns
// false (out unspecified) for blocks it leaves to the step-for-step path: the slice is not
// admitted, some |v'| could saturate (inf elements, tiny or clamped scales), or an element is
// NaN. candidates(byte) must return MakeCandidate<Traits>(byte, s) (CandidateTable or
// CandidateMaker).
template <class Traits, class Candidates>
WPUB_HD bool FourOverSixCheapCodes(const float (&x)[kBlockSize], const CheapSlice& s,
                                   const Candidates& candidates, CheapBlock& out) {
  static_assert(Traits::kFourOverSix, "4over6 modes only");
  float bmax = 0.0f;
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) bmax = MaxAbsSkipNan(bmax, x[i]);
  // Spec 4over6 steps 1-2; base is never NaN for an ok slice (S_enc finite and positive).
  const float base = FMul(DivSix(bmax), s.s_enc);
  const uint32_t bytes = E4M3x2(MinF(base, 448.0f), MinF(FMul(base, 1.5f), 448.0f));
  const uint32_t s6 = bytes & 0xFFu;
  const uint32_t s4 = bytes >> 8;
  const Candidate c6 = candidates(s6);
  const Candidate c4 = candidates(s4);
  if (!(FMul(bmax, c6.inv) < kSimpleLimit && FMul(bmax, c4.inv) < kSimpleLimit)) return false;
  // Elements in order (the error sums are sequential), four at a time: their E4M3 bytes
  // (code << 2) go straight into the words of even and odd elements of each half, so the rounded
  // values die early. w6 / w4: {even 0..7, odd 0..7, even 8..15, odd 8..15}.
  uint32_t w6[4] = {0u, 0u, 0u, 0u};
  uint32_t w4[4] = {0u, 0u, 0u, 0u};
  float err6 = 0.0f;
  float err4 = 0.0f;
  WPUB_UNROLL
  for (int k = 0; k < kBlockSize / 4; ++k) {
    float q6[4];
    float q4[4];
    WPUB_UNROLL
    for (int j = 0; j < 4; ++j) {
      const float ax = AbsF(x[4 * k + j]);
      const float xs = Traits::kErr == ErrKind::kExact ? 0.0f : FMul(ax, s.s_enc);
      q6[j] = RoundE2M1Scaled(FMul(ax, c6.inv));
      q4[j] = RoundE2M1Scaled(FMul(ax, c4.inv));
      err6 = Accumulate<Traits>(err6, ErrorTerm<Traits>(q6[j], ax, xs, c6));
      err4 = Accumulate<Traits>(err4, ErrorTerm<Traits>(q4[j], ax, xs, c4));
    }
    const int h = k / 2;
    const int shift = 16 * (k % 2);
    w6[2 * h] |= E4M3x2(q6[0], q6[2]) << shift;
    w6[2 * h + 1] |= E4M3x2(q6[1], q6[3]) << shift;
    w4[2 * h] |= E4M3x2(q4[0], q4[2]) << shift;
    w4[2 * h + 1] |= E4M3x2(q4[1], q4[3]) << shift;
  }
  if (IsNan(err6)) return false;   // a NaN element (point 5)
  const bool pick4 = err4 < err6;  // strict: ties keep map-to-6
  out.sf = pick4 ? s4 : s6;
  WPUB_UNROLL
  for (int j = 0; j < 4; ++j) out.w[j] = pick4 ? w4[j] : w6[j];
  return true;
}

// QuantizeBlockPacked<Traits> of nvfp4_math.h for 4over6 Traits, for the blocks
// FourOverSixCheapCodes admits (false otherwise).
template <class Traits, class Candidates>
WPUB_HD bool QuantizeBlockFourOverSixCheap(const float (&x)[kBlockSize], const CheapSlice& s,
                                           const Candidates& candidates, PackedBlock& out) {
  CheapBlock cb;
  if (!FourOverSixCheapCodes<Traits>(x, s, candidates, cb)) return false;
  out.lo = PackNibbles(cb.w[0], cb.w[1], x);
  out.hi = PackNibbles(cb.w[2], cb.w[3], x + 8);
  out.sf = cb.sf;
  return true;
}

// Two E4M3 bytes (lo in bits 0-7) to floats, for non-NaN bytes: exact (host E4M3ToFloat; device
// e4m3x2 -> f16x2 -> f32, all exact).
WPUB_HD void E4M3x2ToFloats(uint32_t bytes, float& lo, float& hi) {
#if defined(__CUDA_ARCH__)
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes & 0xFFFFu), __NV_E4M3);
  lo = __half2float(__half(__half_raw{h.x}));
  hi = __half2float(__half(__half_raw{h.y}));
#else
  lo = E4M3ToFloat(static_cast<uint8_t>(bytes & 0xFFu));
  hi = E4M3ToFloat(static_cast<uint8_t>((bytes >> 8) & 0xFFu));
#endif
}

// The fused QDQ's values of a cheap block: DecodeElement(code_i, factor) of the spec (E2M1 value
// times the decode factor, code 0x8 giving -0.0 * factor) for every element. factor64 is the
// block's DecodeFactor times 2^6 (exact); the bytes hold q * 2^-6, so q' * factor64 is the same
// real product as q * factor and rounds the same; the sign is x's (point 1: sign symmetric
// rounding; x is never NaN in a cheap block).
WPUB_HD void DecodeCheapBlock(const CheapBlock& cb, const float (&x)[kBlockSize], float factor64,
                              float (&y)[kBlockSize]) {
  WPUB_UNROLL
  for (int h = 0; h < 2; ++h) {
    WPUB_UNROLL
    for (int half = 0; half < 2; ++half) {  // bytes 0-1, then 2-3 of the even and odd words
      float q[4];  // elements 8h + 4 * half + {0, 2} (even word) and {1, 3} (odd word)
      E4M3x2ToFloats(cb.w[2 * h] >> (16 * half), q[0], q[2]);
      E4M3x2ToFloats(cb.w[2 * h + 1] >> (16 * half), q[1], q[3]);
      WPUB_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int i = 8 * h + 4 * half + j;
        const float m = FMul(q[j], factor64);
        y[i] = BitsFloat(FloatBits(m) | (FloatBits(x[i]) & 0x80000000u));
      }
    }
  }
}

// --- standard NVFP4 on the same primitives (point 7) ----------------------------------------

// Spec "Standard block quantization" for the blocks that admit the cheap path: q[i] =
// E2M1val(q_i) * 2^-6 >= 0 (magnitudes; the signs are x's) and the scale byte sf. False (outputs
// unspecified) when the slice is not admitted (s.ok), an element is NaN or inf, or some |v'|
// could saturate (a clamped or zero scale).
WPUB_HD bool StandardCheapValues(const float (&x)[kBlockSize], const CheapSlice& s,
                                 float (&q)[kBlockSize], uint32_t& sf) {
  float bmax = 0.0f;
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) bmax = MaxAbsKeepNan(bmax, x[i]);
  // Steps 2-4; MinF turns a NaN bmax into FLT_MAX here, the saturation test below rejects it.
  const float mult = FMul(s.s_enc, BitsFloat(kOneSixthBits));  // S_enc * fl32(1/6) first
  const uint32_t byte = E4M3x2(MinF(FMul(bmax, mult), FltMax()), 0.0f) & 0xFFu;
  const float inv = s.ok ? FMul(MinF(Rcp(FMul(E4M3Value(byte), s.s_dec)), FltMax()), kCodeScale)
                         : BitsFloat(0x7FC00000u);
  if (!(FMul(bmax, inv) < kSimpleLimit)) return false;
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) q[i] = RoundE2M1Scaled(FMul(AbsF(x[i]), inv));
  sf = byte;
  return true;
}

// The standard block's packed codes (QuantizeBlockPacked<StandardTraits>) where
// StandardCheapValues admits it.
WPUB_HD bool QuantizeBlockStandardCheap(const float (&x)[kBlockSize], const CheapSlice& s,
                                        PackedBlock& out) {
  float q[kBlockSize];
  uint32_t sf;
  if (!StandardCheapValues(x, s, q, sf)) return false;
  // E4M3 bytes (code << 2) of elements {0,2,4,6}, {1,3,5,7}, {8,...}, {9,...}, as in
  // FourOverSixCheapCodes.
  uint32_t w[4];
  WPUB_UNROLL
  for (int h = 0; h < 2; ++h) {
    w[2 * h] = E4M3x2(q[8 * h], q[8 * h + 2]) | (E4M3x2(q[8 * h + 4], q[8 * h + 6]) << 16);
    w[2 * h + 1] = E4M3x2(q[8 * h + 1], q[8 * h + 3]) | (E4M3x2(q[8 * h + 5], q[8 * h + 7]) << 16);
  }
  out.lo = PackNibbles(w[0], w[1], x);
  out.hi = PackNibbles(w[2], w[3], x + 8);
  out.sf = sf;
  return true;
}

// The fused QDQ's values of a standard cheap block: DecodeElement(code_i, factor) with factor64 =
// the block's DecodeFactor times 2^6 (exact) and the sign of x_i (x is never NaN here).
WPUB_HD void DecodeStandardCheap(const float (&q)[kBlockSize], const float (&x)[kBlockSize],
                                 float factor64, float (&y)[kBlockSize]) {
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    y[i] = BitsFloat(FloatBits(FMul(q[i], factor64)) | (FloatBits(x[i]) & 0x80000000u));
  }
}

}  // namespace wpub::kernels::cuda::detail
