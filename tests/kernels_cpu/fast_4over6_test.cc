// Proves the cheap 4over6 formulation of kernels/cuda/fast_4over6.h equal to the spec's
// step-for-step arithmetic (kernels/nvfp4_math.h) on the CPU, over the domains its comment
// claims: every fp32 input of the scaled E2M1 rounding, every (E2M1 value, scale byte) pair with
// every 18-bit amax mantissa at the ends and the middle of the admitted exponent range for the
// exact error value, and randomized whole blocks (specials, ties, tiny and clamped scales) in all
// 8 4over6 modes. The device build of the same header is compared with the CPU reference by the
// GPU tests (tests/kernels_gpu).
#include "kernels/cuda/fast_4over6.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>

namespace wpub::kernels::cuda::detail {
namespace {

constexpr float kE2M1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

std::string Hex(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", u);
  return buf;
}

// Runs fn(lo, hi) over [begin, end) on two threads (the CI machine has 2 cores); returns the
// number of failures fn reported through its counter, and the first failing input.
template <class Fn>
void SplitTwo(uint64_t begin, uint64_t end, const Fn& fn) {
  const uint64_t mid = begin + (end - begin) / 2;
  std::thread other([&] { fn(mid, end); });
  fn(begin, mid);
  other.join();
}

struct Failures {
  std::atomic<uint64_t> count{0};
  std::atomic<uint64_t> first{~uint64_t{0}};
  void Add(uint64_t input) {
    count.fetch_add(1);
    uint64_t cur = first.load();
    while (input < cur && !first.compare_exchange_weak(cur, input)) {
    }
  }
};

TEST(FastFourOverSixTest, ScaledCodesAreE4M3BytesShiftedByTwo) {
  for (uint32_t code = 0; code < 8; ++code) {
    const float q = FMul(kE2M1Values[code], kCodeScale);
    EXPECT_EQ(FloatToE4M3(q), code << 2) << "E2M1 code " << code;
    // The packing's E4M3x2 (host build) puts lo in byte 0.
    EXPECT_EQ(E4M3x2(q, kE2M1Values[7] * kCodeScale), (code << 2) | (7u << 10));
  }
}

TEST(FastFourOverSixTest, RoundE2M1ScaledEqualsSpecRoundingForEveryInputBelowTheLimit) {
  // All fp32 patterns of |v'| < 7 * 2^-6, both signs, subnormals and zeros included.
  const uint64_t limit = FloatBits(kSimpleLimit);
  Failures f;
  SplitTwo(0, 2 * limit, [&](uint64_t lo, uint64_t hi) {
    for (uint64_t i = lo; i < hi; ++i) {
      const uint32_t bits = static_cast<uint32_t>(i < limit ? i : (i - limit) | 0x80000000u);
      const float v = BitsFloat(bits);
      // Spec: E2M1 of v' * 2^6 (exact scaling), its magnitude, back to the 2^-6 grid.
      const float want = FMul(FAbs(E2M1ToFloat(FloatToE2M1(FMul(v, 0x1p6f)))), kCodeScale);
      if (FloatBits(RoundE2M1Scaled(v)) != FloatBits(want)) f.Add(bits);
    }
  });
  EXPECT_EQ(f.count.load(), 0u) << "first input " << Hex(static_cast<uint32_t>(f.first.load()));
}

// The exact error's value D = fp32_div(fmul(fmul(q, sf), amax), 6E) (the spec) against
// fma(q', A', q' * L') for every E2M1 value q, every non-NaN scale byte and the given amax.
template <class Traits>
void CheckErrorValue(float amax, Failures& f) {
  const TensorScales ts = MakeTensorScales(amax, Traits::kE4M3Max);
  const CheapSlice s = MakeCheapSlice<Traits>(ts);
  if (!s.ok) {
    f.Add(FloatBits(amax));  // the caller only passes admitted amaxes
    return;
  }
  for (uint32_t byte = 0; byte < 0x7F; ++byte) {
    const float sf = E4M3ToFloat(static_cast<uint8_t>(byte));
    const Candidate c = MakeCandidate<Traits>(byte, s);
    for (float q : kE2M1Values) {
      const float want = FDiv(FMul(FMul(q, sf), amax), Traits::kSixE);
      const float got = Fma(FMul(q, kCodeScale), c.a, FMul(FMul(q, kCodeScale), c.l));
      if (FloatBits(got) != FloatBits(want)) {
        f.Add((uint64_t{FloatBits(amax)} << 8) | byte);
        return;
      }
    }
  }
}

template <class Traits>
void CheckErrorValueDomain() {
  Failures f;
  CheckErrorValue<Traits>(0x1p100f, f);
  // Every 18-bit mantissa at the lowest, a middle and the highest admitted exponent.
  for (int exp : {-80, -1, 0, 37, 99}) {
    SplitTwo(0, 1u << 17, [&](uint64_t lo, uint64_t hi) {
      for (uint64_t m = lo; m < hi; ++m) {
        CheckErrorValue<Traits>(std::ldexp(1.0f + static_cast<float>(m) * 0x1p-17f, exp), f);
      }
    });
  }
  // Every admitted exponent with 256 pseudo-random 18-bit mantissas.
  std::mt19937 rng(7);
  for (int exp = -80; exp < 100; ++exp) {
    for (int j = 0; j < 256; ++j) {
      CheckErrorValue<Traits>(std::ldexp(1.0f + static_cast<float>(rng() >> 15) * 0x1p-17f, exp),
                              f);
    }
  }
  EXPECT_EQ(f.count.load(), 0u) << Traits::Mode().Name() << ": first (amax bits << 8 | byte) 0x"
                                << std::hex << f.first.load();
}

TEST(FastFourOverSixTest, ErrorValueEqualsSpecDivisionE448) {
  CheckErrorValueDomain<FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kExact>>();
}

TEST(FastFourOverSixTest, ErrorValueEqualsSpecDivisionE256) {
  CheckErrorValueDomain<FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kExact>>();
}

TEST(FastFourOverSixTest, DivSixEqualsIeeeDivisionOnItsDomain) {
  const uint64_t lo = FloatBits(kDivSixMin);
  const uint64_t hi = FloatBits(kDivSixMax);
  Failures f;
  if (FloatBits(DivSix(0.0f)) != FloatBits(FDiv(0.0f, 6.0f))) f.Add(0);
  SplitTwo(lo, hi + 1, [&](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) {
      const float v = BitsFloat(static_cast<uint32_t>(i));
      if (FloatBits(DivSix(v)) != FloatBits(FDiv(v, 6.0f))) f.Add(i);
    }
  });
  EXPECT_EQ(f.count.load(), 0u) << "first input " << Hex(static_cast<uint32_t>(f.first.load()));
}

// Below DivSix's domain the block scale bytes still agree: for every b < 2^-100 and the largest
// S_enc of an admitted slice (2688 / 2^-80; smaller S_enc only shrink base), both candidates'
// scaled maxima, through DivSix and through the IEEE division, are at most 2^-10, which E4M3
// encodes as 0 (FloatToE4M3, tested exhaustively in formats_test.cc).
TEST(FastFourOverSixTest, TinyBlockMaximaGiveZeroScaleBytes) {
  ASSERT_EQ(FloatToE4M3(0x1p-10f), 0);
  for (float s_enc : {FDiv(2688.0f, 0x1p-80f), FDiv(1536.0f, 0x1p-80f)}) {
    // The IEEE side is monotone in b: its largest b decides.
    const float b_top = BitsFloat(FloatBits(kDivSixMin) - 1);
    EXPECT_LE(FMul(FMul(FDiv(b_top, 6.0f), s_enc), 1.5f), 0x1p-10f);
    Failures f;
    SplitTwo(0, FloatBits(kDivSixMin), [&](uint64_t lo, uint64_t hi) {
      for (uint64_t i = lo; i < hi; ++i) {
        const float b = BitsFloat(static_cast<uint32_t>(i));
        if (!(FMul(FMul(DivSix(b), s_enc), 1.5f) <= 0x1p-10f)) f.Add(i);
      }
    });
    EXPECT_EQ(f.count.load(), 0u) << "S_enc " << s_enc << ", first b "
                                  << Hex(static_cast<uint32_t>(f.first.load()));
  }
}

TEST(FastFourOverSixTest, SliceAdmission) {
  using Exact = FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kExact>;
  using Fp16 = FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kFP16>;
  auto ok = [](auto traits, float amax) {
    using T = decltype(traits);
    return MakeCheapSlice<T>(MakeTensorScales(amax, T::kE4M3Max)).ok;
  };
  EXPECT_FALSE(ok(Exact{}, 0.0f));  // S_enc = FLT_MAX: tiny blocks could get nonzero scales
  EXPECT_TRUE(ok(Exact{}, 3.5f));
  EXPECT_TRUE(ok(Exact{}, 0x1p-80f));
  EXPECT_TRUE(ok(Exact{}, 0x1p100f));
  EXPECT_FALSE(ok(Exact{}, -0.0f));  // S_enc would be -inf
  EXPECT_FALSE(ok(Exact{}, 0x1p-81f));
  EXPECT_FALSE(ok(Exact{}, 0x1.000002p100f));
  EXPECT_FALSE(ok(Exact{}, std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(ok(Exact{}, std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(ok(Exact{}, -1.0f));
  EXPECT_FALSE(ok(Exact{}, BitsFloat(0x3F800020u)));  // 19 significant bits: qs * amax may round
  EXPECT_TRUE(ok(Exact{}, BitsFloat(0x3F800040u)));   // 18
  EXPECT_TRUE(ok(Fp16{}, BitsFloat(0x3F800001u)));    // the FP16 error never multiplies by amax
}

TEST(FastFourOverSixTest, Fp16ErrorProductsAreExactInFp16) {
  for (uint32_t byte = 0; byte < 0x7F; ++byte) {
    const float sf = E4M3ToFloat(static_cast<uint8_t>(byte));
    for (float q : kE2M1Values) {
      const float qs = FMul(q, sf);
      EXPECT_EQ(FloatBits(RoundToFp16(qs)), FloatBits(qs)) << q << " x byte " << byte;
      EXPECT_EQ(FloatBits(FMul(FMul(q, kCodeScale), FMul(sf, 0x1p6f))), FloatBits(qs));
      // Hence the FP16 error's fma equals the spec's subtraction of the rounded product.
      std::mt19937 rng(byte * 16 + static_cast<uint32_t>(q * 2));
      for (int j = 0; j < 64; ++j) {
        const float xs =
            std::ldexp(static_cast<float>(rng() >> 8), static_cast<int>(rng() % 40) - 40);
        EXPECT_EQ(FloatBits(Fma(FMul(q, kCodeScale), FMul(sf, 0x1p6f), -xs)),
                  FloatBits(FSub(RoundToFp16(qs), xs)));
      }
    }
  }
}

// --- whole blocks ------------------------------------------------------------------------------

struct BlockGen {
  std::mt19937_64 rng;
  explicit BlockGen(uint64_t seed) : rng(seed) {}
  uint64_t Next() { return rng(); }

  // A block of one family; amax is written too (the spec's, or a caller value).
  void Make(int family, float (&x)[kBlockSize], float& amax, bool bf16_like) {
    const int scale_exp = static_cast<int>(Next() % 120) - 60;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    float m = 0.0f;
    for (int i = 0; i < kBlockSize; ++i) {
      const uint64_t r = Next();
      float v;
      switch (family) {
        case 0:  // normal values
          v = std::ldexp(normal(rng), scale_exp);
          break;
        case 1: {  // E2M1 boundaries times a power of two, +- a little or exact
          static constexpr float kB[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f,
                                         3.5f,  5.0f,  6.0f,  0.5f,  1.0f};
          const float delta = static_cast<float>(static_cast<int>(r % 5) - 2) * 1e-3f;
          v = std::ldexp(kB[(r >> 8) % 10] * (1.0f + delta), scale_exp % 8);
          if (r & (1ull << 40)) v = -v;
          break;
        }
        case 2: {  // specials mixed in
          const uint32_t k = (r >> 4) % 16;
          if (k == 0) {
            v = std::numeric_limits<float>::quiet_NaN();
          } else if (k == 1) {
            v = (r & 1) ? -std::numeric_limits<float>::infinity()
                        : std::numeric_limits<float>::infinity();
          } else if (k == 2) {
            v = (r & 1) ? -0.0f : 0.0f;
          } else if (k == 3) {
            v = BitsFloat(static_cast<uint32_t>(r >> 32) & 0x807FFFFFu);  // subnormal
          } else {
            v = std::ldexp(normal(rng), scale_exp);
          }
          break;
        }
        case 3:  // tiny values next to larger ones: tiny and subnormal block scales
          v = std::ldexp(normal(rng), scale_exp - static_cast<int>((r >> 16) % 24));
          break;
        case 4:  // blocks below 2^-100 (DivSix's domain), subnormals included
          v = std::ldexp(normal(rng), -100 - scale_exp / 2 - 30);
          break;
        default:  // zeros of both signs
          v = (r & 1) ? -0.0f : 0.0f;
          break;
      }
      if (bf16_like) v = Bf16ToFloat(FloatToBf16(v));
      x[i] = v;
      if (!IsNan(v)) m = std::max(m, std::fabs(v));
    }
    const uint64_t a = Next() % 8;
    if (family >= 4) {
      // An admitted tensor amax far above the block's (the block's own is not admitted).
      amax = Bf16ToFloat(FloatToBf16(std::ldexp(1.0f + static_cast<float>(Next() % 128) / 128.0f,
                                                static_cast<int>(Next() % 90) - 80)));
    } else if (a == 0) {
      amax = m;  // the block is the tensor
    } else if (a < 6 && std::isfinite(m) && m > 0) {
      // A larger tensor amax, rounded like a bf16 (or fp32) element would be.
      amax = m * std::ldexp(1.0f + static_cast<float>(Next() % 1000) / 100.0f,
                            static_cast<int>(Next() % 12));
      if (bf16_like) amax = Bf16ToFloat(FloatToBf16(amax));
    } else {
      amax = std::isfinite(m) ? m : 1.0f;
    }
  }
};

template <class Traits>
void CheckBlocks(uint64_t seed, int blocks_per_family) {
  BlockGen gen(seed);
  int cheap[6] = {0, 0, 0, 0, 0, 0};  // bf16-like blocks (3 in 4) that took the cheap path
  int64_t mismatches = 0;
  std::string first;
  for (int family = 0; family < 6; ++family) {
    for (int n = 0; n < blocks_per_family; ++n) {
      float x[kBlockSize];
      float amax;
      const bool bf16_like = (n & 3) != 0;
      gen.Make(family, x, amax, bf16_like);
      const TensorScales ts = MakeTensorScales(amax, Traits::kE4M3Max);
      uint8_t want[kBlockSize / 2];
      const uint8_t want_sf = QuantizeBlockPacked<Traits>(x, ts, want);
      PackedBlock got;
      const CheapSlice s = MakeCheapSlice<Traits>(ts);
      if (!QuantizeBlockFourOverSixCheap<Traits>(x, s, CandidateMaker<Traits>{s}, got)) continue;
      if (bf16_like) ++cheap[family];
      uint8_t bytes[8];
      for (int i = 0; i < 4; ++i) {
        bytes[i] = static_cast<uint8_t>(got.lo >> (8 * i));
        bytes[4 + i] = static_cast<uint8_t>(got.hi >> (8 * i));
      }
      // The fused QDQ's values of the same block: DecodeElement of the reference codes.
      CheapBlock cb;
      ASSERT_TRUE(FourOverSixCheapCodes<Traits>(x, s, CandidateMaker<Traits>{s}, cb));
      float y[kBlockSize];
      DecodeCheapBlock(cb, x, FMul(DecodeFactor<Traits>(static_cast<uint8_t>(cb.sf), amax), 0x1p6f),
                       y);
      const float factor = DecodeFactor<Traits>(want_sf, amax);
      bool qdq_ok = true;
      for (int i = 0; i < kBlockSize; ++i) {
        const uint8_t code = (want[i / 2] >> (4 * (i % 2))) & 0xF;
        qdq_ok = qdq_ok && FloatBits(y[i]) == FloatBits(DecodeElement(code, factor));
      }
      if (!qdq_ok || got.sf != want_sf || std::memcmp(bytes, want, 8) != 0) {
        if (mismatches++ == 0) {
          first = "family " + std::to_string(family) + " amax " + Hex(FloatBits(amax)) + " sf " +
                  std::to_string(got.sf) + " want " + std::to_string(want_sf) + ", x:";
          for (float v : x) first += " " + Hex(FloatBits(v));
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << Traits::Mode().Name() << ": " << first;
  // The cheap path must actually carry ordinary data (family 0: normal values, every amax);
  // blocks with specials still reach it when they hold only finite values.
  const int bf16_blocks = blocks_per_family * 3 / 4;
  EXPECT_GT(cheap[0], bf16_blocks * 9 / 10) << Traits::Mode().Name();
  EXPECT_GT(cheap[1], bf16_blocks / 2) << Traits::Mode().Name();
  EXPECT_GT(cheap[4], 0) << Traits::Mode().Name();
  EXPECT_GT(cheap[5], bf16_blocks * 9 / 10) << Traits::Mode().Name();
}

template <class Traits>
void CheckMode() {
  CheckBlocks<Traits>(1000 + Traits::Mode().Index(), 40000);
}

TEST(FastFourOverSixTest, BlocksEqualReferenceMae448Exact) {
  CheckMode<FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kExact>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMae448Fp16) {
  CheckMode<FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kFP16>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMae256Exact) {
  CheckMode<FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kExact>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMae256Fp16) {
  CheckMode<FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kFP16>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMse448Exact) {
  CheckMode<FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kExact>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMse448Fp16) {
  CheckMode<FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kFP16>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMse256Exact) {
  CheckMode<FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kExact>>();
}
TEST(FastFourOverSixTest, BlocksEqualReferenceMse256Fp16) {
  CheckMode<FourOverSixTraits<ErrMetric::kMSE, 256, ErrKind::kFP16>>();
}

// Standard NVFP4 through the same primitives (point 7): packed codes, scale byte and the fused
// QDQ's values equal the spec's for every block the cheap path admits, and it admits ordinary
// data.
TEST(FastStandardTest, BlocksEqualReference) {
  using Traits = StandardTraits;
  for (uint64_t seed : {2000u, 2001u, 2002u}) {
    BlockGen gen(seed);
    int cheap[6] = {0, 0, 0, 0, 0, 0};
    int64_t mismatches = 0;
    std::string first;
    constexpr int kBlocksPerFamily = 40000;
    for (int family = 0; family < 6; ++family) {
      for (int n = 0; n < kBlocksPerFamily; ++n) {
        float x[kBlockSize];
        float amax;
        gen.Make(family, x, amax, /*bf16_like=*/(n & 3) != 0);
        const TensorScales ts = MakeTensorScales(amax, Traits::kE4M3Max);
        uint8_t want[kBlockSize / 2];
        const uint8_t want_sf = QuantizeBlockPacked<Traits>(x, ts, want);
        const CheapSlice s = MakeCheapSlice<Traits>(ts);
        PackedBlock got;
        if (!QuantizeBlockStandardCheap(x, s, got)) continue;
        ++cheap[family];
        uint8_t bytes[8];
        for (int i = 0; i < 4; ++i) {
          bytes[i] = static_cast<uint8_t>(got.lo >> (8 * i));
          bytes[4 + i] = static_cast<uint8_t>(got.hi >> (8 * i));
        }
        float q[kBlockSize];
        uint32_t sf = 0;
        ASSERT_TRUE(StandardCheapValues(x, s, q, sf));
        float y[kBlockSize];
        DecodeStandardCheap(q, x,
                            FMul(DecodeFactor<Traits>(static_cast<uint8_t>(sf), amax), 0x1p6f), y);
        const float factor = DecodeFactor<Traits>(want_sf, amax);
        bool qdq_ok = true;
        for (int i = 0; i < kBlockSize; ++i) {
          const uint8_t code = (want[i / 2] >> (4 * (i % 2))) & 0xF;
          qdq_ok = qdq_ok && FloatBits(y[i]) == FloatBits(DecodeElement(code, factor));
        }
        if (!qdq_ok || got.sf != want_sf || sf != want_sf || std::memcmp(bytes, want, 8) != 0) {
          if (mismatches++ == 0) {
            first = "family " + std::to_string(family) + " amax " + Hex(FloatBits(amax)) + " sf " +
                    std::to_string(got.sf) + " want " + std::to_string(want_sf) + ", x:";
            for (float v : x) first += " " + Hex(FloatBits(v));
          }
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << first;
    EXPECT_GT(cheap[0], kBlocksPerFamily * 9 / 10);  // normal values, every amax
    EXPECT_GT(cheap[1], kBlocksPerFamily / 2);       // E2M1 boundaries and ties
    EXPECT_GT(cheap[4], 0);                          // tiny blocks under an admitted amax
    EXPECT_GT(cheap[5], kBlocksPerFamily * 9 / 10);  // zeros of both signs
  }
}

// A NaN anywhere in a block keeps it off the cheap path (the NaN-keeping block max); an inf
// too (it saturates); a block of zeros stays on it with -0.0 codes where x is -0.0.
TEST(FastStandardTest, SpecialsLeaveTheCheapPath) {
  const TensorScales ts = MakeTensorScales(3.0f, 448);
  const CheapSlice s = MakeCheapSlice<StandardTraits>(ts);
  ASSERT_TRUE(s.ok);
  float q[kBlockSize];
  uint32_t sf;
  for (int pos : {0, 7, 15}) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = 0.25f * static_cast<float>(i % 5) - 0.5f;
    x[pos] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(StandardCheapValues(x, s, q, sf)) << "NaN at " << pos;
    x[pos] = -std::numeric_limits<float>::infinity();
    EXPECT_FALSE(StandardCheapValues(x, s, q, sf)) << "inf at " << pos;
  }
  float zeros[kBlockSize];
  for (int i = 0; i < kBlockSize; ++i) zeros[i] = (i % 2) ? -0.0f : 0.0f;
  PackedBlock pb;
  ASSERT_TRUE(QuantizeBlockStandardCheap(zeros, s, pb));
  EXPECT_EQ(pb.sf, 0u);
  EXPECT_EQ(pb.lo, 0x80808080u);  // element 2i+1 (-0.0) in the high nibble: code 0x8
  EXPECT_EQ(pb.hi, 0x80808080u);
  // A slice the path does not admit (amax 0) never takes it.
  const CheapSlice zero_slice = MakeCheapSlice<StandardTraits>(MakeTensorScales(0.0f, 448));
  EXPECT_FALSE(zero_slice.ok);
  EXPECT_FALSE(StandardCheapValues(zeros, zero_slice, q, sf));
}

}  // namespace
}  // namespace wpub::kernels::cuda::detail
