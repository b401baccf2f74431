// Bucket patches (core/delta/bucket_patch.h): the reconstruction is the target byte for byte for
// random and adversarial change patterns (none, every word, one byte, the last partial word,
// adjacent and separated runs, runs across the comparison's slices), the full-bucket rule, a
// lost or different base, and malformed or corrupted patches -- never a wrong bucket.
#include "core/delta/bucket_patch.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/transport/checksum.h"

namespace wpub::delta {
namespace {

std::vector<uint8_t> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

uint64_t Sum(const std::vector<uint8_t>& v) { return transport::Checksum(v.data(), v.size()); }

// The patch from base to next applied to base gives next exactly.
BucketPatchPlan RoundTrip(const std::vector<uint8_t>& base, const std::vector<uint8_t>& next,
                          BucketPatchOptions options = {}) {
  BucketPatchPlan plan = DiffBucket(base, Sum(base), next, Sum(next), options);
  if (plan.full) return plan;
  EXPECT_EQ(PatchTargetChecksum(plan.patch), Sum(next));
  absl::StatusOr<std::vector<uint8_t>> got = ApplyBucketPatch(plan.patch, base);
  EXPECT_TRUE(got.ok()) << got.status();
  if (got.ok()) {
    EXPECT_EQ(*got, next);
  }
  return plan;
}

// Applied on several threads (the checksums summed in 16 MiB slices, the base copied in
// slices) over a bucket of several slices with a partial last word: the same bucket, and the
// checksum it reports is the whole result's.
TEST(BucketPatch, AppliedOnThreadsGivesTheSameBucketAndItsChecksum) {
  const std::vector<uint8_t> base = Random((uint64_t{40} << 20) + 5, 11);
  std::vector<uint8_t> next = base;
  for (uint64_t at : {uint64_t{0}, uint64_t{17} << 20, (uint64_t{16} << 20) - 3, next.size() - 1}) {
    next[at] ^= 0x41;
  }
  const BucketPatchPlan plan = DiffBucket(base, Sum(base), next, Sum(next));
  ASSERT_FALSE(plan.full) << plan.why;
  for (int threads : {1, 4, 0}) {
    uint64_t checksum = 0;
    auto got = ApplyBucketPatch(plan.patch, base, {.threads = threads, .checksum = &checksum});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, next) << threads << " threads";
    EXPECT_EQ(checksum, Sum(next)) << threads << " threads";
  }
  std::vector<uint8_t> other = base;
  other[(uint64_t{33} << 20) + 1] ^= 1;  // not the base, in a slice of its own
  EXPECT_EQ(ApplyBucketPatch(plan.patch, other, {.threads = 4}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(BucketPatch, NoChangeIsAnEmptyPatch) {
  const std::vector<uint8_t> base = Random(1000, 1);
  const BucketPatchPlan plan = RoundTrip(base, base);
  ASSERT_FALSE(plan.full) << plan.why;
  EXPECT_EQ(plan.changed_words, 0u);
  EXPECT_EQ(plan.runs, 0u);
  EXPECT_EQ(plan.patch.size(), kBucketPatchHeaderBytes);
}

TEST(BucketPatch, OneByteAnywhereIncludingTheLastPartialWord) {
  for (size_t n : {8u, 9u, 15u, 1000u, 1003u}) {
    const std::vector<uint8_t> base = Random(n, 2);
    for (size_t at : {size_t{0}, n / 2, n - 1}) {
      std::vector<uint8_t> next = base;
      next[at] ^= 0x5a;
      const BucketPatchPlan plan = RoundTrip(base, next, {.max_patch_fraction = 10});
      ASSERT_FALSE(plan.full) << plan.why;
      EXPECT_EQ(plan.changed_words, 1u) << n << " " << at;
      EXPECT_EQ(plan.runs, 1u);
    }
  }
}

TEST(BucketPatch, RunsAdjacentSeparatedAndAcrossSlicesAreExact) {
  // More than two of the comparison's slices of 2^20 words, on 4 threads.
  const size_t n = (size_t{5} << 22) + 5;
  const std::vector<uint8_t> base = Random(n, 3);
  std::vector<uint8_t> next = base;
  std::mt19937 rng(4);
  for (int i = 0; i < 2000; ++i) next[rng() % n] ^= 1 + rng() % 255;
  // A run that spans the first slice boundary (word 2^20 = byte 8 MiB), and two words apart.
  for (size_t b = (size_t{1} << 23) - 40; b < (size_t{1} << 23) + 40; ++b) next[b] ^= 0xff;
  next[1000 * 8] ^= 1;
  next[1002 * 8] ^= 1;
  const BucketPatchPlan one = RoundTrip(base, next, {.threads = 1});
  const BucketPatchPlan four = RoundTrip(base, next, {.threads = 4});
  ASSERT_FALSE(one.full) << one.why;
  EXPECT_EQ(one.patch, four.patch);  // the patch does not depend on the threads
  EXPECT_LT(one.patch.size(), n / 100);
}

TEST(BucketPatch, EveryWordChangedOrAnotherSizeGoesWhole) {
  const std::vector<uint8_t> base = Random(4096, 5);
  std::vector<uint8_t> next = base;
  for (size_t i = 0; i < next.size(); i += 8) next[i] ^= 1;
  BucketPatchPlan plan = RoundTrip(base, next);
  EXPECT_TRUE(plan.full);
  EXPECT_NE(plan.why.find("over 0.5 of the bucket"), std::string::npos) << plan.why;
  // Allowed any size, every word changed is still exact.
  plan = RoundTrip(base, next, {.max_patch_fraction = 10});
  ASSERT_FALSE(plan.full);
  EXPECT_EQ(plan.changed_words, 512u);
  EXPECT_EQ(plan.runs, 1u);
  plan = DiffBucket(base, Sum(base), Random(4097, 6), 0);
  EXPECT_TRUE(plan.full);
  EXPECT_NE(plan.why.find("4097 bytes, its base 4096"), std::string::npos) << plan.why;
}

TEST(BucketPatch, ALostOrDifferentBaseIsRefusedAndNeverPatched) {
  const std::vector<uint8_t> base = Random(512, 7);
  std::vector<uint8_t> next = base;
  next[100] ^= 3;
  const BucketPatchPlan plan = DiffBucket(base, Sum(base), next, Sum(next));
  ASSERT_FALSE(plan.full);
  std::vector<uint8_t> other = base;
  other[400] ^= 1;  // the receiver holds something else
  EXPECT_EQ(ApplyBucketPatch(plan.patch, other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ApplyBucketPatch(plan.patch, Random(511, 7)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(BucketPatch, MalformedOrCorruptedPatchesAreRefused) {
  const std::vector<uint8_t> base = Random(4096, 8);
  std::vector<uint8_t> next = base;
  for (size_t at : {10u, 11u, 800u, 3000u}) next[at] ^= 0x11;
  const std::vector<uint8_t> good = DiffBucket(base, Sum(base), next, Sum(next)).patch;
  ASSERT_EQ(*ApplyBucketPatch(good, base), next);
  auto code = [&](std::vector<uint8_t> patch) {
    return ApplyBucketPatch(patch, base).status().code();
  };
  EXPECT_EQ(code({}), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> p = good;
  p[0] = 'X';
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // magic
  p = good;
  p[4] = 2;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // format
  p = good;
  p.pop_back();
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // truncated run
  p = good;
  p.push_back(0);
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // trailing bytes
  p = good;
  const uint32_t far = 1u << 30;
  std::memcpy(p.data() + kBucketPatchHeaderBytes, &far, 4);
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // run out of range
  p = good;
  p.back() ^= 0x80;  // a run's byte
  EXPECT_EQ(code(p), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace wpub::delta
