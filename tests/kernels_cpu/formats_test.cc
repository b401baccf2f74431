// Exhaustive tests of the format conversions of kernels/nvfp4_math.h against independent
// formulations written here: a table of every representable value (built with ldexp, not with
// the header's decoders) and the round-to-nearest-even rule applied by walking the sorted table.
// Also checks that the host build does not contract multiply-add pairs into FMAs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/nvfp4_math.h"

namespace wpub::kernels {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One representable non-negative value and its code (codes ascend with values).
struct Entry {
  double value;
  uint32_t code;
};

// Expected RNE encoding of magnitudes from a sorted table: the nearest entry, the one with an
// even code on a tie (for these formats the code's LSB is the mantissa's LSB). Magnitudes above
// the last entry map to the last entry (saturation, or the overflow pseudo-entry).
class NearestEvenWalker {
 public:
  explicit NearestEvenWalker(std::vector<Entry> table) : t_(std::move(table)) {}

  // x must not decrease between calls on one walker.
  uint32_t Next(double x) {
    while (j_ + 1 < t_.size() && x > Mid(j_)) ++j_;
    if (j_ + 1 < t_.size() && x == Mid(j_)) {
      return (t_[j_].code & 1u) == 0 ? t_[j_].code : t_[j_ + 1].code;
    }
    return t_[j_].code;
  }

 private:
  double Mid(size_t j) const { return (t_[j].value + t_[j + 1].value) / 2; }  // exact in double
  std::vector<Entry> t_;
  size_t j_ = 0;
};

// Runs check(lo, hi) over [begin, end) split across two threads (the CI machine has 2 cores).
template <class Fn>
void SplitTwo(uint64_t begin, uint64_t end, const Fn& check) {
  const uint64_t mid = begin + (end - begin) / 2;
  std::thread other([&] { check(mid, end); });
  check(begin, mid);
  other.join();
}

double E2M1Magnitude(uint32_t code) {
  static constexpr double kValues[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return kValues[code & 7];
}

// Independent E2M1: brute-force search over the 8 magnitudes, ties to the even code.
uint8_t BruteForceE2M1(float v) {
  if (std::isnan(v)) return 0x7;
  // Clamping at 12 keeps every distance exact in double and cannot change the nearest value
  // (6 is the largest, so it stays nearest for everything above 6, including inf).
  const double a = std::min(std::fabs(static_cast<double>(v)), 12.0);
  uint32_t best = 0;
  for (uint32_t c = 1; c < 8; ++c) {
    const double d = std::fabs(E2M1Magnitude(c) - a), db = std::fabs(E2M1Magnitude(best) - a);
    if (d < db || (d == db && (c & 1u) == 0 && (best & 1u) == 1)) best = c;
  }
  return static_cast<uint8_t>((std::signbit(v) ? 0x8 : 0) | best);
}

// fp16 value of a bit pattern computed with ldexp (independent of Fp16ToFloat).
double Fp16Value(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1F) return m ? std::nan("") : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}

double E4M3Value(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const double s = (c & 0x80) ? -1.0 : 1.0;
  if (e == 0xF && m == 7) return std::nan("");
  if (e == 0) return s * std::ldexp(m, -9);
  return s * std::ldexp(8 + m, e - 10);
}

TEST(E2M1Test, EveryBf16PatternMatchesBruteForce) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float v = FromBits(h << 16);
    ASSERT_EQ(FloatToE2M1(v), BruteForceE2M1(v)) << "bf16 0x" << std::hex << h;
  }
}

TEST(E2M1Test, EveryFp16PatternMatchesBruteForce) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float v = static_cast<float>(Fp16Value(static_cast<uint16_t>(h)));
    ASSERT_EQ(FloatToE2M1(v), BruteForceE2M1(v)) << "fp16 0x" << std::hex << h;
  }
}

TEST(E2M1Test, SpecialValuesAndDecode) {
  EXPECT_EQ(FloatToE2M1(-0.0f), 0x8);
  EXPECT_EQ(FloatToE2M1(0.0f), 0x0);
  EXPECT_EQ(FloatToE2M1(-0.25f), 0x8);  // negative rounding to zero keeps the sign
  EXPECT_EQ(FloatToE2M1(INFINITY), 0x7);
  EXPECT_EQ(FloatToE2M1(-INFINITY), 0xF);
  EXPECT_EQ(FloatToE2M1(std::nanf("")), 0x7);
  EXPECT_EQ(FloatToE2M1(-std::nanf("")), 0x7);  // NaN -> +6 regardless of sign
  EXPECT_EQ(FloatToE2M1(FromBits(1)), 0x0);     // smallest subnormal
  EXPECT_EQ(FloatToE2M1(FromBits(0x80000001u)), 0x8);
  for (uint8_t c = 0; c < 16; ++c) {
    const float v = E2M1ToFloat(c);
    EXPECT_EQ(static_cast<double>(v), (c & 8 ? -1 : 1) * E2M1Magnitude(c)) << int(c);
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << int(c);  // 0x8 decodes to -0.0
    EXPECT_EQ(FloatToE2M1(v), c);
  }
  EXPECT_EQ(PackE2M1(0x3, 0xC), 0xC3);  // element 2i in the low nibble
}

