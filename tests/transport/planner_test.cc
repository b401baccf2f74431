// Bucket planner: flattened-bucket alignment invariant, bucket sizing with oversize units, and
// a randomized property test of CheckLayout's invariants.
#include "core/transport/planner.h"

#include <gtest/gtest.h>

#include <random>

namespace wpub::transport {
namespace {

TensorDesc T(std::string name, DType dtype, Shape shape) {
  return TensorDesc{std::move(name), dtype, std::move(shape)};
}

TEST(PlannerTest, OrdersByElementSizeSoEveryOffsetIsAligned) {
  // uint8 first in publication order, then bf16 with an odd element count, then fp32.
  std::vector<TensorDesc> outs = {T("a.weight", DType::kUInt8, {3, 5}),
                                  T("b", DType::kBFloat16, {7}),
                                  T("c.weight_scale_2", DType::kFloat32, {}),
                                  T("d", DType::kFloat8E4M3, {3}), T("e", DType::kInt64, {2})};
  std::vector<uint32_t> units(outs.size(), 1);
  auto buckets = PlanBuckets(outs, units, 1 << 20);
  ASSERT_TRUE(buckets.ok()) << buckets.status();
  ASSERT_EQ(buckets->size(), 1u);
  const BucketLayout& b = (*buckets)[0];
  ASSERT_EQ(b.tensors.size(), 5u);
  EXPECT_EQ(outs[b.tensors[0].output].name, "e");  // 8-byte
  EXPECT_EQ(outs[b.tensors[1].output].name, "c.weight_scale_2");
  EXPECT_EQ(outs[b.tensors[2].output].name, "b");
  EXPECT_EQ(outs[b.tensors[3].output].name, "a.weight");  // stable among 1-byte dtypes
  EXPECT_EQ(outs[b.tensors[4].output].name, "d");
  EXPECT_EQ(b.tensors[1].offset, 16u);
  EXPECT_EQ(b.tensors[2].offset, 20u);
  EXPECT_EQ(b.tensors[3].offset, 34u);
  EXPECT_EQ(b.nbytes, 16u + 4 + 14 + 15 + 3);
  EXPECT_TRUE(CheckLayout(*buckets, outs, units, 1 << 20).ok());
  BucketManifest m = MakeBucketManifest(b, outs);
  EXPECT_EQ(m.tensors[2].name, "b");
  EXPECT_EQ(m.tensors[2].offset, 20u);
  EXPECT_EQ(m.tensors[2].nbytes, 14u);
  EXPECT_EQ(m.nbytes, b.nbytes);
}

TEST(PlannerTest, SplitsAtBucketSizeAndGivesOversizeUnitsTheirOwnBucket) {
  std::vector<TensorDesc> outs = {
      T("small0", DType::kBFloat16, {100}),  // 200 B
      T("small1", DType::kBFloat16, {100}),  // 200 B
      T("huge", DType::kFloat32, {1000}),    // 4000 B > 1000
      T("small2", DType::kBFloat16, {200}),  // 400 B
      T("small3", DType::kBFloat16, {200}),  // 400 B
      T("small4", DType::kBFloat16, {200}),  // 400 B -> exceeds 1000 with the two before
  };
  std::vector<uint32_t> units(outs.size(), 1);
  auto buckets = PlanBuckets(outs, units, 1000);
  ASSERT_TRUE(buckets.ok());
  ASSERT_EQ(buckets->size(), 4u);
  EXPECT_EQ((*buckets)[0].nbytes, 400u);
  EXPECT_EQ((*buckets)[1].nbytes, 4000u);
  ASSERT_EQ((*buckets)[1].tensors.size(), 1u);
  EXPECT_EQ(outs[(*buckets)[1].tensors[0].output].name, "huge");
  EXPECT_EQ((*buckets)[2].nbytes, 800u);
  EXPECT_EQ((*buckets)[3].nbytes, 400u);
  EXPECT_TRUE(CheckLayout(*buckets, outs, units, 1000).ok());
}

TEST(PlannerTest, KeepsAQuantizedTensorsThreeOutputsTogether) {
  std::vector<TensorDesc> outs = {T("x", DType::kBFloat16, {300}),  // 600 B
                                  T("q.weight", DType::kUInt8, {16, 8}),
                                  T("q.weight_scale", DType::kFloat8E4M3, {16, 1}),
                                  T("q.weight_scale_2", DType::kFloat32, {})};
  std::vector<uint32_t> units = {1, 3};
  auto buckets = PlanBuckets(outs, units, 700);
  ASSERT_TRUE(buckets.ok());
  ASSERT_EQ(buckets->size(), 2u);
  EXPECT_EQ((*buckets)[1].tensors.size(), 3u);
  EXPECT_EQ(outs[(*buckets)[1].tensors[0].output].name, "q.weight_scale_2");
}

TEST(PlannerTest, RejectsBadArguments) {
  std::vector<TensorDesc> outs = {T("x", DType::kBFloat16, {3})};
  EXPECT_FALSE(PlanBuckets(outs, std::vector<uint32_t>{1}, 0).ok());
  EXPECT_FALSE(PlanBuckets(outs, std::vector<uint32_t>{2}, 10).ok());
  EXPECT_FALSE(PlanBuckets(outs, std::vector<uint32_t>{0, 1}, 10).ok());
}

TEST(PlannerTest, CheckLayoutCatchesAMisalignedOffset) {
  std::vector<TensorDesc> outs = {T("u8", DType::kUInt8, {3}), T("f32", DType::kFloat32, {1})};
  std::vector<uint32_t> units = {1, 1};
  std::vector<BucketLayout> bad(1);
  bad[0].nbytes = 7;
  bad[0].tensors = {PlacedTensor{0, 0, 3}, PlacedTensor{1, 3, 4}};
  absl::Status s = CheckLayout(bad, outs, units, 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("f32"), std::string::npos) << s;
}

TEST(PlannerTest, RandomizedLayoutsSatisfyTheInvariants) {
  std::mt19937_64 rng(20261130);
  const DType dtypes[] = {DType::kBFloat16,   DType::kFloat16, DType::kFloat32, DType::kUInt8,
                          DType::kFloat8E4M3, DType::kInt64,   DType::kBool,    DType::kInt32};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<TensorDesc> outs;
    std::vector<uint32_t> units;
    const int n_units = 1 + static_cast<int>(rng() % 40);
    for (int u = 0; u < n_units; ++u) {
      const uint32_t size = rng() % 4 == 0 ? 3 : 1;
      for (uint32_t k = 0; k < size; ++k) {
        Shape shape;
        const int rank = static_cast<int>(rng() % 4);
        for (int d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(rng() % 37));
        outs.push_back(T("t" + std::to_string(outs.size()), dtypes[rng() % 8], shape));
      }
      units.push_back(size);
    }
    const uint64_t cap = 1 + rng() % 3000;
    auto buckets = PlanBuckets(outs, units, cap);
    ASSERT_TRUE(buckets.ok()) << buckets.status();
    ASSERT_TRUE(CheckLayout(*buckets, outs, units, cap).ok())
        << CheckLayout(*buckets, outs, units, cap);
    uint64_t total = 0, expected = 0;
    for (const auto& b : *buckets) {
      total += b.nbytes;
      for (const auto& t : b.tensors) {
        EXPECT_EQ(t.offset % DTypeSize(outs[t.output].dtype), 0u);
      }
    }
    for (const auto& d : outs) expected += d.nbytes();
    EXPECT_EQ(total, expected);
    // Greedy: two consecutive buckets could not have been merged.
    for (size_t b = 1; b < buckets->size(); ++b) {
      if ((*buckets)[b - 1].nbytes < cap) {
        EXPECT_GT((*buckets)[b - 1].nbytes + (*buckets)[b].nbytes, cap);
      }
    }
  }
}

}  // namespace
}  // namespace wpub::transport
