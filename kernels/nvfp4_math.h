// NVFP4 scalar arithmetic shared bit for bit by the CPU reference and the CUDA kernels.
//
// Everything here follows docs/specs/nvfp4.md ("the spec"). Each arithmetic step is ONE
// IEEE-754 binary32 operation with round-to-nearest-even and subnormals kept: on the device
// through __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn (never contracted into an FMA), on the host
// through plain operators in a translation unit built with -ffp-contract=off and without fast
// math (wpub_target_options). Format conversions are written in integer arithmetic so that the
// host and the device cannot disagree on rounding, NaN or subnormal handling.
//
// Header-only, no dependencies beyond <cstdint>/<cstring>; usable from host C++ and from CUDA
// device code. All functions are pure and thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WPUB_HD __host__ __device__ __forceinline__
#else
#define WPUB_HD inline
#endif
// Unrolling hint for the 16-element block loops: `#pragma unroll` in nvcc's device pass only.
// Host compilers get nothing: GCC vectorizes these loops by itself (the E2M1 compares become
// SIMD compares) and a full-unroll pragma would defeat that; nvcc's host pass and g++ would
// also warn on a bare `#pragma unroll`.
#if defined(__CUDA_ARCH__)
#define WPUB_UNROLL _Pragma("unroll")
#else
#define WPUB_UNROLL
#endif