// Every fp32 magnitude, both signs, against the sorted-table walk (4.3e9 conversions).
TEST(E2M1Test, EveryFp32PatternMatchesNearestEven) {
  std::vector<Entry> table;
  for (uint32_t c = 0; c < 8; ++c) table.push_back({E2M1Magnitude(c), c});
  SplitTwo(0, 0x7F800001ull, [&](uint64_t lo, uint64_t hi) {
    NearestEvenWalker walk(table);
    uint64_t bad = 0;
    for (uint64_t u = lo; u < hi; ++u) {
      const uint32_t want = walk.Next(static_cast<double>(FromBits(static_cast<uint32_t>(u))));
      bad += FloatToE2M1(FromBits(static_cast<uint32_t>(u))) != want;
      bad += FloatToE2M1(FromBits(static_cast<uint32_t>(u) | 0x80000000u)) != (want | 0x8u);
    }
    EXPECT_EQ(bad, 0u) << "range [" << lo << ", " << hi << ")";
  });
}

TEST(E4M3Test, DecodeEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = E4M3ToFloat(static_cast<uint8_t>(c));
    const double want = E4M3Value(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << c;
      EXPECT_EQ(std::signbit(f), (c & 0x80) != 0) << c;
    }
  }
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
}

// Genuinely exhaustive over |x| <= 512 (1.14e9 magnitudes x 2 signs): the expectation walks the
// 127 finite non-negative E4M3 values; satfinite saturates everything above 448 to 0x7E.
TEST(E4M3Test, EveryFp32PatternUpTo512MatchesSatfiniteNearestEven) {
  std::vector<Entry> table;
  for (uint32_t c = 0; c <= 0x7E; ++c) table.push_back({E4M3Value(static_cast<uint8_t>(c)), c});
  const uint64_t end = 0x44000000ull + 1;  // 512.0f inclusive
  SplitTwo(0, end, [&](uint64_t lo, uint64_t hi) {
    NearestEvenWalker walk(table);
    uint64_t bad = 0;
    for (uint64_t u = lo; u < hi; ++u) {
      const float x = FromBits(static_cast<uint32_t>(u));
      const uint32_t want = walk.Next(static_cast<double>(x));
      bad += FloatToE4M3(x) != want;
      bad += FloatToE4M3(-x) != (want | 0x80u);
    }
    EXPECT_EQ(bad, 0u) << "range [" << lo << ", " << hi << ")";
  });
}

TEST(E4M3Test, InfNanAndSatfiniteEdges) {
  EXPECT_EQ(FloatToE4M3(INFINITY), 0x7E);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xFE);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7E);    // tie between 448 and (absent) 480: even 448
  EXPECT_EQ(FloatToE4M3(464.001f), 0x7E);  // saturated
  EXPECT_EQ(FloatToE4M3(3.0e38f), 0x7E);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -10)), 0x00);  // tie with 2^-9: even zero
  EXPECT_EQ(FloatToE4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  uint64_t bad = 0;
  for (uint32_t m = 1; m < (1u << 23); ++m) {  // every NaN pattern, both signs
    bad += FloatToE4M3(FromBits(0x7F800000u | m)) != 0x7F;
    bad += FloatToE4M3(FromBits(0xFF800000u | m)) != 0x7F;
    bad += FloatToE2M1(FromBits(0xFF800000u | m)) != 0x7;
    bad += FloatToFp16(FromBits(0xFF800000u | m)) != kCanonicalNan16;
    bad += FloatToBf16(FromBits(0x7F800000u | m)) != kCanonicalNan16;
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Fp16Test, WideningEveryPattern) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    const double want = Fp16Value(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
      ASSERT_EQ(FloatToFp16(f), h) << h;  // round trip
    }
    ASSERT_EQ(FloatToBf16(Bf16ToFloat(static_cast<uint16_t>(h))),
              ((h & 0x7FFF) > 0x7F80) ? kCanonicalNan16 : h);
  }
}

