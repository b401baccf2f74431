// API behaviour of the CPU reference: input validation and its messages, amax over lists,
// pairs and stacks with non-finite counts, thread-count independence, fp32 inputs, the swizzled
// scale layout, and the shared test-vector generator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/reference.h"
#include "kernels/testing/test_data.h"

namespace wpub::kernels {
namespace {

using testing::DataFamily;
using testing::MakeRandomTensor;
using testing::MakeTestTensor;
using testing::TestTensor;

TEST(ValidationTest, KNotMultipleOf16NamesTheWeight) {
  std::vector<uint16_t> ok(32 * 64), bad(8 * 40);
  const WeightDesc w_ok = WeightDesc::Dense(ok.data(), 32, 64, ElemType::kBF16);
  const WeightDesc w_bad = WeightDesc::Dense(bad.data(), 8, 40, ElemType::kBF16);
  std::vector<uint8_t> packed(32 * 32), scales(32 * 4);
  float ds = 0;
  const QuantOutput out{packed.data(), scales.data(), nullptr, &ds};
  const QuantizeTask tasks[3] = {
      {&w_ok, nullptr, out}, {&w_ok, nullptr, out}, {&w_bad, nullptr, out}};
  std::string error;
  EXPECT_EQ(Quantize(tasks, QuantMode::Standard(), {}, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("weight 2"), std::string::npos) << error;
  EXPECT_NE(error.find("40"), std::string::npos) << error;
  EXPECT_NE(error.find("multiple of 16"), std::string::npos) << error;

  std::vector<uint16_t> y(8 * 40);
  const QdqTask qdq[2] = {{&w_bad, nullptr, y.data()}, {&w_ok, nullptr, y.data()}};
  error.clear();
  EXPECT_EQ(FakeQuantize(qdq, QuantMode::Standard(), {}, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("weight 0"), std::string::npos) << error;

  float amax = 0;
  error.clear();
  EXPECT_EQ(ComputeAmax(w_bad, &amax, nullptr, {}, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("multiple of 16"), std::string::npos) << error;

  const QuantizedView view{packed.data(), scales.data(), &amax, 1, 8, 40};
  error.clear();
  EXPECT_EQ(Dequantize(view, QuantMode::Standard(), ElemType::kBF16, y.data(), {}, &error),
            KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("40"), std::string::npos) << error;
}

TEST(ValidationTest, MalformedDescriptorsAndModes) {
  std::vector<uint16_t> a(16 * 32), b(16 * 48);
  std::string error;
  WeightDesc empty;
  EXPECT_EQ(ValidateWeight(empty, 4, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("weight 4"), std::string::npos) << error;
  WeightDesc mismatched = WeightDesc::Dense(a.data(), 16, 32, ElemType::kBF16);
  mismatched.AddPart(b.data(), 16, 48);  // dim 0 concat with different widths
  EXPECT_EQ(ValidateWeight(mismatched, 0, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("part 1"), std::string::npos) << error;
  mismatched.concat = ConcatDim::kCols;  // [16, 80]: fine along dim 1
  EXPECT_EQ(ValidateWeight(mismatched, 0, &error), KernelStatus::kOk);
  EXPECT_EQ(mismatched.cols(), 80);
  WeightDesc null_part = WeightDesc::Dense(nullptr, 16, 32, ElemType::kF16);
  EXPECT_EQ(ValidateWeight(null_part, 1, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("null"), std::string::npos) << error;
  WeightDesc full = WeightDesc::Dense(a.data(), 1, 16, ElemType::kBF16);
  for (int i = 1; i < kMaxWeightParts; ++i) EXPECT_TRUE(full.AddPart(a.data(), 1, 16));
  EXPECT_FALSE(full.AddPart(a.data(), 1, 16));

  const WeightDesc w = WeightDesc::Dense(a.data(), 16, 32, ElemType::kBF16);
  std::vector<uint8_t> packed(16 * 16), scales(32);
  float ds = 0;
  QuantMode invalid = QuantMode::FourOverSix(ErrMetric::kMAE, 300, ErrKind::kExact);
  EXPECT_FALSE(invalid.IsValid());
  EXPECT_EQ(Quantize(w, nullptr, invalid, {packed.data(), scales.data(), nullptr, &ds}),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(Quantize(w, nullptr, QuantMode::Standard(), {packed.data(), nullptr, nullptr, &ds}),
            KernelStatus::kInvalidArgument);
  // fp32 output of dequantize and fp32 QDQ inputs are not offered.
  float amax = 1;
  const QuantizedView view{packed.data(), scales.data(), &amax, 1, 16, 32};
  std::vector<float> y32(16 * 32);
  EXPECT_EQ(Dequantize(view, QuantMode::Standard(), ElemType::kF32, y32.data()),
            KernelStatus::kUnsupported);
  const WeightDesc w32 = WeightDesc::Dense(y32.data(), 16, 32, ElemType::kF32);
  const QdqTask task{&w32, nullptr, y32.data()};
  EXPECT_EQ(FakeQuantize(std::span<const QdqTask>(&task, 1), QuantMode::Standard()),
            KernelStatus::kUnsupported);
  EXPECT_STREQ(KernelStatusString(KernelStatus::kWorkspaceTooSmall), "workspace too small");
}

TEST(QuantModeTest, IndexNameRoundTripAndDispatch) {
  for (int i = 0; i < kNumQuantModes; ++i) {
    const QuantMode m = QuantMode::FromIndex(i);
    EXPECT_EQ(m.Index(), i);
    int dispatched = -1;
    EXPECT_EQ(DispatchQuantMode(m,
                                [&]<class T>() {
                                  dispatched = T::Mode().Index();
                                  return KernelStatus::kOk;
                                }),
              KernelStatus::kOk);
    EXPECT_EQ(dispatched, i) << m.Name();
  }
  EXPECT_STREQ(QuantMode::FromIndex(6).Name(), "4over6-mse-e448-fp16");
  EXPECT_EQ(QuantMode::FourOverSixDefault().Index(), 3);  // TE default: MAE, 256, exact
  bool called = false;
  EXPECT_EQ(
      DispatchQuantMode(QuantMode{QuantAlgo::kStandard, ErrMetric::kMAE, 256, ErrKind::kExact},
                        [&]<class T>() {
                          called = true;
                          return KernelStatus::kOk;
                        }),
      KernelStatus::kInvalidArgument);
  EXPECT_FALSE(called);
}

TEST(AmaxTest, ListOfTensorsPairsAndStacksWithNonFiniteCounts) {
  const TestTensor a = MakeRandomTensor(ElemType::kBF16, 33, 64, 1);
  TestTensor b = MakeRandomTensor(ElemType::kF16, 5, 32, 2, 4.0);
  TestTensor c = MakeRandomTensor(ElemType::kF32, 7, 16, 3, 1.0, /*slices=*/3);
  uint16_t* bh = static_cast<uint16_t*>(b.data());
  bh[3] = 0x7E00;   // NaN: skipped by the max, counted
  bh[10] = 0xFC00;  // -inf: amax becomes inf
  float* cf = static_cast<float*>(c.data());
  cf[7 * 16 + 5] = std::numeric_limits<float>::quiet_NaN();  // slice 1
  cf[2 * 7 * 16] = -1000.0f;                                 // slice 2's amax
  float want_a = 0, want_c[3] = {0, 0, 0};
  for (int64_t i = 0; i < a.numel(); ++i) want_a = std::max(want_a, std::fabs(a.at(i)));
  for (int64_t i = 0; i < c.numel(); ++i) {
    if (!std::isnan(c.at(i)))
      want_c[i / (7 * 16)] = std::max(want_c[i / (7 * 16)], std::fabs(c.at(i)));
  }
  const WeightDesc da = a.desc(), db = b.desc(), dc = c.desc();
  const WeightDesc pair[2] = {da, da};
  float amax_a = -1, amax_b = -1, amax_c[3], amax_pair = -1;
  int64_t nf_b = -1, nf_c[3], nf_pair = -1;
  const AmaxTask tasks[4] = {{&da, 1, &amax_a, nullptr},
                             {&db, 1, &amax_b, &nf_b},
                             {&dc, 1, amax_c, nf_c},
                             {pair, 2, &amax_pair, &nf_pair}};
  for (int threads : {1, 2, 0}) {
    ASSERT_EQ(ComputeAmax(tasks, CpuOptions{threads}), KernelStatus::kOk);
    EXPECT_EQ(amax_a, want_a);
    EXPECT_EQ(amax_b, std::numeric_limits<float>::infinity());
    EXPECT_EQ(nf_b, 2);
    for (int s = 0; s < 3; ++s) EXPECT_EQ(amax_c[s], want_c[s]) << s;
    EXPECT_EQ(amax_c[2], 1000.0f);
    EXPECT_EQ(nf_c[0], 0);
    EXPECT_EQ(nf_c[1], 1);
    EXPECT_EQ(nf_c[2], 0);
    EXPECT_EQ(amax_pair, want_a);
    EXPECT_EQ(nf_pair, 0);
  }
  // Members of one task must agree on the slice count.
  const WeightDesc mixed[2] = {da, dc};
  const AmaxTask bad{mixed, 2, amax_c, nullptr};
  std::string error;
  EXPECT_EQ(ComputeAmax(std::span<const AmaxTask>(&bad, 1), {}, &error),
            KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("slices"), std::string::npos) << error;
}

// Large enough to be split into many chunks: results must not depend on the thread count.
TEST(ThreadingTest, ResultsIndependentOfThreadCount) {
  const TestTensor t = MakeRandomTensor(ElemType::kBF16, 300, 2048, 11);
  const WeightDesc w = t.desc();
  for (QuantMode mode : {QuantMode::Standard(), QuantMode::FromIndex(5)}) {
    std::vector<uint8_t> p1(300 * 1024), s1(300 * 128), p2 = p1, s2 = s1;
    std::vector<uint16_t> q1(300 * 2048), q2 = q1;
    float d1 = 0, d2 = 0;
    ASSERT_EQ(Quantize(w, nullptr, mode, {p1.data(), s1.data(), nullptr, &d1}, CpuOptions{1}),
              KernelStatus::kOk);
    ASSERT_EQ(Quantize(w, nullptr, mode, {p2.data(), s2.data(), nullptr, &d2}, CpuOptions{0}),
              KernelStatus::kOk);
    EXPECT_EQ(p1, p2);
    EXPECT_EQ(s1, s2);
    EXPECT_EQ(FloatBits(d1), FloatBits(d2));
    const QdqTask t1{&w, nullptr, q1.data()}, t2{&w, nullptr, q2.data()};
    ASSERT_EQ(FakeQuantize(std::span<const QdqTask>(&t1, 1), mode, CpuOptions{1}),
              KernelStatus::kOk);
    ASSERT_EQ(FakeQuantize(std::span<const QdqTask>(&t2, 1), mode, CpuOptions{3}),
              KernelStatus::kOk);
    EXPECT_EQ(q1, q2);
  }
}

// A list of weights of different shapes and types in one call (chunks of several tasks are
// interleaved across threads) equals quantizing each weight alone.
TEST(ThreadingTest, ListEqualsOneByOne) {
  std::vector<TestTensor> weights;
  for (int i = 0; i < 24; ++i) {
    const ElemType type =
        i % 3 == 0 ? ElemType::kBF16 : (i % 3 == 1 ? ElemType::kF16 : ElemType::kF32);
    weights.push_back(MakeRandomTensor(type, 1 + 37 * (i % 5), 16 * (1 + i % 7) * 8, 100 + i,
                                       0.1 * (1 + i), /*slices=*/1 + i % 2));
  }
  const QuantMode mode = QuantMode::FromIndex(7);
  std::vector<WeightDesc> descs;
  for (const TestTensor& t : weights) descs.push_back(t.desc());
  struct Out {
    std::vector<uint8_t> packed, scales;
    std::vector<float> ds;
  };
  auto make_out = [](const TestTensor& t) {
    return Out{std::vector<uint8_t>(static_cast<size_t>(t.numel() / 2)),
               std::vector<uint8_t>(static_cast<size_t>(t.numel() / 16)),
               std::vector<float>(static_cast<size_t>(t.slices))};
  };
  std::vector<Out> together, alone;
  std::vector<QuantizeTask> tasks;
  for (size_t i = 0; i < weights.size(); ++i) {
    together.push_back(make_out(weights[i]));
    alone.push_back(make_out(weights[i]));
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    tasks.push_back(
        {&descs[i],
         nullptr,
         {together[i].packed.data(), together[i].scales.data(), nullptr, together[i].ds.data()}});
  }
  ASSERT_EQ(Quantize(tasks, mode, CpuOptions{0}), KernelStatus::kOk);
  for (size_t i = 0; i < weights.size(); ++i) {
    ASSERT_EQ(
        Quantize(descs[i], nullptr, mode,
                 {alone[i].packed.data(), alone[i].scales.data(), nullptr, alone[i].ds.data()}),
        KernelStatus::kOk);
    EXPECT_EQ(together[i].packed, alone[i].packed) << i;
    EXPECT_EQ(together[i].scales, alone[i].scales) << i;
    EXPECT_EQ(together[i].ds, alone[i].ds) << i;
  }
}

TEST(InputTypeTest, Fp32InputOfBf16ValuesGivesBf16Bytes) {
  const TestTensor t = MakeTestTensor(DataFamily::kRandom, ElemType::kBF16, 31, 128, 4);
  std::vector<float> wide(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) wide[static_cast<size_t>(i)] = t.at(i);
  const WeightDesc w32 = WeightDesc::Dense(wide.data(), 31, 128, ElemType::kF32);
  for (int m = 0; m < kNumQuantModes; ++m) {
    const QuantMode mode = QuantMode::FromIndex(m);
    std::vector<uint8_t> p16(31 * 64), s16(31 * 8), p32 = p16, s32 = s16;
    float d16 = 0, d32 = 0;
    ASSERT_EQ(Quantize(t.desc(), nullptr, mode, {p16.data(), s16.data(), nullptr, &d16}),
              KernelStatus::kOk);
    ASSERT_EQ(Quantize(w32, nullptr, mode, {p32.data(), s32.data(), nullptr, &d32}),
              KernelStatus::kOk);
    EXPECT_EQ(p16, p32) << mode.Name();
    EXPECT_EQ(s16, s32) << mode.Name();
    EXPECT_EQ(d16, d32);
  }
}

TEST(SwizzleTest, LayoutMatchesSpecFormulaWithZeroPadding) {
  const int64_t rows = 130, kv = 5;  // pads to 256 x 8
  EXPECT_EQ(SwizzledScaleSize(rows, kv), 256 * 8);
  std::vector<uint8_t> linear(static_cast<size_t>(rows * kv));
  for (size_t i = 0; i < linear.size(); ++i) linear[i] = static_cast<uint8_t>(1 + i % 251);
  std::vector<uint8_t> sw(static_cast<size_t>(SwizzledScaleSize(rows, kv)), 0xEE);
  SwizzleScales(linear.data(), rows, kv, sw.data());
  std::vector<int> hits(sw.size(), 0);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < kv; ++k) {
      // ((m/128)*ceil(Kv/4) + k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + (k%4), ceil(5/4) = 2.
      const int64_t idx =
          ((m / 128) * 2 + k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4);
      EXPECT_EQ(sw[static_cast<size_t>(idx)], linear[static_cast<size_t>(m * kv + k)]);
      ++hits[static_cast<size_t>(idx)];
    }
  }
  for (size_t i = 0; i < sw.size(); ++i) {
    if (hits[i] == 0) {
      EXPECT_EQ(sw[i], 0) << i;  // padding is zero
    }
    EXPECT_LE(hits[i], 1) << i;  // the map is injective
  }
}

TEST(TestDataTest, FamiliesAreDeterministicAndAsSpecified) {
  const TestTensor r1 = MakeTestTensor(DataFamily::kRandom, ElemType::kF16, 3, 48, 9);
  const TestTensor r2 = MakeTestTensor(DataFamily::kRandom, ElemType::kF16, 3, 48, 9);
  EXPECT_EQ(r1.bytes, r2.bytes);
  for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(r1.at(i), 0.0f);  // first row zeroed
  EXPECT_NE(r1.at(48), 0.0f);
  const TestTensor z = MakeTestTensor(DataFamily::kZeros, ElemType::kBF16, 1, 16);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(std::signbit(z.at(i)), i % 2 == 1);
  const TestTensor mx = MakeTestTensor(DataFamily::kMaxes, ElemType::kF16, 1, 16);
  EXPECT_EQ(mx.at(0), 65504.0f);
  EXPECT_EQ(mx.at(1), -65504.0f);
  const TestTensor bd = MakeTestTensor(DataFamily::kBoundary, ElemType::kF32, 1, 64);
  EXPECT_EQ(bd.at(0), static_cast<float>(-12.0 - 1e-3));
  EXPECT_EQ(bd.at(1), static_cast<float>(-12.0 + 1e-3));
  EXPECT_EQ(bd.at(63), static_cast<float>(12.0 + 1e-3));
  EXPECT_EQ(testing::kSpecShapes.size(), 12u);
}

}  // namespace
}  // namespace wpub::kernels
