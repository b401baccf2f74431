// Invariants of the CPU reference over the spec's strict matrix and over composite inputs:
// qdq(x) == dequantize(quantize(x)) (uint16 views) for 9 modes x bf16/fp16 x 4 families x 12
// shapes; 4over6 picks the strictly lower error (ties -> map-to-6); pairs share amax and decode
// scale; rank-3 stacks get per-slice scales; multi-part inputs give the concatenation's bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/reference.h"
#include "kernels/testing/test_data.h"

namespace wpub::kernels {
namespace {

using testing::DataFamily;
using testing::MakeRandomTensor;
using testing::MakeTestTensor;
using testing::TestTensor;

const CpuOptions kTwoThreads{2};

struct QuantResult {
  std::vector<float> amax;
  std::vector<uint8_t> packed, scales, swizzled;
  std::vector<float> decode_scale;
};

QuantResult QuantizeWeight(const WeightDesc& w, QuantMode mode, const float* amax = nullptr) {
  QuantResult r;
  const int64_t slices = w.num_slices, rows = w.rows(), cols = w.cols();
  r.amax.resize(static_cast<size_t>(slices));
  if (amax != nullptr) {
    r.amax.assign(amax, amax + slices);
  } else {
    EXPECT_EQ(ComputeAmax(w, r.amax.data(), nullptr, kTwoThreads), KernelStatus::kOk);
  }
  r.packed.assign(static_cast<size_t>(slices * rows * cols / 2), 0xAA);
  r.scales.assign(static_cast<size_t>(slices * rows * cols / 16), 0xAA);
  r.swizzled.assign(static_cast<size_t>(slices * SwizzledScaleSize(rows, cols / 16)), 0xAA);
  r.decode_scale.assign(static_cast<size_t>(slices), -1.0f);
  const QuantOutput out{r.packed.data(), r.scales.data(), r.swizzled.data(), r.decode_scale.data()};
  EXPECT_EQ(Quantize(w, r.amax.data(), mode, out, kTwoThreads), KernelStatus::kOk);
  return r;
}

std::vector<uint16_t> Qdq(const WeightDesc& w, QuantMode mode, const float* amax = nullptr) {
  std::vector<uint16_t> out(static_cast<size_t>(w.num_slices * w.rows() * w.cols()), 0xAAAA);
  const QdqTask task{&w, amax, out.data()};
  EXPECT_EQ(FakeQuantize(std::span<const QdqTask>(&task, 1), mode, kTwoThreads), KernelStatus::kOk);
  return out;
}

std::vector<uint16_t> Dequant(const QuantResult& q, const WeightDesc& w, QuantMode mode) {
  std::vector<uint16_t> out(static_cast<size_t>(w.num_slices * w.rows() * w.cols()), 0xAAAA);
  const QuantizedView view{q.packed.data(), q.scales.data(), q.amax.data(),
                           w.num_slices,    w.rows(),        w.cols()};
  EXPECT_EQ(Dequantize(view, mode, w.type, out.data(), kTwoThreads), KernelStatus::kOk);
  return out;
}

// Index of the first differing element, or -1.
int64_t FirstDiff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

class StrictMatrixTest : public ::testing::TestWithParam<std::tuple<int, ElemType>> {};

// 12 shapes x 4 families per (mode, dtype) parameter: 864 cases in all.
TEST_P(StrictMatrixTest, QdqEqualsDequantizeOfQuantize) {
  const QuantMode mode = QuantMode::FromIndex(std::get<0>(GetParam()));
  const ElemType type = std::get<1>(GetParam());
  for (const testing::TestShape& shape : testing::kSpecShapes) {
    for (DataFamily family : testing::kAllDataFamilies) {
      SCOPED_TRACE(std::string(testing::DataFamilyName(family)) + " [" +
                   std::to_string(shape.rows) + ", " + std::to_string(shape.cols) + "]");
      const TestTensor t = MakeTestTensor(family, type, shape.rows, shape.cols, /*seed=*/7);
      const WeightDesc w = t.desc();
      const QuantResult q = QuantizeWeight(w, mode);
      const std::vector<uint16_t> fused = Qdq(w, mode);
      const std::vector<uint16_t> unfused = Dequant(q, w, mode);
      const int64_t diff = FirstDiff(fused, unfused);
      ASSERT_EQ(diff, -1) << "element " << diff << ": fused 0x" << std::hex
                          << fused[static_cast<size_t>(diff)] << " unfused 0x"
                          << unfused[static_cast<size_t>(diff)];
      // Caller-provided amax gives the same result as the computed one.
      EXPECT_EQ(FirstDiff(Qdq(w, mode, q.amax.data()), fused), -1);
      EXPECT_EQ(FloatBits(q.decode_scale[0]), FloatBits(GlobalDecodeScale(GlobalEncodeScale(
                                                  q.amax[0], static_cast<float>(mode.e4m3_max)))));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllModes, StrictMatrixTest,
                         ::testing::Combine(::testing::Range(0, kNumQuantModes),
                                            ::testing::Values(ElemType::kBF16, ElemType::kF16)),
                         [](const auto& info) {
                           std::string n = QuantMode::FromIndex(std::get<0>(info.param)).Name();
                           for (char& c : n) c = (c == '-') ? '_' : c;
                           return n + "_" + ElemTypeName(std::get<1>(info.param));
                         });

// Recomputes the two 4over6 candidates of every block with the spec's error formula written
// out here and checks the reference chose the strictly better one (ties -> map-to-6).
TEST(FourOverSixSelectionTest, ChoosesStrictlyLowerErrorTiesToSix) {
  int64_t chose4 = 0, ties = 0;
  for (int m = 1; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    const float e = static_cast<float>(mode.e4m3_max);
    const TestTensor t = MakeRandomTensor(ElemType::kBF16, 64, 256, /*seed=*/m);
    const QuantResult q = QuantizeWeight(t.desc(), mode);
    const float amax = q.amax[0];
    const TensorScales ts = MakeTensorScales(amax, e);
    for (int64_t b = 0; b < t.numel() / 16; ++b) {
      float x[16], bmax = 0;
      for (int i = 0; i < 16; ++i) {
        x[i] = t.at(b * 16 + i);
        bmax = std::max(bmax, std::fabs(x[i]));
      }
      const float base = (bmax / 6.0f) * ts.s_enc;
      const uint8_t sf[2] = {FloatToE4M3(std::min(base, 448.0f)),
                             FloatToE4M3(std::min(base * 1.5f, 448.0f))};  // {6, 4}
      float err[2];
      for (int c = 0; c < 2; ++c) {
        const float s = E4M3ToFloat(sf[c]);
        const float inv = std::min(1.0f / (s * ts.s_dec), FltMax());
        float acc = 0.0f;
        for (int i = 0; i < 16; ++i) {
          const float qs = E2M1ToFloat(FloatToE2M1(x[i] * inv)) * s;
          const float d = mode.err == ErrKind::kExact ? (qs * amax) / (6.0f * e) - x[i]
                                                      : RoundToFp16(qs) - x[i] * ts.s_enc;
          acc = acc + (mode.metric == ErrMetric::kMAE ? std::fabs(d) : d * d);
        }
        err[c] = acc;
      }
      const bool four = err[1] < err[0];
      chose4 += four;
      ties += err[1] == err[0] && sf[0] != sf[1];
      ASSERT_EQ(q.scales[static_cast<size_t>(b)], four ? sf[1] : sf[0])
          << mode.Name() << " block " << b << " err6 " << err[0] << " err4 " << err[1];
    }
  }
  EXPECT_GT(chose4, 0);  // both branches exercised
}

TEST(FourOverSixSelectionTest, EqualErrorWithDistinctScalesChoosesSix) {
  // E = 256, amax 6 (second block), bmax 3: s6 = 128 (step .5), s4 = 192 (step .75). The values
  // 3, 1.5, -3, 0 lie on both grids, so err6 = err4 = 0 and the tie must keep map-to-6 (0x70).
  std::vector<float> x = {3, 1.5, -3, 0};
  x.resize(16, 0.0f);
  x.push_back(6);
  x.resize(32, 0.0f);
  const WeightDesc w = WeightDesc::Dense(x.data(), 1, 32, ElemType::kF32);
  for (int m = 1; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    if (mode.e4m3_max != 256) continue;
    const QuantResult q = QuantizeWeight(w, mode);
    EXPECT_EQ(q.scales[0], 0x70) << mode.Name();
  }
}

TEST(CompositeTest, PairSharesAmaxAndDecodeScale) {
  const TestTensor gate = MakeRandomTensor(ElemType::kBF16, 48, 64, 1, /*sigma=*/0.5);
  const TestTensor up = MakeRandomTensor(ElemType::kBF16, 48, 64, 2, /*sigma=*/3.0);
  float pair_amax = 0, gate_amax = 0, up_amax = 0;
  int64_t nonfinite = -1;
  ASSERT_EQ(ComputePairAmax(gate.desc(), up.desc(), &pair_amax, &nonfinite), KernelStatus::kOk);
  ASSERT_EQ(ComputeAmax(gate.desc(), &gate_amax), KernelStatus::kOk);
  ASSERT_EQ(ComputeAmax(up.desc(), &up_amax), KernelStatus::kOk);
  EXPECT_EQ(pair_amax, std::max(gate_amax, up_amax));
  EXPECT_NE(gate_amax, up_amax);
  EXPECT_EQ(nonfinite, 0);
  // [gate; up] as one two-part tensor quantizes to the concatenation of the members' bytes.
  WeightDesc cat = gate.desc();
  ASSERT_TRUE(cat.AddPart(up.data(), 48, 64));
  for (int m = 0; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    const QuantResult g = QuantizeWeight(gate.desc(), mode, &pair_amax);
    const QuantResult u = QuantizeWeight(up.desc(), mode, &pair_amax);
    const QuantResult c = QuantizeWeight(cat, mode);
    EXPECT_EQ(c.amax[0], pair_amax);
    EXPECT_EQ(FloatBits(g.decode_scale[0]), FloatBits(u.decode_scale[0]));
    EXPECT_EQ(FloatBits(g.decode_scale[0]), FloatBits(c.decode_scale[0]));
    std::vector<uint8_t> packed = g.packed, scales = g.scales;
    packed.insert(packed.end(), u.packed.begin(), u.packed.end());
    scales.insert(scales.end(), u.scales.begin(), u.scales.end());
    EXPECT_EQ(c.packed, packed) << mode.Name();
    EXPECT_EQ(c.scales, scales) << mode.Name();
  }
}

TEST(CompositeTest, Rank3StackHasPerSliceScales) {
  // Slices with very different magnitudes so a shared amax would change the bytes.
  const int64_t slices = 4, rows = 17, cols = 96;
  TestTensor stack = MakeRandomTensor(ElemType::kF16, rows, cols, 3, 1.0, slices);
  uint16_t* h = static_cast<uint16_t*>(stack.data());
  for (int64_t s = 0; s < slices; ++s) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = Fp16ToFloat(h[s * rows * cols + i]) * static_cast<float>(1 << (3 * s));
      h[s * rows * cols + i] = FloatToFp16(v);
    }
  }
  for (int m = 0; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    const QuantResult all = QuantizeWeight(stack.desc(), mode);
    const std::vector<uint16_t> qdq_all = Qdq(stack.desc(), mode);
    for (int64_t s = 0; s < slices; ++s) {
      const WeightDesc slice = WeightDesc::Dense(h + s * rows * cols, rows, cols, ElemType::kF16);
      const QuantResult one = QuantizeWeight(slice, mode);
      EXPECT_EQ(all.amax[static_cast<size_t>(s)], one.amax[0]);
      EXPECT_EQ(FloatBits(all.decode_scale[static_cast<size_t>(s)]),
                FloatBits(one.decode_scale[0]));
      EXPECT_EQ(0, std::memcmp(all.packed.data() + s * rows * cols / 2, one.packed.data(),
                               one.packed.size()));
      EXPECT_EQ(0, std::memcmp(all.scales.data() + s * rows * cols / 16, one.scales.data(),
                               one.scales.size()));
      const size_t sw = one.swizzled.size();
      EXPECT_EQ(0, std::memcmp(all.swizzled.data() + s * sw, one.swizzled.data(), sw));
      const std::vector<uint16_t> qdq_one = Qdq(slice, mode);
      EXPECT_EQ(0,
                std::memcmp(qdq_all.data() + s * rows * cols, qdq_one.data(), qdq_one.size() * 2));
    }
    EXPECT_NE(all.decode_scale[0], all.decode_scale[1]);
  }
}

// Parts of a weight (TP shards) concatenated along dim 0 or dim 1 give the same bytes as the
// materialized concatenation, for parts whose widths are not multiples of 16 too.
TEST(CompositeTest, MultiPartMatchesConcatenation) {
  const int64_t rows = 37;
  const int64_t widths[3] = {24, 40, 32};  // 96 columns in all
  const TestTensor full = MakeTestTensor(DataFamily::kBoundary, ElemType::kBF16, rows, 96, 5);
  const uint16_t* f = static_cast<const uint16_t*>(full.data());
  // Dim 1: split columns.
  std::vector<std::vector<uint16_t>> col_parts;
  WeightDesc by_cols;
  by_cols.type = ElemType::kBF16;
  by_cols.concat = ConcatDim::kCols;
  int64_t c0 = 0;
  for (int64_t wdt : widths) {
    std::vector<uint16_t> p;
    for (int64_t r = 0; r < rows; ++r) p.insert(p.end(), f + r * 96 + c0, f + r * 96 + c0 + wdt);
    col_parts.push_back(std::move(p));
    c0 += wdt;
  }
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(by_cols.AddPart(col_parts[i].data(), rows, widths[i]));
  // Dim 0: split rows 10 + 20 + 7.
  WeightDesc by_rows;
  by_rows.type = ElemType::kBF16;
  ASSERT_TRUE(by_rows.AddPart(f, 10, 96));
  ASSERT_TRUE(by_rows.AddPart(f + 10 * 96, 20, 96));
  ASSERT_TRUE(by_rows.AddPart(f + 30 * 96, 7, 96));
  ASSERT_EQ(by_cols.rows(), rows);
  ASSERT_EQ(by_cols.cols(), 96);
  ASSERT_EQ(by_rows.rows(), rows);
  for (int m = 0; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    const QuantResult want = QuantizeWeight(full.desc(), mode);
    const std::vector<uint16_t> want_qdq = Qdq(full.desc(), mode);
    for (const WeightDesc* w : {&by_cols, &by_rows}) {
      const QuantResult got = QuantizeWeight(*w, mode);
      EXPECT_EQ(got.amax, want.amax);
      EXPECT_EQ(got.packed, want.packed) << mode.Name();
      EXPECT_EQ(got.scales, want.scales) << mode.Name();
      EXPECT_EQ(got.swizzled, want.swizzled) << mode.Name();
      EXPECT_EQ(Qdq(*w, mode), want_qdq) << mode.Name();
    }
  }
}

}  // namespace
}  // namespace wpub::kernels