// Narrowing of every non-NaN fp32 pattern to fp16 and to bf16 against the walk; the table ends
// with an overflow pseudo-entry (the next power of two, coded as infinity) so RNE overflow is
// part of the expectation.
TEST(NarrowingTest, EveryFp32PatternToFp16AndBf16) {
  std::vector<Entry> fp16, bf16;
  for (uint32_t h = 0; h < 0x7C00; ++h) fp16.push_back({Fp16Value(static_cast<uint16_t>(h)), h});
  fp16.push_back({65536.0, 0x7C00});
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    bf16.push_back({static_cast<double>(FromBits(h << 16)), h});
  }
  bf16.push_back({std::ldexp(1.0, 128), 0x7F80});
  SplitTwo(0, 0x7F800001ull, [&](uint64_t lo, uint64_t hi) {
    NearestEvenWalker walk16(fp16), walkb(bf16);
    uint64_t bad = 0;
    for (uint64_t u = lo; u < hi; ++u) {
      const float x = FromBits(static_cast<uint32_t>(u));
      const double xd = static_cast<double>(x);
      const uint32_t w16 = walk16.Next(xd), wb = walkb.Next(xd);
      bad += FloatToFp16(x) != w16;
      bad += FloatToFp16(-x) != (w16 | 0x8000u);
      bad += FloatToBf16(x) != wb;
      bad += FloatToBf16(-x) != (wb | 0x8000u);
    }
    EXPECT_EQ(bad, 0u) << "range [" << lo << ", " << hi << ")";
  });
}

TEST(FloatingPointTest, MinMaxHaveFminfSemantics) {
  const float nan = std::nanf("");
  EXPECT_EQ(FMin(nan, 3.0f), 3.0f);  // a NaN operand yields the other one
  EXPECT_EQ(FMin(3.0f, nan), 3.0f);
  EXPECT_EQ(FMax(nan, -3.0f), -3.0f);
  EXPECT_EQ(FMax(-3.0f, nan), -3.0f);
  EXPECT_TRUE(std::isnan(FMin(nan, nan)));
  EXPECT_EQ(FMin(2.0f, 3.0f), 2.0f);
  EXPECT_EQ(FMax(2.0f, 3.0f), 3.0f);
  EXPECT_EQ(FMin(INFINITY, FltMax()), FltMax());
  EXPECT_EQ(MaxSkipNan(1.0f, nan), 1.0f);
  EXPECT_EQ(MaxSkipNan(1.0f, INFINITY), INFINITY);
  EXPECT_EQ(FloatBits(FAbs(-0.0f)), 0u);
  EXPECT_EQ(FloatBits(FltMax()), 0x7F7FFFFFu);
}

// The FP16-error variant of 4over6 rounds E2M1val(q) * float(sf) to fp16; the spec notes the
// product is exact in fp16. Check it for every code pair (so the rounding is an identity, and a
// kernel may rely on it), and that the fp32 product is exact too.
TEST(Fp16Test, E2M1TimesE4M3IsExactInFp16) {
  for (uint32_t q = 0; q < 16; ++q) {
    for (uint32_t sf = 0; sf < 0x7F; ++sf) {
      const float p =
          FMul(E2M1ToFloat(static_cast<uint8_t>(q)), E4M3ToFloat(static_cast<uint8_t>(sf)));
      EXPECT_EQ(static_cast<double>(p), static_cast<double>(E2M1ToFloat(static_cast<uint8_t>(q))) *
                                            E4M3Value(static_cast<uint8_t>(sf)));
      EXPECT_EQ(FloatBits(RoundToFp16(p)), FloatBits(p)) << q << " " << sf;
    }
  }
}

// With FMA instructions available, a compiler allowed to contract would turn
// FAdd(FMul(a, b), c) into one fused operation. a = b = 1 + 2^-12: a*b = 1 + 2^-11 + 2^-24
// rounds to 1 + 2^-11 (a tie, to even), so the separate ops give 0 for c = -(1 + 2^-11) while a
// fused multiply-add gives 2^-24.
__attribute__((target("fma"))) float MulAddWithFmaAvailable(float a, float b, float c) {
  return FAdd(FMul(a, b), c);
}

TEST(FloatingPointTest, HostArithmeticIsNotContracted) {
  volatile float a = 1.0f + std::ldexp(1.0f, -12), c = -(1.0f + std::ldexp(1.0f, -11));
  ASSERT_EQ(std::fma(a, a, c), std::ldexp(1.0f, -24));  // the case discriminates
  EXPECT_EQ(FAdd(FMul(a, a), c), 0.0f);
  if (__builtin_cpu_supports("fma")) {
    EXPECT_EQ(MulAddWithFmaAvailable(a, a, c), 0.0f);
  }
  // The spec's association: bmax * (S_enc * fl32(1/6)), one rounding each.
  EXPECT_EQ(FloatBits(BitsFloat(kOneSixthBits)), 0x3E2AAAABu);
  EXPECT_EQ(FloatBits(FDiv(1.0f, 2688.0f)), kInv2688Bits);
  EXPECT_EQ(FloatBits(FDiv(1.0f, 1536.0f)), kInv1536Bits);
  EXPECT_EQ(FloatBits(FDiv(1.0f, 6.0f)), kOneSixthBits);
}

}  // namespace
}  // namespace wpub::kernels
