// Hand-derived golden blocks for the standard and 4over6 quantizers, with the arithmetic written
// out, covering the spec's edge cases: all zeros with -0.0, +-inf, NaN, scale underflow, a
// subnormal amax, FLT_MAX, exact E2M1 ties and E2M1 boundaries +-1e-3. Notation: fl(.) is one
// fp32 rounding, S_enc/S_dec the global scales, sf the E4M3 block scale byte.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/reference.h"

namespace wpub::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kFltMax = std::numeric_limits<float>::max();

struct Quantized {
  float amax = 0;
  int64_t nonfinite = 0;
  std::vector<uint8_t> packed, sf;
  float s_dec = 0;
};

// Quantizes a 1 x n fp32 row with the tensor amax computed by the reference.
Quantized QuantizeRow(const std::vector<float>& x, QuantMode mode) {
  Quantized q;
  const int64_t n = static_cast<int64_t>(x.size());
  const WeightDesc w = WeightDesc::Dense(x.data(), 1, n, ElemType::kF32);
  EXPECT_EQ(ComputeAmax(w, &q.amax, &q.nonfinite), KernelStatus::kOk);
  q.packed.assign(static_cast<size_t>(n / 2), 0xAA);
  q.sf.assign(static_cast<size_t>(n / 16), 0xAA);
  const QuantOutput out{q.packed.data(), q.sf.data(), nullptr, &q.s_dec};
  EXPECT_EQ(Quantize(w, &q.amax, mode, out), KernelStatus::kOk);
  return q;
}

// Fake-quantizes a 1 x n row stored as bf16 and returns the output bits.
std::vector<uint16_t> QdqBf16(const std::vector<float>& x, QuantMode mode) {
  std::vector<uint16_t> in(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) in[i] = FloatToBf16(x[i]);
  const WeightDesc w =
      WeightDesc::Dense(in.data(), 1, static_cast<int64_t>(x.size()), ElemType::kBF16);
  const QdqTask task{&w, nullptr, out.data()};
  EXPECT_EQ(FakeQuantize(std::span<const QdqTask>(&task, 1), mode), KernelStatus::kOk);
  return out;
}

using Bytes = std::vector<uint8_t>;

// ---- Standard NVFP4 ---------------------------------------------------------------------------

TEST(GoldenStandardTest, EveryCodeOnce) {
  // x = {0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6}: amax = 6.
  // S_enc = 2688/6 = 448 (exact); S_dec = fl(1/448) = 0x3B124925.
  // mult = fl(448 * fl(1/6)) = 74.66667 (0x42955556); s = fl(6 * mult) = 448.00003 -> sf 0x7E.
  // inv = fl(1/fl(448 * S_dec)) = fl(1/1.0) = 1, so q_i = E2M1(x_i): codes 0..7 then 8..F.
  const Quantized q = QuantizeRow({0, .5, 1, 1.5, 2, 3, 4, 6, -0.0f, -.5, -1, -1.5, -2, -3, -4, -6},
                                  QuantMode::Standard());
  EXPECT_EQ(q.sf, Bytes({0x7E}));
  EXPECT_EQ(q.packed, Bytes({0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE}));
  EXPECT_EQ(FloatBits(q.s_dec), 0x3B124925u);
  // Decode: final = fl(fl(448 * 6) * fl(1/2688)) = fl(2688 * 0x39C30C31) = 1.0, so the QDQ
  // output equals the input, -0.0 included.
  const std::vector<uint16_t> y = QdqBf16(
      {0, .5, 1, 1.5, 2, 3, 4, 6, -0.0f, -.5, -1, -1.5, -2, -3, -4, -6}, QuantMode::Standard());
  EXPECT_EQ(
      y, std::vector<uint16_t>({0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0}));
}