namespace wpub::kernels {

// ---------------------------------------------------------------------------------------------
// Error codes of the kernels module (host API; nvfp4.h adds KernelStatusString).
enum class KernelStatus : int {
  kOk = 0,
  kInvalidArgument,
  kUnsupported,
  kCudaError,
  kWorkspaceTooSmall,
};

// ---------------------------------------------------------------------------------------------
// Bit casts and single IEEE operations.

WPUB_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

WPUB_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

WPUB_HD float FMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

WPUB_HD float FAdd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

WPUB_HD float FSub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// IEEE division (spec: never __fdividef / rcp.approx; 1/x is FDiv(1, x)).
WPUB_HD float FDiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

WPUB_HD bool IsNan(float f) { return (FloatBits(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// |f| by clearing the sign bit (exact, NaN payload kept).
WPUB_HD float FAbs(float f) { return BitsFloat(FloatBits(f) & 0x7FFFFFFFu); }

// fminf / fmaxf semantics (spec "Inside the block computations, min is fminf"): a NaN operand
// yields the other operand. The order of equal zeros of opposite sign is not relied upon: every
// min in the spec has a positive constant operand.
WPUB_HD float FMin(float a, float b) {
  if (IsNan(a)) return b;
  if (IsNan(b)) return a;
  return b < a ? b : a;
}

WPUB_HD float FMax(float a, float b) {
  if (IsNan(a)) return b;
  if (IsNan(b)) return a;
  return b > a ? b : a;
}

// Running max that skips NaN elements: acc is never NaN (starts at 0), x may be anything.
// Equivalent to FMax(acc, x) for a non-NaN acc, cheaper on the device.
WPUB_HD float MaxSkipNan(float acc, float x) { return x > acc ? x : acc; }

// ---------------------------------------------------------------------------------------------
// Constants (spec "Floating-point ground rules").
inline constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;    // FLT_MAX
inline constexpr uint32_t kOneSixthBits = 0x3E2AAAABu;  // fl32(1/6)
inline constexpr uint32_t kInv2688Bits = 0x39C30C31u;   // fl32(1/(6*448))
inline constexpr uint32_t kInv1536Bits = 0x3A2AAAABu;   // fl32(1/(6*256))
inline constexpr uint16_t kCanonicalNan16 = 0x7FFF;     // what cvt.rn.{bf16,f16}.f32 emit for NaN

WPUB_HD float FltMax() { return BitsFloat(kFltMaxBits); }

// ---------------------------------------------------------------------------------------------
// 16-bit float formats. Widening is exact; narrowing is round-to-nearest-even with overflow to
// infinity, subnormals kept, and NaN -> canonical 0x7FFF (sign dropped). Checked on an H200
// over all 2^32 fp32 patterns: identical to __float2half_rn / __float2bfloat16_rn.

WPUB_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

WPUB_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNan16;
  // Adding 0x7FFF plus the kept LSB rounds half to even; carries propagate into the exponent,
  // which also turns overflow into infinity.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

WPUB_HD float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsFloat(sign);  // signed zero
  // Subnormal: mant * 2^-24; normalize so that the leading 1 lands on bit 10.
  uint32_t e = 113;  // exponent of 2^-14 (bias 127)
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return BitsFloat(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

WPUB_HD uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kCanonicalNan16;
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (a >= 0x38800000u) {                                              // >= 2^-14: normal
    uint32_t h = (a >> 13) - (112u << 10);
    const uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 ties to even zero
  // Subnormal result: value / 2^-24 = mant * 2^(e - 126), shift in [14, 24].
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

// fp32 -> fp16 -> fp32 (the "fp16_rne" of the spec's FP16 error).
WPUB_HD float RoundToFp16(float f) { return Fp16ToFloat(FloatToFp16(f)); }

// ---------------------------------------------------------------------------------------------
// E4M3 (float8_e4m3fn): S EEEE MMM, bias 7, max 448 = 0x7E, NaN 0x7F/0xFF, no infinity.

// Spec "Formats": RNE with saturation to +-448 ("satfinite"): |x| <= 2^-10 -> signed 0,
// |x| >= 448 and +-inf -> +-448, NaN -> 0x7F (sign kept on zeros and saturated values). Checked
// on an H200 over all 2^32 fp32 patterns: identical to __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
// __NV_E4M3).
WPUB_HD uint8_t FloatToE4M3(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  if (a >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448 (448..464 and above)
  if (a >= 0x3C800000u) {                                           // >= 2^-6: normal
    uint32_t c = (a >> 20) - (120u << 3);
    const uint32_t rem = a & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (c & 1u))) ++c;
    return static_cast<uint8_t>(sign | c);
  }
  if (a <= 0x3A800000u) return static_cast<uint8_t>(sign);  // <= 2^-10 ties to even zero
  // Subnormal result: value / 2^-9 = mant * 2^(e - 141), shift in [21, 24].
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 141u - e;
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint8_t>(sign | q);
}

WPUB_HD float E4M3ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t mant = c & 0x7u;
  if (exp == 0xF && mant == 0x7) return BitsFloat(0x7FC00000u | sign);  // NaN
  if (exp != 0) return BitsFloat(sign | ((exp + 120u) << 23) | (mant << 20));
  // Subnormal mant * 2^-9: exact as float; 0 keeps its sign.
  return BitsFloat(sign | FloatBits(FMul(static_cast<float>(mant), BitsFloat(0x3B000000u))));
}

// ---------------------------------------------------------------------------------------------
// E2M1 (FP4): S EE M, bias 1, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign.

// Spec "Formats": RNE with saturation to +-6; boundaries on |v|: <=0.25 -> 0, (0.25,0.75) -> 0.5,
// [0.75,1.25] -> 1, (1.25,1.75) -> 1.5, [1.75,2.5] -> 2, (2.5,3.5) -> 3, [3.5,5] -> 4, >5 -> 6.
// Sign preserved (-0.0 and negatives rounding to zero give 0x8); NaN -> +6 (0x7), the
// cvt.rn.satfinite.e2m1x2.f32 semantics. Emulated (sm_90 has no instruction) by comparing the
// magnitude's bit pattern with the boundaries' patterns: for non-negative floats the integer
// order is the numeric order (subnormals and inf included), and a NaN magnitude exceeds every
// boundary, giving 7. Branch-free, so host loops vectorize.
WPUB_HD uint8_t FloatToE2M1(float v) {
  const uint32_t u = FloatBits(v);
  const int32_t a = static_cast<int32_t>(u & 0x7FFFFFFFu);
  const uint32_t mag = static_cast<uint32_t>(a > 0x3E800000) +        // > 0.25
                       static_cast<uint32_t>(a >= 0x3F400000) +       // >= 0.75
                       static_cast<uint32_t>(a > 0x3FA00000) +        // > 1.25
                       static_cast<uint32_t>(a >= 0x3FE00000) +       // >= 1.75
                       static_cast<uint32_t>(a > 0x40200000) +        // > 2.5
                       static_cast<uint32_t>(a >= 0x40600000) +       // >= 3.5
                       static_cast<uint32_t>(a > 0x40A00000);         // > 5
  const uint32_t sign = (a <= 0x7F800000) ? ((u >> 28) & 0x8u) : 0u;  // NaN -> +6
  return static_cast<uint8_t>(sign | mag);
}

// Code -> value; 0x8 decodes to -0.0. Magnitude in halves from a nibble table (0xC8643210).
WPUB_HD float E2M1ToFloat(uint8_t code) {
  const uint32_t halves = (0xC8643210u >> (4u * (code & 0x7u))) & 0xFu;
  const float mag = FMul(static_cast<float>(halves), 0.5f);  // exact
  return BitsFloat(FloatBits(mag) | (static_cast<uint32_t>(code & 0x8u) << 28));
}

// Two codes per byte: element 2i in the LOW nibble, 2i+1 in the HIGH nibble.
WPUB_HD uint8_t PackE2M1(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xFu) | ((odd & 0xFu) << 4));
}

// ---------------------------------------------------------------------------------------------
// Global (per-tensor) scale, spec "Global (per-tensor) scale" steps 2-3.

// S_enc = min(fp32_div(6*E, amax), FLT_MAX); S_enc == 0 -> 1; NaN propagates (this min is the
// torch clamp_max of the exported function, which keeps NaN, unlike the block fminf).
// amax = 0 -> FLT_MAX, +inf -> 1, -inf -> 1 (-0.0 == 0). e4m3_max is 448 or 256.
WPUB_HD float GlobalEncodeScale(float amax, float e4m3_max) {
  float s = FDiv(FMul(e4m3_max, 6.0f), amax);  // 2688 and 1536 are exact
  if (s > FltMax()) s = FltMax();
  return s == 0.0f ? 1.0f : s;
}

// S_dec = fp32_div(1, S_enc): the published weight_scale_2 (NOT amax/2688).
WPUB_HD float GlobalDecodeScale(float s_enc) { return FDiv(1.0f, s_enc); }

// What one tensor's (or one stack slice's, or one pair's) blocks need.
struct TensorScales {
  float amax;   // global amax (used by the 4over6 exact error and by decoding)
  float s_enc;  // GlobalEncodeScale(amax, E)
  float s_dec;  // GlobalDecodeScale(s_enc)
};

WPUB_HD TensorScales MakeTensorScales(float amax, float e4m3_max) {
  TensorScales t;
  t.amax = amax;
  t.s_enc = GlobalEncodeScale(amax, e4m3_max);
  t.s_dec = GlobalDecodeScale(t.s_enc);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Quantization modes: standard + 4over6 {MAE, MSE} x {E = 448, 256} x {exact, FP16 error}.

enum class QuantAlgo : uint8_t { kStandard = 0, kFourOverSix = 1 };
enum class ErrMetric : uint8_t { kMAE = 0, kMSE = 1 };
enum class ErrKind : uint8_t { kExact = 0, kFP16 = 1 };

// A runtime mode value. Index() numbers the 9 valid modes 0..8 (0 = standard); invalid
// combinations (4over6 with E other than 448/256) have index -1.
struct QuantMode {
  QuantAlgo algo = QuantAlgo::kStandard;
  ErrMetric metric = ErrMetric::kMAE;  // 4over6 only
  int e4m3_max = 448;                  // 448 for standard; 448 or 256 for 4over6
  ErrKind err = ErrKind::kExact;       // 4over6 only

  static constexpr QuantMode Standard() { return QuantMode{}; }
  static constexpr QuantMode FourOverSix(ErrMetric m, int e, ErrKind k) {
    return QuantMode{QuantAlgo::kFourOverSix, m, e, k};
  }
  // TE defaults when 4over6 is on: MAE, E = 256, exact error.
  static constexpr QuantMode FourOverSixDefault() {
    return FourOverSix(ErrMetric::kMAE, 256, ErrKind::kExact);
  }
  constexpr int Index() const {
    if (algo == QuantAlgo::kStandard) return e4m3_max == 448 ? 0 : -1;
    if (e4m3_max != 448 && e4m3_max != 256) return -1;
    return 1 + static_cast<int>(metric) * 4 + (e4m3_max == 448 ? 0 : 2) + static_cast<int>(err);
  }
  constexpr bool IsValid() const { return Index() >= 0; }
  static constexpr QuantMode FromIndex(int i) {
    if (i <= 0) return Standard();
    const int j = i - 1;
    return FourOverSix(static_cast<ErrMetric>(j / 4), (j % 4) < 2 ? 448 : 256,
                       static_cast<ErrKind>(j % 2));
  }
  // Stable short names, e.g. "nvfp4", "4over6-mse-e448-exact".
  constexpr const char* Name() const {
    constexpr const char* kNames[9] = {"nvfp4",
                                       "4over6-mae-e448-exact",
                                       "4over6-mae-e448-fp16",
                                       "4over6-mae-e256-exact",
                                       "4over6-mae-e256-fp16",
                                       "4over6-mse-e448-exact",
                                       "4over6-mse-e448-fp16",
                                       "4over6-mse-e256-exact",
                                       "4over6-mse-e256-fp16"};
    return IsValid() ? kNames[Index()] : "invalid";
  }
  friend constexpr bool operator==(const QuantMode& a, const QuantMode& b) {
    return a.Index() == b.Index() && a.Index() >= 0;
  }
};

inline constexpr int kNumQuantModes = 9;

// Every valid mode, in Index() order.
inline constexpr std::array<QuantMode, kNumQuantModes> kAllQuantModes = {
    QuantMode::FromIndex(0), QuantMode::FromIndex(1), QuantMode::FromIndex(2),
    QuantMode::FromIndex(3), QuantMode::FromIndex(4), QuantMode::FromIndex(5),
    QuantMode::FromIndex(6), QuantMode::FromIndex(7), QuantMode::FromIndex(8)};

// Compile-time traits of one mode; kernels are specialized on these.
template <QuantAlgo kAlgoV, ErrMetric kMetricV, int kE4M3MaxV, ErrKind kErrV>
struct QuantTraits {
  static constexpr QuantAlgo kAlgo = kAlgoV;
  static constexpr ErrMetric kMetric = kMetricV;
  static constexpr ErrKind kErr = kErrV;
  static constexpr int kE4M3MaxInt = kE4M3MaxV;
  static constexpr bool kFourOverSix = kAlgoV == QuantAlgo::kFourOverSix;
  static constexpr float kE4M3Max = static_cast<float>(kE4M3MaxV);
  static constexpr float kSixE = static_cast<float>(6 * kE4M3MaxV);  // exact
  static constexpr uint32_t kInvSixEBits = kE4M3MaxV == 448 ? kInv2688Bits : kInv1536Bits;
  static constexpr QuantMode Mode() { return QuantMode{kAlgoV, kMetricV, kE4M3MaxV, kErrV}; }
  static_assert(kE4M3MaxV == 448 || (kFourOverSix && kE4M3MaxV == 256), "invalid E4M3 max");
};

using StandardTraits = QuantTraits<QuantAlgo::kStandard, ErrMetric::kMAE, 448, ErrKind::kExact>;
template <ErrMetric M, int E, ErrKind K>
using FourOverSixTraits = QuantTraits<QuantAlgo::kFourOverSix, M, E, K>;

// Calls f.template operator()<Traits>() for the mode's compile-time traits and returns its
// KernelStatus; an invalid mode returns kInvalidArgument without calling f. The functor must
// return KernelStatus. Host-only (launchers choose the kernel instantiation here).
template <class F>
KernelStatus DispatchQuantMode(QuantMode mode, F&& f) {
  switch (mode.Index()) {
    case 0:
      return f.template operator()<StandardTraits>();
    case 1:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kExact>>();
    case 2:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kFP16>>();
    case 3:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kExact>>();
    case 4:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kFP16>>();
    case 5:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kExact>>();
    case 6:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kFP16>>();
    case 7:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kExact>>();
    case 8:
      return f.template operator()<FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kFP16>>();
    default:
      return KernelStatus::kInvalidArgument;
  }
}

// ---------------------------------------------------------------------------------------------
// Block quantization (1x16 along the last dimension).

inline constexpr int kBlockSize = 16;

// bmax = max |x_i| skipping NaN (an all-NaN block has bmax 0); spec standard step 1.
WPUB_HD float BlockAmax(const float* x) {
  float m = 0.0f;
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) m = MaxSkipNan(m, FAbs(x[i]));
  return m;
}

// inv = min(fp32_div(1, float(sf) * S_dec), FLT_MAX); sf = 0 gives FLT_MAX (spec standard
// step 4, 4over6 step 3).
WPUB_HD float BlockEncodeInverse(uint8_t sf, float s_dec) {
  return FMin(FDiv(1.0f, FMul(E4M3ToFloat(sf), s_dec)), FltMax());
}

// Standard NVFP4, spec "Standard block quantization" steps 2-5. Writes 16 codes (one per
// element, not packed) and returns the E4M3 block scale byte.
WPUB_HD uint8_t QuantizeBlockStandard(const float* x, float bmax, const TensorScales& ts,
                                      uint8_t* codes) {
  const float mult = FMul(ts.s_enc, BitsFloat(kOneSixthBits));  // S_enc * fl32(1/6) first
  const float s = FMin(FMul(bmax, mult), FltMax());
  const uint8_t sf = FloatToE4M3(s);
  const float inv = BlockEncodeInverse(sf, ts.s_dec);
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) codes[i] = FloatToE2M1(FMul(x[i], inv));
  return sf;
}

// One candidate of 4over6: codes for scale byte sf and the accumulated error (spec 4over6
// steps 3-4), errors summed sequentially for i = 0..15 from 0.0f.
template <class Traits>
WPUB_HD float FourOverSixCandidate(const float* x, uint8_t sf, const TensorScales& ts,
                                   uint8_t* codes) {
  const float sf_f = E4M3ToFloat(sf);
  const float inv = FMin(FDiv(1.0f, FMul(sf_f, ts.s_dec)), FltMax());
  float err = 0.0f;
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const uint8_t q = FloatToE2M1(FMul(x[i], inv));
    codes[i] = q;
    const float qs = FMul(E2M1ToFloat(q), sf_f);  // exact (<= 6 * 448, few mantissa bits)
    float d;
    if constexpr (Traits::kErr == ErrKind::kExact) {
      // d = fp32_div((E2M1val(q) * float(s_c)) * amax, 6*E) - x_i
      d = FSub(FDiv(FMul(qs, ts.amax), Traits::kSixE), x[i]);
    } else {
      // d = float(fp16_rne(E2M1val(q) * float(s_c))) - x_i * S_enc
      d = FSub(RoundToFp16(qs), FMul(x[i], ts.s_enc));
    }
    if constexpr (Traits::kMetric == ErrMetric::kMAE) {
      err = FAdd(err, FAbs(d));
    } else {
      err = FAdd(err, FMul(d, d));
    }
  }
  return err;
}

