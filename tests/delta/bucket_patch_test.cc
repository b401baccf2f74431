// Bucket patches (core/delta/bucket_patch.h), in both formats: the reconstruction is the target
// byte for byte for random and adversarial change patterns (none, every word, one byte, the
// last partial word and lone last byte, adjacent and separated runs, runs across the
// comparison's and the application's slices), the full-bucket rule, a lost or different base
// (read or known), and malformed or corrupted patches -- never a wrong bucket; the GPU diff's
// path (xor runs turned into units) gives DiffBucket's format 2 patch byte for byte.
#include "core/delta/bucket_patch.h"

#include <gtest/gtest.h>

#include <algorithm>
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

constexpr BucketPatchOptions kRuns{.format = PatchFormat::kWordRuns};

TEST(BucketPatch, NoChangeIsAnEmptyPatch) {
  const std::vector<uint8_t> base = Random(1000, 1);
  BucketPatchPlan plan = RoundTrip(base, base, kRuns);
  ASSERT_FALSE(plan.full) << plan.why;
  EXPECT_EQ(plan.changed_words, 0u);
  EXPECT_EQ(plan.runs, 0u);
  EXPECT_EQ(plan.patch.size(), kBucketPatchHeaderBytes);
  plan = RoundTrip(base, base);
  ASSERT_FALSE(plan.full) << plan.why;
  EXPECT_EQ(plan.changed_units, 0u);
  EXPECT_EQ(plan.patch.size(), kBucketPatchHeaderBytes);
}

TEST(BucketPatch, OneByteAnywhereIncludingTheLastPartialWord) {
  for (size_t n : {1u, 2u, 3u, 8u, 9u, 15u, 1000u, 1003u}) {
    const std::vector<uint8_t> base = Random(n, 2);
    for (size_t at : {size_t{0}, n / 2, n - 1}) {
      std::vector<uint8_t> next = base;
      next[at] ^= 0x5a;
      BucketPatchPlan plan =
          RoundTrip(base, next, {.max_patch_fraction = 100, .format = PatchFormat::kWordRuns});
      ASSERT_FALSE(plan.full) << plan.why;
      EXPECT_EQ(plan.changed_words, 1u) << n << " " << at;
      EXPECT_EQ(plan.runs, 1u);
      plan =
          RoundTrip(base, next, {.max_patch_fraction = 100, .format = PatchFormat::kIndexedUnits});
      ASSERT_FALSE(plan.full) << plan.why;
      EXPECT_EQ(plan.changed_units, 1u);
      EXPECT_EQ(plan.patch.size(), kBucketPatchHeaderBytes + 6);  // an index and a XOR
      plan = RoundTrip(base, next, {.max_patch_fraction = 100});
      ASSERT_FALSE(plan.full) << plan.why;
      EXPECT_EQ(plan.changed_units, 1u) << n << " " << at;
      // The gap's varint (unit at / 2) and the XOR's (0x5a or 0x5a00: one or three bytes).
      const size_t gap = at / 2 < 0x80 ? 1 : 2;
      const size_t x = at % 2 == 0 ? 1 : 3;
      EXPECT_EQ(plan.patch.size(), kBucketPatchHeaderBytes + gap + x) << n << " " << at;
    }
  }
}

// What format 2 is for: isolated small changes (a bf16 element moved by an ulp, one NVFP4 code)
// cost a few bytes each where a word run costs 16.
TEST(BucketPatch, UnitsCarryIsolatedChangesInAFewBytesEach) {
  const size_t n = size_t{1} << 20;
  const std::vector<uint8_t> base = Random(n, 21);
  std::vector<uint8_t> next = base;
  std::mt19937 rng(22);
  size_t changed = 0;
  for (size_t u = 0; u < n / 2; u += 40 + rng() % 40) {  // every ~60 units, +-1 on the unit
    uint16_t v;
    std::memcpy(&v, next.data() + 2 * u, 2);
    v = static_cast<uint16_t>(v + ((rng() & 1) ? 1 : -1));
    std::memcpy(next.data() + 2 * u, &v, 2);
    ++changed;
  }
  const BucketPatchPlan units = RoundTrip(base, next);
  const BucketPatchPlan runs = RoundTrip(base, next, kRuns);
  ASSERT_FALSE(units.full) << units.why;
  ASSERT_FALSE(runs.full) << runs.why;
  EXPECT_EQ(units.changed_units, changed);
  EXPECT_EQ(runs.patch.size(), kBucketPatchHeaderBytes + 16 * changed);
  // One gap byte and, for most +-1 XORs (1, 3, 7, ...), one XOR byte.
  EXPECT_LT(units.patch.size(), kBucketPatchHeaderBytes + 2.2 * changed);
  EXPECT_LT(units.patch.size() * 7, runs.patch.size());
}