TEST(GoldenStandardTest, AllZerosWithNegativeZero) {
  // amax = 0 -> S_enc = min(2688/0 = inf, FLT_MAX) = FLT_MAX; S_dec = fl(1/FLT_MAX) = 2^-128
  // (0x00200000, subnormal, must survive). bmax = 0 -> s = 0 -> sf 0x00.
  // inv = min(1/(0 * S_dec) = inf, FLT_MAX) = FLT_MAX; q = E2M1(+-0 * FLT_MAX) = 0x0 / 0x8.
  std::vector<float> x;
  for (int i = 0; i < 16; ++i) x.push_back(i % 2 ? -0.0f : 0.0f);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(q.amax, 0.0f);
  EXPECT_EQ(q.sf, Bytes({0x00}));
  EXPECT_EQ(q.packed, Bytes(8, 0x80));
  EXPECT_EQ(FloatBits(q.s_dec), 0x00200000u);
  // Decode: final = 0 * 0 * c = 0; y = (+-0) * 0 keeps the sign.
  std::vector<uint16_t> want;
  for (int i = 0; i < 16; ++i) want.push_back(i % 2 ? 0x8000 : 0x0000);
  EXPECT_EQ(QdqBf16(x, QuantMode::Standard()), want);
}

TEST(GoldenStandardTest, OneInfinity) {
  // x = {inf, 1, -2, .5, 0 x 11, -inf}: amax = inf, nonfinite = 2.
  // S_enc = 2688/inf = 0 -> 1; S_dec = 1. bmax = inf: s = min(inf * fl(1/6), FLT_MAX) = FLT_MAX
  // -> sf 0x7E (448). inv = fl(1/448) = 0.002232143: inf -> 0x7; 1 * inv -> 0x0;
  // -2 * inv = -0.0045 -> 0x8; .5 * inv -> 0x0; -inf -> 0xF.
  std::vector<float> x = {kInf, 1, -2, .5};
  x.resize(15, 0.0f);
  x.push_back(-kInf);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(q.amax, kInf);
  EXPECT_EQ(q.nonfinite, 2);
  EXPECT_EQ(q.sf, Bytes({0x7E}));
  EXPECT_EQ(q.packed, Bytes({0x07, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0xF0}));
  EXPECT_EQ(FloatBits(q.s_dec), 0x3F800000u);
  // Decode factor = 448 * inf * c = inf: +-6 -> +-inf, every zero code -> NaN (0x7FFF).
  const std::vector<uint16_t> y = QdqBf16(x, QuantMode::Standard());
  EXPECT_EQ(y[0], 0x7F80);
  EXPECT_EQ(y[15], 0xFF80);
  for (int i = 1; i < 15; ++i) EXPECT_EQ(y[static_cast<size_t>(i)], kCanonicalNan16) << i;
}

TEST(GoldenStandardTest, NanElementsAndAllNanBlock) {
  // Block 0 = {NaN, 6, 3, -1.5, 0 x 12}, block 1 = 16 x NaN. amax skips NaN: 6; nonfinite 17.
  // S_enc = 448, block 0 as in EveryCodeOnce: sf 0x7E, inv = 1; NaN * 1 = NaN -> 0x7 (+6).
  // Block 1: bmax skips NaN -> 0 -> sf 0x00, inv = FLT_MAX, every NaN -> 0x7.
  std::vector<float> x = {kNan, 6, 3, -1.5};
  x.resize(16, 0.0f);
  x.resize(32, kNan);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(q.amax, 6.0f);
  EXPECT_EQ(q.nonfinite, 17);
  EXPECT_EQ(q.sf, Bytes({0x7E, 0x00}));
  EXPECT_EQ(q.packed,
            Bytes({0x77, 0xB5, 0, 0, 0, 0, 0, 0, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77}));
  // Decode: NaN in block 0 becomes +6 * 1 = 6 (0x40C0); block 1 decodes to 6 * 0 = +0.
  const std::vector<uint16_t> y = QdqBf16(x, QuantMode::Standard());
  EXPECT_EQ(y[0], 0x40C0);
  EXPECT_EQ(y[3], 0xBFC0);
  for (int i = 16; i < 32; ++i) EXPECT_EQ(y[static_cast<size_t>(i)], 0x0000) << i;
}