// 4over6, spec "4over6" steps 1-5: map-to-4 only if err4 < err6 (ties and NaN choose 6).
template <class Traits>
WPUB_HD uint8_t QuantizeBlockFourOverSix(const float* x, float bmax, const TensorScales& ts,
                                         uint8_t* codes) {
  const float base = FMul(FDiv(bmax, 6.0f), ts.s_enc);  // a division here, not * fl32(1/6)
  const uint8_t s6 = FloatToE4M3(FMin(base, 448.0f));   // clamp 448 even when E = 256
  const uint8_t s4 = FloatToE4M3(FMin(FMul(base, 1.5f), 448.0f));
  uint8_t codes4[kBlockSize];
  const float err6 = FourOverSixCandidate<Traits>(x, s6, ts, codes);
  const float err4 = FourOverSixCandidate<Traits>(x, s4, ts, codes4);
  if (err4 < err6) {
    WPUB_UNROLL
    for (int i = 0; i < kBlockSize; ++i) codes[i] = codes4[i];
    return s4;
  }
  return s6;
}

// Quantizes one block of 16 fp32 values for the mode Traits: 16 unpacked codes, returns the
// block scale byte. ts must come from MakeTensorScales(amax, Traits::kE4M3Max).
template <class Traits>
WPUB_HD uint8_t QuantizeBlock(const float* x, const TensorScales& ts, uint8_t* codes) {
  const float bmax = BlockAmax(x);
  if constexpr (Traits::kFourOverSix) {
    return QuantizeBlockFourOverSix<Traits>(x, bmax, ts, codes);
  } else {
    return QuantizeBlockStandard(x, bmax, ts, codes);
  }
}