// The GPU diff's path: format 1 with xor runs (what kernels/cuda/bucket_diff.h writes), turned
// into units on the host, is DiffBucket's format 2 patch byte for byte -- and the capacity the
// GPU diff gets always holds the xor runs of a patch that fits.
TEST(BucketPatch, XorRunsTurnedIntoUnitsAreDiffBucketsPatch) {
  std::mt19937 rng(31);
  for (int trial = 0; trial < 60; ++trial) {
    const size_t n = 1 + rng() % 5000;
    const std::vector<uint8_t> base = Random(n, 100 + trial);
    std::vector<uint8_t> next = base;
    const int density = trial % 6;  // none .. every byte
    for (size_t i = 0; i < n; ++i) {
      if (density == 5 || (density > 0 && rng() % (1u << (10 - 2 * density)) == 0)) {
        next[i] ^= static_cast<uint8_t>(1 + rng() % 255);
      }
    }
    if (trial % 7 == 0) next[n - 1] ^= 0x80;  // the last (maybe lone) byte
    for (double fraction : {0.01, 0.1, 0.5, 1.0}) {
      const BucketPatchPlan want =
          DiffBucket(base, Sum(base), next, Sum(next), {.max_patch_fraction = fraction});
      const BucketPatchPlan xor_runs = DiffBucket(
          base, Sum(base), next, Sum(next),
          {.max_patch_fraction = 100, .format = PatchFormat::kWordRuns, .xor_runs = true});
      ASSERT_FALSE(xor_runs.full);
      absl::StatusOr<BucketPatchPlan> got = UnitsFromXorRuns(xor_runs.patch, fraction);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->full, want.full) << trial << " " << fraction << ": " << want.why;
      if (!want.full) {
        EXPECT_EQ(got->patch, want.patch) << trial << " " << fraction;
        EXPECT_EQ(got->changed_units, want.changed_units);
        // The capacity bound: xor runs never exceed it when the units patch fits.
        EXPECT_LE(xor_runs.patch.size(), XorRunsCapacity(n, want.patch.size()))
            << trial << " " << fraction;
      }
    }
    // Xor runs are not a patch a receiver applies.
    const BucketPatchPlan xor_runs =
        DiffBucket(base, Sum(base), next, Sum(next),
                   {.max_patch_fraction = 100, .format = PatchFormat::kWordRuns, .xor_runs = true});
    EXPECT_EQ(ApplyBucketPatch(xor_runs.patch, base).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// Over several slices (of runs and of words), on threads: the same patch, DiffBucket's; a xor
// run holding a word that does not differ is refused.
TEST(BucketPatch, XorRunsTurnedIntoUnitsOnThreadsOverManySlices) {
  const size_t n = (size_t{5} << 20) + 3;
  const std::vector<uint8_t> base = Random(n, 61);
  std::vector<uint8_t> next = base;
  std::mt19937 rng(62);
  for (int i = 0; i < 20000; ++i) next[rng() % n] ^= static_cast<uint8_t>(1 + rng() % 255);
  for (size_t b = (size_t{2} << 20) - 100; b < (size_t{2} << 20) + 100; ++b) next[b] ^= 0x24;
  const BucketPatchPlan want = DiffBucket(base, Sum(base), next, Sum(next), {.threads = 4});
  ASSERT_FALSE(want.full);
  EXPECT_EQ(want.patch, DiffBucket(base, Sum(base), next, Sum(next)).patch);
  BucketPatchPlan xor_runs =
      DiffBucket(base, Sum(base), next, Sum(next),
                 {.max_patch_fraction = 100, .format = PatchFormat::kWordRuns, .xor_runs = true});
  for (int threads : {1, 3, 0}) {
    absl::StatusOr<BucketPatchPlan> got = UnitsFromXorRuns(xor_runs.patch, 0.5, threads);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_FALSE(got->full);
    EXPECT_EQ(got->patch, want.patch) << threads << " threads";
  }
  // The first run's first word XORed to zero: malformed.
  std::memset(xor_runs.patch.data() + kBucketPatchHeaderBytes + 8, 0, 8);
  EXPECT_EQ(UnitsFromXorRuns(xor_runs.patch, 0.5, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  xor_runs.patch[36] = 0;  // no flag: not xor runs
  EXPECT_EQ(UnitsFromXorRuns(xor_runs.patch, 0.5).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BucketPatch, XorRunsCapacityCoversTheWorstCase) {
  // Every other word changed, each its own run: the largest format 1 patch of n bytes.
  for (size_t n : {1u, 7u, 8u, 17u, 4096u, 4099u}) {
    const std::vector<uint8_t> base = Random(n, 41);
    std::vector<uint8_t> next = base;
    for (size_t w = 0; w * 8 < n; w += 2) next[w * 8] ^= 1;
    const BucketPatchPlan runs =
        DiffBucket(base, Sum(base), next, Sum(next),
                   {.max_patch_fraction = 100, .format = PatchFormat::kWordRuns});
    ASSERT_FALSE(runs.full);
    EXPECT_LE(runs.patch.size(), XorRunsCapacity(n, UINT64_MAX)) << n;
    EXPECT_LE(runs.patch.size(), n + 64) << n;
  }
  EXPECT_EQ(XorRunsCapacity(1000, 10), kBucketPatchHeaderBytes);
  EXPECT_EQ(XorRunsCapacity(1000, 58), kBucketPatchHeaderBytes + 80);
  EXPECT_EQ(XorRunsCapacity(1000, 500), 1064u);
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
  for (PatchFormat format :
       {PatchFormat::kWordRuns, PatchFormat::kUnits, PatchFormat::kIndexedUnits}) {
    const BucketPatchPlan one = RoundTrip(base, next, {.threads = 1, .format = format});
    const BucketPatchPlan four = RoundTrip(base, next, {.threads = 4, .format = format});
    ASSERT_FALSE(one.full) << one.why;
    EXPECT_EQ(one.patch, four.patch);  // the patch does not depend on the threads
    EXPECT_LT(one.patch.size(), n / 100);
  }
}

TEST(BucketPatch, EveryWordChangedOrAnotherSizeGoesWhole) {
  const std::vector<uint8_t> base = Random(4096, 5);
  std::vector<uint8_t> next = base;
  for (size_t i = 0; i < next.size(); i += 8) next[i] ^= 1;
  BucketPatchPlan plan = RoundTrip(base, next, kRuns);
  EXPECT_TRUE(plan.full);
  EXPECT_NE(plan.why.find("over 0.5 of the bucket"), std::string::npos) << plan.why;
  // Allowed any size, every word changed is still exact.
  plan = RoundTrip(base, next, {.max_patch_fraction = 10, .format = PatchFormat::kWordRuns});
  ASSERT_FALSE(plan.full);
  EXPECT_EQ(plan.changed_words, 512u);
  EXPECT_EQ(plan.runs, 1u);
  // Every byte changed: units cost more than the bucket.
  for (uint8_t& b : next) b ^= 0x81;
  plan = RoundTrip(base, next);
  EXPECT_TRUE(plan.full);
  EXPECT_NE(plan.why.find("over 0.5 of the bucket"), std::string::npos) << plan.why;
  plan = RoundTrip(base, next, {.max_patch_fraction = 10});
  ASSERT_FALSE(plan.full);
  EXPECT_EQ(plan.changed_units, 2048u);
  plan = DiffBucket(base, Sum(base), Random(4097, 6), 0);
  EXPECT_TRUE(plan.full);
  EXPECT_NE(plan.why.find("4097 bytes, its base 4096"), std::string::npos) << plan.why;
}

TEST(BucketPatch, ALostOrDifferentBaseIsRefusedAndNeverPatched) {
  const std::vector<uint8_t> base = Random(512, 7);
  std::vector<uint8_t> next = base;
  next[100] ^= 3;
  for (PatchFormat format :
       {PatchFormat::kWordRuns, PatchFormat::kUnits, PatchFormat::kIndexedUnits}) {
    const BucketPatchPlan plan = DiffBucket(base, Sum(base), next, Sum(next), {.format = format});
    ASSERT_FALSE(plan.full);
    std::vector<uint8_t> other = base;
    other[400] ^= 1;  // the receiver holds something else
    EXPECT_EQ(ApplyBucketPatch(plan.patch, other).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(ApplyBucketPatch(plan.patch, Random(511, 7)).status().code(),
              absl::StatusCode::kFailedPrecondition);
    // A known base checksum is compared, not read: another one refuses at once; the right one
    // gives the bucket and the result is still summed (a corrupted base is caught there).
    EXPECT_EQ(ApplyBucketPatch(plan.patch, base, {.base_checksum = Sum(other)}).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(*ApplyBucketPatch(plan.patch, base, {.base_checksum = Sum(base)}), next);
    EXPECT_EQ(ApplyBucketPatch(plan.patch, other, {.base_checksum = Sum(base)}).status().code(),
              absl::StatusCode::kDataLoss);
  }
}

// A receiver recycles the buckets of the version before last: a buffer of the bucket's size is
// written over, every byte, without being cleared; one of another size is resized.
TEST(BucketPatch, AppliedIntoARecycledBufferOverwritesEveryByte) {
  const size_t n = (size_t{3} << 20) + 3;  // several application slices, a lone last byte
  const std::vector<uint8_t> base = Random(n, 51);
  std::vector<uint8_t> next = base;
  for (size_t at : {size_t{0}, size_t{1} << 20, n - 1}) next[at] ^= 0x3c;
  const BucketPatchPlan plan = DiffBucket(base, Sum(base), next, Sum(next));
  ASSERT_FALSE(plan.full);
  for (size_t size : {n, n - 1000, n + 1000, size_t{0}}) {
    std::vector<uint8_t> out(size, 0xee);
    uint64_t sum = 0;
    ASSERT_TRUE(
        ApplyBucketPatchInto(plan.patch, base, &out, {.threads = 3, .checksum = &sum}).ok());
    EXPECT_EQ(out, next) << size;
    EXPECT_EQ(sum, Sum(next));
  }
}

TEST(BucketPatch, MalformedOrCorruptedRunsAreRefused) {
  const std::vector<uint8_t> base = Random(4096, 8);
  std::vector<uint8_t> next = base;
  for (size_t at : {10u, 11u, 800u, 3000u}) next[at] ^= 0x11;
  const std::vector<uint8_t> good = DiffBucket(base, Sum(base), next, Sum(next), kRuns).patch;
  ASSERT_EQ(*ApplyBucketPatch(good, base), next);
  auto code = [&](std::vector<uint8_t> patch) {
    return ApplyBucketPatch(patch, base).status().code();
  };
  EXPECT_EQ(code({}), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> p = good;
  p[0] = 'X';
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // magic
  p = good;
  p[4] = 7;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // format
  p = good;
  p[4] = 3;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // format 3's layout differs
  p = good;
  p[36] = 1;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // xor runs: not applied
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

TEST(BucketPatch, MalformedOrCorruptedUnitsAreRefused) {
  const std::vector<uint8_t> base = Random(4095, 9);  // odd: a lone last byte
  std::vector<uint8_t> next = base;
  for (size_t at : {10u, 11u, 800u, 3000u}) next[at] ^= 0x11;
  const std::vector<uint8_t> good = DiffBucket(base, Sum(base), next, Sum(next)).patch;
  ASSERT_EQ(*ApplyBucketPatch(good, base), next);
  // Entries: unit 5 (gap 5, XOR 0x1111), unit 400 (gap 394, 0x11), unit 1500 (gap 1099, 0x11).
  const std::vector<uint8_t> entries(good.begin() + kBucketPatchHeaderBytes, good.end());
  ASSERT_EQ(entries, (std::vector<uint8_t>{5, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11}));
  auto with = [&](std::vector<uint8_t> e, uint64_t count = 3) {
    std::vector<uint8_t> p(good.begin(), good.begin() + kBucketPatchHeaderBytes);
    p.insert(p.end(), e.begin(), e.end());
    const uint64_t bytes = e.size();
    std::memcpy(p.data() + 32, &count, 8);
    std::memcpy(p.data() + 40, &bytes, 8);
    return ApplyBucketPatch(p, base).status();
  };
  EXPECT_TRUE(with(entries).ok());
  auto refused = [&](std::vector<uint8_t> e, const char* why, uint64_t count = 3) {
    const absl::Status s = with(std::move(e), count);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << why << ": " << s;
  };
  refused({5, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x08}, "truncated");
  refused({5, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11, 0}, "trailing byte");
  refused(entries, "count", 4);
  refused({5, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11, 0, 1}, "count", 2);
  refused({5, 0x00, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11}, "a zero XOR");
  refused({0x85, 0x00, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11}, "not minimal");
  refused({5, 0x91, 0x22, 0x8a, 0x03, 0x11, 0xcb, 0x10, 0x11}, "beyond the bucket");
  refused({5, 0x81, 0x80, 0x04, 0x8a, 0x03, 0x11, 0xcb, 0x08, 0x11}, "XOR over 16 bits");
  // Unit 2047 is the lone byte: a XOR over 8 bits cannot be its.
  refused({0xff, 0x0f, 0x80, 0x02}, "lone byte", 1);
  EXPECT_EQ(with({0xff, 0x0f, 0x7f}, 1).code(), absl::StatusCode::kDataLoss);  // applies, wrong
  std::vector<uint8_t> p = good;
  p.back() ^= 0x01;  // a XOR's bit
  EXPECT_EQ(ApplyBucketPatch(p, base).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace wpub::delta

namespace wpub::delta {
namespace {

constexpr BucketPatchOptions kIndexed{.format = PatchFormat::kIndexedUnits};

// Format 3's layout as the header states it: the changed units' indices, then their XORs;
// applied twice it gives the base back (what an engine's undo relies on).
TEST(BucketPatch, IndexedUnitsAreTheIndicesThenTheXorsAndUndoThemselves) {
  const size_t n = 8 * 100 + 3;  // a lone last byte
  const std::vector<uint8_t> base = Random(n, 61);
  std::vector<uint8_t> next = base;
  next[4] ^= 0x7e;   // unit 2, low byte
  next[5] ^= 0x01;   // unit 2, high byte
  next[9] ^= 0x80;   // unit 4, high byte
  next[n - 1] ^= 3;  // unit 401: the lone last byte
  const BucketPatchPlan plan = RoundTrip(base, next, kIndexed);
  ASSERT_FALSE(plan.full) << plan.why;
  ASSERT_EQ(plan.changed_units, 3u);
  ASSERT_EQ(plan.patch.size(), kBucketPatchHeaderBytes + 6 * 3);
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, plan.patch.data() + at, 4);
    return v;
  };
  auto u16 = [&](size_t at) {
    uint16_t v;
    std::memcpy(&v, plan.patch.data() + at, 2);
    return v;
  };
  EXPECT_EQ(u32(4), 3u);  // format
  EXPECT_EQ((std::vector<uint32_t>{u32(48), u32(52), u32(56)}), (std::vector<uint32_t>{2, 4, 401}));
  EXPECT_EQ((std::vector<uint16_t>{u16(60), u16(62), u16(64)}),
            (std::vector<uint16_t>{0x017e, 0x8000, 0x0003}));
  // The patch XORed into next again is base: the XORs are base XOR next.
  const BucketPatchPlan back = DiffBucket(next, Sum(next), base, Sum(base), kIndexed);
  ASSERT_FALSE(back.full) << back.why;
  ASSERT_EQ(back.patch.size(), plan.patch.size());
  EXPECT_TRUE(std::equal(plan.patch.begin() + 32, plan.patch.end(), back.patch.begin() + 32));
}

TEST(BucketPatch, MalformedIndexedUnitsAreRefused) {
  const std::vector<uint8_t> base = Random(4093, 62);  // a lone last byte
  std::vector<uint8_t> next = base;
  for (size_t at : {10u, 11u, 800u, 3000u, 4092u}) next[at] ^= 0x11;
  const std::vector<uint8_t> good = DiffBucket(base, Sum(base), next, Sum(next), kIndexed).patch;
  ASSERT_EQ(*ApplyBucketPatch(good, base), next);
  const size_t count = (good.size() - kBucketPatchHeaderBytes) / 6;
  ASSERT_EQ(count, 4u);  // units 5, 400, 1500, 2046
  const size_t xors = kBucketPatchHeaderBytes + 4 * count;
  auto code = [&](std::vector<uint8_t> patch) {
    return ApplyBucketPatch(patch, base).status().code();
  };
  auto put32 = [](std::vector<uint8_t>& p, size_t at, uint32_t v) {
    std::memcpy(p.data() + at, &v, 4);
  };
  std::vector<uint8_t> p = good;
  p[40] = 1;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // reserved
  p = good;
  p.pop_back();
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // size
  // A count whose 6 * count wraps to the patch's entry bytes (a header claiming a huge bucket):
  // refused from the sizes, nothing read past the patch.
  p = std::vector<uint8_t>(good.begin(), good.begin() + kBucketPatchHeaderBytes + 2);
  const uint64_t huge_n = ~uint64_t{0} - 1, wraps = (~uint64_t{0} / 6) + 1;  // 6 * wraps == 2
  std::memcpy(p.data() + 8, &huge_n, 8);
  std::memcpy(p.data() + 32, &wraps, 8);
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
  p = good;
  put32(p, 48 + 4, 5);
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // not ascending (a repeat)
  p = good;
  put32(p, 48 + 12, 2047);
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // past the bucket's 2047 units
  p = good;
  p[xors + 2] = p[xors + 3] = 0;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);  // an XOR of 0
  p = good;
  p[xors + 7] = 0x80;  // the lone last byte's XOR reaches past the bucket
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
  p = good;
  p[xors] ^= 0x80;  // a byte of the bucket: the result's checksum catches it
  EXPECT_EQ(code(p), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace wpub::delta