TEST(GoldenStandardTest, BlockScaleUnderflow) {
  // Block 0 = {2^-8, -2^-8, 0, 2^-9, 0...}, block 1 = {2688, 0...}: amax = 2688 -> S_enc = 1,
  // S_dec = 1. Block 0: s = fl(2^-8 * fl(1/6)) = 6.5e-4 <= 2^-10 -> sf 0x00; inv = FLT_MAX;
  // 2^-8 * FLT_MAX -> 0x7, -2^-8 -> 0xF, 2^-9 * FLT_MAX -> 0x7. Block 1: s = fl(2688 *
  // fl(1/6)) = 448.00003 -> 0x7E; inv = fl(1/448); fl(2688 * inv) = 6.0000005 -> 0x7.
  std::vector<float> x = {0x1p-8f, -0x1p-8f, 0, 0x1p-9f};
  x.resize(16, 0.0f);
  x.push_back(2688);
  x.resize(32, 0.0f);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(q.sf, Bytes({0x00, 0x7E}));
  EXPECT_EQ(q.packed, Bytes({0xF7, 0x70, 0, 0, 0, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0}));
  // The +-6 codes of the underflowed block decode to +-0 (final = 0).
  const std::vector<uint16_t> y = QdqBf16(x, QuantMode::Standard());
  EXPECT_EQ(y[0], 0x0000);
  EXPECT_EQ(y[1], 0x8000);
  EXPECT_EQ(y[3], 0x0000);
  EXPECT_EQ(y[16], 0x4528);  // 2688 = 6 * fl(fl(448 * 2688) * fl(1/2688)) = 6 * 448
}