// Same, packed: 8 bytes, element 2i in the low nibble.
template <class Traits>
WPUB_HD uint8_t QuantizeBlockPacked(const float* x, const TensorScales& ts, uint8_t* packed) {
  uint8_t codes[kBlockSize];
  const uint8_t sf = QuantizeBlock<Traits>(x, ts, codes);
  WPUB_UNROLL
  for (int i = 0; i < kBlockSize / 2; ++i) packed[i] = PackE2M1(codes[2 * i], codes[2 * i + 1]);
  return sf;
}

// ---------------------------------------------------------------------------------------------
// Dequantize / QDQ, spec "Dequantize and fused QDQ".

// final = fmul(fmul(float(sf), amax), fl32(1/(6*E))) -- uses amax, not weight_scale_2.
WPUB_HD float DecodeFactor(uint8_t sf, float amax, uint32_t inv_six_e_bits) {
  return FMul(FMul(E4M3ToFloat(sf), amax), BitsFloat(inv_six_e_bits));
}
template <class Traits>
WPUB_HD float DecodeFactor(uint8_t sf, float amax) {
  return DecodeFactor(sf, amax, Traits::kInvSixEBits);
}

// y = E2M1val(q) * final in fp32 (code 0x8 -> -0.0 * final); the caller narrows with
// FloatToBf16 / FloatToFp16.
WPUB_HD float DecodeElement(uint8_t code, float factor) { return FMul(E2M1ToFloat(code), factor); }

// ---------------------------------------------------------------------------------------------
// Optional 128x4 swizzled scale layout (spec "Optional engine layout"). Kv = K/16 scale columns.

WPUB_HD int64_t SwizzledScaleSize(int64_t rows, int64_t kv) {
  return ((rows + 127) / 128 * 128) * ((kv + 3) / 4 * 4);
}

WPUB_HD int64_t SwizzledScaleIndex(int64_t m, int64_t k, int64_t kv) {
  return ((m / 128) * ((kv + 3) / 4) + k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 +
         (k % 4);
}

}  // namespace wpub::kernels
