// The global-scale contract (spec "Global-scale contract test"): E in {256, 448} x shapes
// (), (1,), (8,), (2,4) x amax {0, 1, 3.5, tiny, max, +inf, -inf, NaN}: exact bits (NaN == NaN)
// and the input's shape preserved.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/reference.h"

namespace wpub::kernels {
namespace {

const std::vector<float> kAmax = {0.0f,
                                  1.0f,
                                  3.5f,
                                  std::numeric_limits<float>::min(),  // finfo.tiny
                                  std::numeric_limits<float>::max(),
                                  INFINITY,
                                  -INFINITY,
                                  std::numeric_limits<float>::quiet_NaN()};

// Expected bits, frozen from numpy float32 arithmetic of the seed's formula:
//   enc = where(min(6E/amax, FLT_MAX) == 0, 1, min(6E/amax, FLT_MAX)), dec = 1/enc.
// 6E/0 = inf -> FLT_MAX; 6E/tiny overflows -> FLT_MAX; 6E/+-inf = +-0 -> 1; NaN propagates.
// 1/FLT_MAX = 0x00200000 is subnormal and must survive.
struct Expected {
  uint32_t enc;
  uint32_t dec;
};
const Expected kExpected448[8] = {{0x7F7FFFFF, 0x00200000}, {0x45280000, 0x39C30C31},
                                  {0x44400000, 0x3AAAAAAB}, {0x7F7FFFFF, 0x00200000},
                                  {0x05280001, 0x79C30C30}, {0x3F800000, 0x3F800000},
                                  {0x3F800000, 0x3F800000}, {0x7FC00000, 0x7FC00000}};
const Expected kExpected256[8] = {{0x7F7FFFFF, 0x00200000}, {0x44C00000, 0x3A2AAAAB},
                                  {0x43DB6DB7, 0x3B155555}, {0x7F7FFFFF, 0x00200000},
                                  {0x04C00001, 0x7A2AAAAA}, {0x3F800000, 0x3F800000},
                                  {0x3F800000, 0x3F800000}, {0x7FC00000, 0x7FC00000}};

// The seed's formula written out with plain float operations and torch.min's NaN propagation.
float FormulaEncode(float amax, int e) {
  const float numerator = static_cast<float>(e) * 6.0f;
  float s = numerator / amax;
  if (!std::isnan(s)) s = s < FLT_MAX ? s : FLT_MAX;
  return s == 0.0f ? 1.0f : s;
}

bool SameBits(float got, uint32_t want) {
  if (std::isnan(got)) return ((want & 0x7FFFFFFFu) > 0x7F800000u);  // NaN == NaN
  return FloatBits(got) == want;
}

class GlobalScaleContractTest
    : public ::testing::TestWithParam<std::tuple<int, std::vector<int64_t>>> {};

TEST_P(GlobalScaleContractTest, ExactBitsAndShapePreserved) {
  const int e = std::get<0>(GetParam());
  const std::vector<int64_t>& shape = std::get<1>(GetParam());
  const Expected* expected = e == 448 ? kExpected448 : kExpected256;
  size_t case_size = 1;
  for (int64_t d : shape) case_size *= static_cast<size_t>(d);
  ASSERT_EQ(kAmax.size() % case_size, 0u);
  for (size_t start = 0; start < kAmax.size(); start += case_size) {
    F32Array amax{shape,
                  std::vector<float>(kAmax.begin() + static_cast<ptrdiff_t>(start),
                                     kAmax.begin() + static_cast<ptrdiff_t>(start + case_size))};
    F32Array enc, dec;
    ASSERT_EQ(GlobalEncodeScales(amax, e, &enc), KernelStatus::kOk);
    ASSERT_EQ(GlobalDecodeScales(amax, e, &dec), KernelStatus::kOk);
    EXPECT_EQ(enc.shape, shape);  // (1,) stays (1,), () stays ()
    EXPECT_EQ(dec.shape, shape);
    ASSERT_EQ(enc.values.size(), case_size);
    ASSERT_EQ(dec.values.size(), case_size);
    for (size_t i = 0; i < case_size; ++i) {
      const size_t k = start + i;
      EXPECT_TRUE(SameBits(enc.values[i], expected[k].enc))
          << "E=" << e << " amax=" << kAmax[k] << " enc bits " << std::hex
          << FloatBits(enc.values[i]);
      EXPECT_TRUE(SameBits(dec.values[i], expected[k].dec))
          << "E=" << e << " amax=" << kAmax[k] << " dec bits " << std::hex
          << FloatBits(dec.values[i]);
      EXPECT_TRUE(SameBits(enc.values[i], FloatBits(FormulaEncode(kAmax[k], e))));
      // The scalar functions the kernels use agree with the array form.
      EXPECT_TRUE(SameBits(GlobalEncodeScale(kAmax[k], static_cast<float>(e)), expected[k].enc));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Contract, GlobalScaleContractTest,
    ::testing::Combine(::testing::Values(256, 448),
                       ::testing::Values(std::vector<int64_t>{}, std::vector<int64_t>{1},
                                         std::vector<int64_t>{8}, std::vector<int64_t>{2, 4})));

TEST(GlobalScaleTest, RejectsBadInput) {
  F32Array amax{{2}, {1.0f, 2.0f}}, out;
  std::string error;
  EXPECT_EQ(GlobalEncodeScales(amax, 300, &out, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("300"), std::string::npos) << error;
  amax.shape = {3};
  EXPECT_EQ(GlobalDecodeScales(amax, 448, &out, &error), KernelStatus::kInvalidArgument);
  EXPECT_NE(error.find("shape"), std::string::npos) << error;
}

TEST(GlobalScaleTest, DecodeScaleIsReciprocalNotAmaxOver2688) {
  // amax = 5: 2688/5 = 537.6 -> 0x44066666; 1/that = 0x3AF3CF3E, whereas 5/2688 rounds to
  // 0x3AF3CF3D. The published weight_scale_2 is the reciprocal.
  const TensorScales t5 = MakeTensorScales(5.0f, 448.0f);
  EXPECT_EQ(FloatBits(t5.s_dec), 0x3AF3CF3Eu);
  EXPECT_NE(FloatBits(t5.s_dec), FloatBits(5.0f / 2688.0f));
  EXPECT_EQ(FloatBits(t5.amax), FloatBits(5.0f));
}

}  // namespace
}  // namespace wpub::kernels