TEST(GoldenStandardTest, SubnormalAmax) {
  // x = {2^-130, -2^-131, 2^-133, 2^-149, 0...}: amax = 2^-130 (subnormal).
  // S_enc = 2688 / 2^-130 overflows -> FLT_MAX; S_dec = 2^-128 (0x00200000, subnormal).
  // mult = fl(FLT_MAX * fl(1/6)) = 5.671373e37; s = fl(2^-130 * mult) = 0.0416667 ->
  // E4M3: 1.3333 * 2^-5 rounds to 1.375 * 2^-5 = 0.04296875 -> sf 0x13.
  // inv = min(1/fl(0.04296875 * 2^-128), FLT_MAX) = FLT_MAX (2^136/11 overflows);
  // 2^-130 * FLT_MAX = 0.25 * (1 - 2^-24) < 0.25 -> 0x0; -2^-131 -> 0x8; the rest -> 0x0.
  std::vector<float> x = {0x1p-130f, -0x1p-131f, 0x1p-133f, 0x1p-149f};
  x.resize(16, 0.0f);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(FloatBits(q.amax), 0x00080000u);
  EXPECT_EQ(FloatBits(q.s_dec), 0x00200000u);
  EXPECT_EQ(q.sf, Bytes({0x13}));
  EXPECT_EQ(q.packed, Bytes({0x80, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(GoldenStandardTest, FltMax) {
  // x = {FLT_MAX, -FLT_MAX} x 8: amax = FLT_MAX; S_enc = fl(2688/FLT_MAX) = 0x05280001,
  // S_dec = fl(1/S_enc) = 0x79C30C30. s = fl(FLT_MAX * fl(S_enc * fl(1/6))) = 448.00003 ->
  // 0x7E; inv = fl(1/fl(448 * S_dec)) = 1.763e-38; fl(FLT_MAX * inv) = 6.0000005 -> 0x7 / 0xF.
  std::vector<float> x;
  for (int i = 0; i < 16; ++i) x.push_back(i % 2 ? -kFltMax : kFltMax);
  const Quantized q = QuantizeRow(x, QuantMode::Standard());
  EXPECT_EQ(q.sf, Bytes({0x7E}));
  EXPECT_EQ(q.packed, Bytes(8, 0xF7));
  EXPECT_EQ(FloatBits(q.s_dec), 0x79C30C30u);
}

TEST(GoldenStandardTest, ExactE2M1Ties) {
  // amax = bmax = 6 -> inv = 1 (as in EveryCodeOnce); ties round to the even code:
  // .25 -> 0, .75 -> 1 (code 2), 1.25 -> 1, 1.75 -> 2 (4), 2.5 -> 2, 3.5 -> 4 (6), 5 -> 4, 6 -> 7.
  const Quantized q = QuantizeRow(
      {.25, .75, 1.25, 1.75, 2.5, 3.5, 5, 6, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6},
      QuantMode::Standard());
  EXPECT_EQ(q.sf, Bytes({0x7E}));
  EXPECT_EQ(q.packed, Bytes({0x20, 0x42, 0x64, 0x76, 0xA8, 0xCA, 0xEC, 0xFE}));
}

TEST(GoldenStandardTest, E2M1BoundariesPlusMinus1e3) {
  // inv = 1 again (bmax = amax = 6); each boundary b is hit at b - 1e-3 and b + 1e-3:
  // .249 -> 0, .251 -> .5 (1), .749 -> .5 (1), .751 -> 1 (2), 1.249 -> 2, 1.251 -> 3,
  // 1.749 -> 3, 1.751 -> 4, 2.499 -> 4, 2.501 -> 5, 3.499 -> 5, 3.501 -> 6, 4.999 -> 6,
  // 5.001 -> 7, 6 -> 7, -.251 -> 0x9.
  const Quantized q = QuantizeRow({.249f, .251f, .749f, .751f, 1.249f, 1.251f, 1.749f, 1.751f,
                                   2.499f, 2.501f, 3.499f, 3.501f, 4.999f, 5.001f, 6, -.251f},
                                  QuantMode::Standard());
  EXPECT_EQ(q.sf, Bytes({0x7E}));
  EXPECT_EQ(q.packed, Bytes({0x10, 0x21, 0x32, 0x43, 0x54, 0x65, 0x76, 0x97}));
}

// ---- 4over6 -----------------------------------------------------------------------------------
// Each tensor is 1 x 32: block 0 is the block under test, block 1 = {6, 0...} fixes amax = 6.
// E = 448: S_enc = 448, S_dec = fl(1/448). E = 256: S_enc = 1536/6 = 256, S_dec = 2^-8.
// base = fl(fl(bmax / 6) * S_enc); s6 = E4M3(min(base, 448)); s4 = E4M3(min(fl(base*1.5), 448)).
// For bmax = 3: E=448: base 224 -> s6 224 (0x76), fl(336) ties to 320 (0x7A); inv6 = 2,
//   inv4 = 1.4. E=256: base 128 -> s6 0x70, 192 -> s4 0x74; inv6 = 2, inv4 = 1.3333334.
// For bmax = 4: E=448: base 298.6667 -> s6 288 (0x79), fl(448.00003) -> s4 448 (0x7E);
//   inv6 = 1.5555555, inv4 = 1. E=256: base 170.66667 -> s6 176 (0x73), 256 -> s4 0x78.
// Block 1 ({6, 0...}, bmax = amax) always keeps s6 (E=448: s6 = s4 = 0x7E tie -> 6; E=256:
// s6 = 0x78 exact, err6 = 0).

struct FourOverSixCase {
  QuantMode mode;
  uint8_t sf0;
  Bytes packed0;
};

void ExpectFourOverSix(const std::vector<float>& block, const std::vector<FourOverSixCase>& cases) {
  std::vector<float> x = block;
  x.push_back(6);
  x.resize(32, 0.0f);
  for (const FourOverSixCase& c : cases) {
    SCOPED_TRACE(c.mode.Name());
    const Quantized q = QuantizeRow(x, c.mode);
    ASSERT_EQ(q.sf.size(), 2u);
    EXPECT_EQ(q.sf[0], c.sf0);
    EXPECT_EQ(q.sf[1], c.mode.e4m3_max == 448 ? 0x7E : 0x78);
    EXPECT_EQ(Bytes(q.packed.begin(), q.packed.begin() + 8), c.packed0);
    EXPECT_EQ(Bytes(q.packed.begin() + 8, q.packed.end()), Bytes({0x07, 0, 0, 0, 0, 0, 0, 0}));
  }
}

using EM = ErrMetric;
using EK = ErrKind;

TEST(GoldenFourOverSixTest, ExactlyOnTheSixGridKeepsSix) {
  // B = {3, 2, 1.5, 1, -.5, .5, -2, 1, 0 x 7, .5}, bmax = 3. Map-to-6 (scale 0.5 in x units,
  // grid {0, .25, .5, .75, 1, 1.5, 2, 3}) holds every value exactly: err6 = 0 in every mode,
  // so err4 < err6 is impossible and map-to-6 wins: codes 6->7, 2->6 (4), 1.5->3 (5), 1->2 (4),
  // -.5 -> -1 (0xA), .5 -> 1 (2), -2 -> -4 (0xE), 1 -> 2 (4), .5 -> 1 (2).
  // Standard for reference: s = fl(3 * 74.66667) = 224.00002 -> 0x76, same codes.
  const Bytes six = {0x67, 0x45, 0x2A, 0x4E, 0x00, 0x00, 0x00, 0x20};
  std::vector<FourOverSixCase> cases = {{QuantMode::Standard(), 0x76, six}};
  for (EM m : {EM::kMAE, EM::kMSE}) {
    for (EK k : {EK::kExact, EK::kFP16}) {
      cases.push_back({QuantMode::FourOverSix(m, 448, k), 0x76, six});
      cases.push_back({QuantMode::FourOverSix(m, 256, k), 0x70, six});
    }
  }
  ExpectFourOverSix({3, 2, 1.5, 1, -.5, .5, -2, 1, 0, 0, 0, 0, 0, 0, 0, .5}, cases);
}

TEST(GoldenFourOverSixTest, MaeAndMseDisagreeAtE448) {
  // A = {3, 2.25, 1.5, .7, -1.1, .3, -2.2, 1, 0 x 7, .5}, bmax = 3, E = 448.
  // Map-to-6 (x * 2): 6->7, 4.5->4 (6), 3->3 (5), 1.4->1.5 (3), -2.2->-2 (0xC), .6->.5 (1),
  //   -4.4 -> -4 (0xE), 2->2 (4), 1->1 (2). Errors in x units: 0, .25, 0, .05, .1, .05, .2, 0, 0.
  // Map-to-4 (x * 1.4, decode step 320/448 = .714): 4.2->4 (6), 3.15->3 (5), 2.1->2 (4),
  //   .98->1 (2), -1.54->-1.5 (0xB), .42->.5 (1), -3.08->-3 (0xD), 1.4->1.5 (3), .7->.5 (1).
  //   Errors: .143, .107, .071, .014, .029, .057, .057, .071, .143.
  // MAE exact: err6 = .65 < err4 = .693 -> map-to-6 (sf 0x76).
  // MSE exact: err6 = .1175 > err4 = .0701 -> map-to-4 (sf 0x7A).
  // FP16 error works in the scaled domain (x * S_enc) with the same decisions here.
  // E = 256 (s6 0x70, s4 0x74, decode step 192/256 = .75 for map-to-4): err4 < err6 in both
  // metrics (MAE .45 < .65, MSE .0425 < .1175) -> map-to-4, same codes as above.
  const std::vector<float> block = {3, 2.25, 1.5, .7f, -1.1f, .3f, -2.2f, 1,
                                    0, 0,    0,   0,   0,     0,   0,     .5};
  const Bytes six = {0x67, 0x35, 0x1C, 0x4E, 0x00, 0x00, 0x00, 0x20};
  const Bytes four = {0x56, 0x24, 0x1B, 0x3D, 0x00, 0x00, 0x00, 0x10};
  std::vector<FourOverSixCase> cases;
  for (EK k : {EK::kExact, EK::kFP16}) {
    cases.push_back({QuantMode::FourOverSix(EM::kMAE, 448, k), 0x76, six});
    cases.push_back({QuantMode::FourOverSix(EM::kMSE, 448, k), 0x7A, four});
    cases.push_back({QuantMode::FourOverSix(EM::kMAE, 256, k), 0x74, four});
    cases.push_back({QuantMode::FourOverSix(EM::kMSE, 256, k), 0x74, four});
  }
  ExpectFourOverSix(block, cases);
}

TEST(GoldenFourOverSixTest, E448AndE256Disagree) {
  // C = {4, 3, 1.4, 1.4, -1.4, 1.4, -2.8, 2.8, 0 x 8}, bmax = 4.
  // E = 448: s6 = 288 (inv6 = 1.5555555, step 288/448 = .643): 4*1.556 = 6.22 -> 6 (7),
  //   3 -> 4.67 -> 4 (6), 1.4 -> 2.18 -> 2 (4), -1.4 -> 0xC, -2.8 -> -4.36 -> -4 (0xE),
  //   2.8 -> 4 (6); errors .143, .429, .114 x4, .229 x2 -> MAE 1.486.
  //   s4 = 448 (inv4 = 1): codes 4 (6), 3 (5), 1.5 (3) x4, -3 (0xD), 3 (5); errors 0, 0, .1 x4,
  //   .2 x2 -> MAE .8 < 1.486 -> map-to-4 (sf 0x7E); MSE .12 < .361 -> map-to-4.
  // E = 256: s6 = 176 (step 176/256 = .6875: 4 -> 6*.6875 = 4.125, 3 -> 4*.6875 = 2.75,
  //   1.4 -> 2*.6875 = 1.375, 2.8 -> 4*.6875 = 2.75) errors .125, .25, .025 x4, .05 x2 = .575;
  //   s4 = 256 (step 1) as above = .8 -> map-to-6 (sf 0x73); MSE .0856 < .12 -> map-to-6.
  const std::vector<float> block = {4, 3, 1.4f, 1.4f, -1.4f, 1.4f, -2.8f, 2.8f,
                                    0, 0, 0,    0,    0,     0,    0,     0};
  const Bytes four448 = {0x56, 0x33, 0x3B, 0x5D, 0, 0, 0, 0};
  const Bytes six256 = {0x67, 0x44, 0x4C, 0x6E, 0, 0, 0, 0};
  std::vector<FourOverSixCase> cases;
  for (EM m : {EM::kMAE, EM::kMSE}) {
    for (EK k : {EK::kExact, EK::kFP16}) {
      cases.push_back({QuantMode::FourOverSix(m, 448, k), 0x7E, four448});
      cases.push_back({QuantMode::FourOverSix(m, 256, k), 0x73, six256});
    }
  }
  ExpectFourOverSix(block, cases);
}

TEST(GoldenFourOverSixTest, TieChoosesMapToSix) {
  // amax = bmax = 6, E = 448: base = fl(fl(6/6) * 448) = 448; s6 = E4M3(448) = 0x7E and
  // s4 = E4M3(min(672, 448)) = 0x7E: identical candidates, err4 == err6 -> map-to-6 (the
  // strict comparison). Any block: use the every-code block.
  for (int i = 1; i < kNumQuantModes; ++i) {
    const QuantMode mode = QuantMode::FromIndex(i);
    if (mode.e4m3_max != 448) continue;
    SCOPED_TRACE(mode.Name());
    const Quantized q =
        QuantizeRow({0, .5, 1, 1.5, 2, 3, 4, 6, -0.0f, -.5, -1, -1.5, -2, -3, -4, -6}, mode);
    EXPECT_EQ(q.sf, Bytes({0x7E}));
    EXPECT_EQ(q.packed, Bytes({0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE}));
  }
}

TEST(GoldenFourOverSixTest, NanElementErrorChoosesMapToSix) {
  // A NaN element makes both errors NaN; NaN < NaN is false -> map-to-6, NaN code +6 (0x7).
  // Block 0 = {NaN, 3, 2.25, ...} with amax 6 (block 1): MSE at E=448 would otherwise pick 4.
  const std::vector<float> block = {kNan, 3, 2.25, 1.5, .7f, -1.1f, .3f, -2.2f,
                                    1,    0, 0,    0,   0,   0,     0,   .5};
  std::vector<float> x = block;
  x.push_back(6);
  x.resize(32, 0.0f);
  const Quantized q = QuantizeRow(x, QuantMode::FourOverSix(EM::kMSE, 448, EK::kExact));
  EXPECT_EQ(q.sf[0], 0x76);      // s6 for bmax = 3
  EXPECT_EQ(q.packed[0], 0x77);  // NaN -> 0x7, 3 * 2 = 6 -> 0x7
}

}  // namespace
}  // namespace wpub::kernels
