// The GPU bucket diff (kernels/cuda/bucket_diff.h) against the CPU oracle delta::DiffBucket
// (label gpu; skips without a device): the patch byte for byte, the totals, and the patch
// applied by delta::ApplyBucketPatch giving `next`. Cases: no change, every word, one word
// anywhere, the partial last word, tiny and empty buckets, runs at and across the kernel's tile
// and mask-word boundaries, adjacent runs that merge, random sparse changes over 64 MiB, both
// load widths (16- and 8-byte aligned buckets), capacities too small by one byte, a 300 MiB
// bucket whose tiles take the scan kernel more than one round, and a CUDA graph replay. Scratch
// and totals start as garbage; the patch buffer's bytes past the patch are checked untouched.
#include "kernels/cuda/bucket_diff.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/delta/bucket_patch.h"
#include "core/transport/checksum.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::kernels::cuda {
namespace {

using Bytes = std::vector<uint8_t>;

// The kernel's tile (kTileWords in bucket_diff.cu) and the tiles its scan takes per round: the
// boundaries worth testing. The results never depend on them.
constexpr uint64_t kTile = 4096;
constexpr uint64_t kScanRoundTiles = 8192;
constexpr uint8_t kSentinel = 0xCD;

class BucketDiffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

Bytes Random(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes v(n);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, std::min<uint64_t>(8, n - i));
  }
  return v;
}

uint64_t Words(const Bytes& v) { return (v.size() + 7) / 8; }

// Changes one byte of word w (within the bucket), so that the word differs.
void Touch(Bytes& v, uint64_t w, std::mt19937_64& rng) {
  const uint64_t bytes = std::min<uint64_t>(8, v.size() - 8 * w);
  v[8 * w + rng() % bytes] ^= static_cast<uint8_t>(1 + rng() % 255);
}
void TouchRange(Bytes& v, uint64_t first, uint64_t last, std::mt19937_64& rng) {
  for (uint64_t w = first; w <= last; ++w) Touch(v, w, rng);
}

uint64_t Sum(const Bytes& v) { return transport::Checksum(v.data(), v.size()); }

// What a launch left: its totals and the whole patch buffer.
struct GpuDiff {
  BucketDiffTotals totals{};
  Bytes patch;
};

// Device copies of a base and a next bucket, `offset` bytes into their allocations (a multiple
// of 8: 8 takes the kernel's 8-byte loads).
class DeviceBuckets {
 public:
  DeviceBuckets(const Bytes& base, const Bytes& next, uint64_t base_offset = 0,
                uint64_t next_offset = 0)
      : n_(base.size()), base_offset_(base_offset), next_offset_(next_offset) {
    EXPECT_EQ(DeviceBuffer::Create(n_ + base_offset + 8, &base_), cudaSuccess);
    EXPECT_EQ(DeviceBuffer::Create(n_ + next_offset + 8, &next_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(Base(), base.data(), n_, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(Next(), next.data(), n_, cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable copy may return before its DMA ends, and launches go to a non-blocking stream.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  uint8_t* Base() const { return base_.as<uint8_t>() + base_offset_; }
  uint8_t* Next() const { return next_.as<uint8_t>() + next_offset_; }

  // One launch on a fresh stream; scratch and totals start as garbage, the patch buffer as
  // kSentinel (a capacity of 0 passes a null patch).
  GpuDiff Diff(uint64_t base_checksum, uint64_t next_checksum, uint64_t capacity,
               uint64_t patch_offset = 0, bool xor_runs = false, bool indexed = false) const {
    GpuDiff out;
    DeviceBuffer patch, scratch, totals;
    const uint64_t scratch_bytes = BucketDiffScratchBytes(n_, capacity);
    EXPECT_EQ(scratch_bytes % 256, 0u);
    EXPECT_EQ(DeviceBuffer::Create(capacity + patch_offset + 8, &patch), cudaSuccess);
    EXPECT_EQ(DeviceBuffer::Create(scratch_bytes, &scratch), cudaSuccess);
    EXPECT_EQ(DeviceBuffer::Create(sizeof(BucketDiffTotals), &totals), cudaSuccess);
    Stream stream;
    EXPECT_EQ(Stream::Create(&stream), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(patch.data(), kSentinel, patch.size(), stream.get()), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(scratch.data(), 0xA7, scratch.size(), stream.get()), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(totals.data(), 0xA7, totals.size(), stream.get()), cudaSuccess);
    uint8_t* const p = capacity == 0 ? nullptr : patch.as<uint8_t>() + patch_offset;
    EXPECT_EQ(indexed ? LaunchBucketDiffIndexed(Base(), Next(), n_, base_checksum, next_checksum, p,
                                                capacity, scratch.data(), scratch_bytes,
                                                totals.as<BucketDiffTotals>(), stream.get())
                      : LaunchBucketDiff(Base(), Next(), n_, base_checksum, next_checksum, p,
                                         capacity, scratch.data(), scratch_bytes,
                                         totals.as<BucketDiffTotals>(), stream.get(), xor_runs),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(&out.totals, totals.data(), sizeof(out.totals), cudaMemcpyDeviceToHost),
              cudaSuccess);
    Bytes all(patch.size());
    EXPECT_EQ(cudaMemcpy(all.data(), patch.data(), all.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    // Before the patch (offset) and past its capacity: never written.
    for (uint64_t i = 0; i < all.size(); ++i) {
      if ((i < patch_offset || i >= patch_offset + capacity) && all[i] != kSentinel) {
        ADD_FAILURE() << "byte " << i << " of the patch allocation outside the patch written";
        break;
      }
    }
    out.patch.assign(all.begin() + patch_offset, all.begin() + patch_offset + capacity);
    return out;
  }

 private:
  uint64_t n_, base_offset_, next_offset_;
  DeviceBuffer base_, next_;
};

// The index of the first byte where a and b differ, or -1 when equal.
int64_t FirstDifference(const uint8_t* a, const uint8_t* b, uint64_t n) {
  const auto [pa, pb] = std::mismatch(a, a + n, b);
  return pa == a + n ? -1 : pa - a;
}

// LaunchBucketPatchApply of `patch` to a device copy of `bucket`: the bucket as it is after
// (`times` applications) and the error word.
struct GpuApplied {
  Bytes bucket;
  unsigned int error = 0;
};
GpuApplied ApplyOnGpu(const Bytes& patch, const Bytes& bucket, int times = 1) {
  GpuApplied out;
  DeviceBuffer p, b, error;
  EXPECT_EQ(DeviceBuffer::Create(patch.size() + 8, &p), cudaSuccess);
  EXPECT_EQ(DeviceBuffer::Create(bucket.size() + 8, &b), cudaSuccess);
  EXPECT_EQ(DeviceBuffer::Create(sizeof(unsigned int), &error), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p.data(), patch.data(), patch.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(b.data(), bucket.data(), bucket.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Stream stream;
  EXPECT_EQ(Stream::Create(&stream), cudaSuccess);
  for (int i = 0; i < times; ++i) {
    EXPECT_EQ(LaunchBucketPatchApply(p.as<uint8_t>(), patch.size(), b.as<uint8_t>(), bucket.size(),
                                     error.as<unsigned int>(), stream.get()),
              cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  out.bucket.resize(bucket.size());
  EXPECT_EQ(cudaMemcpy(out.bucket.data(), b.data(), bucket.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&out.error, error.data(), sizeof(out.error), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

// The GPU diff equals DiffBucket's format 1 patch byte for byte, plain and with xor runs, at a
// capacity with room to spare, at exactly the patch's size, and one byte short (nothing written,
// totals alike); the plain GPU patch applied to base gives next, and the xor runs turned into
// units (what wpubd sends) are DiffBucket's format 2 patch byte for byte. Infinity as
// max_patch_fraction: the oracle never refuses for size (1.0 would refuse a patch larger than its
// bucket: every word changed, tiny buckets).
void ExpectOracle(const Bytes& base, const Bytes& next, const std::string& what,
                  uint64_t base_offset = 0, uint64_t next_offset = 0, uint64_t patch_offset = 0) {
  SCOPED_TRACE(what);
  ASSERT_EQ(base.size(), next.size());
  const uint64_t base_sum = Sum(base), next_sum = Sum(next);
  constexpr double kAny = std::numeric_limits<double>::infinity();
  const delta::BucketPatchPlan units =
      delta::DiffBucket(base, base_sum, next, next_sum, {.max_patch_fraction = kAny, .threads = 0});
  ASSERT_FALSE(units.full) << units.why;
  const DeviceBuckets dev(base, next, base_offset, next_offset);
  for (const int layout : {0, 1, 2}) {  // plain runs, xor runs, indexed units (format 3)
    const bool xor_runs = layout >= 1, indexed = layout == 2;
    SCOPED_TRACE(indexed ? "indexed units" : (xor_runs ? "xor runs" : "plain runs"));
    const delta::BucketPatchPlan plan = delta::DiffBucket(
        base, base_sum, next, next_sum,
        {.max_patch_fraction = kAny,
         .threads = 0,
         .format = indexed ? delta::PatchFormat::kIndexedUnits : delta::PatchFormat::kWordRuns,
         .xor_runs = xor_runs});
    ASSERT_FALSE(plan.full) << plan.why;
    const uint64_t size = plan.patch.size();
    for (const uint64_t capacity : {size + 61, size, size - 1}) {
      SCOPED_TRACE("capacity " + std::to_string(capacity) + " for a patch of " +
                   std::to_string(size));
      const GpuDiff got = dev.Diff(base_sum, next_sum, capacity, patch_offset, xor_runs, indexed);
      if (!indexed) EXPECT_EQ(got.totals.runs, plan.runs);
      EXPECT_EQ(got.totals.changed_words, plan.changed_words);
      if (indexed) EXPECT_EQ(got.totals.changed_units, plan.changed_units);
      EXPECT_EQ(got.totals.patch_bytes, size);
      if (capacity < size) {
        EXPECT_EQ(got.totals.written, 0u);
        EXPECT_EQ(FirstDifference(got.patch.data(), Bytes(capacity, kSentinel).data(), capacity),
                  -1)
            << "a patch that does not fit wrote into the patch buffer";
        continue;
      }
      ASSERT_EQ(got.totals.written, 1u);
      EXPECT_EQ(FirstDifference(got.patch.data(), plan.patch.data(), size), -1)
          << "first patch byte that differs from DiffBucket's";
      EXPECT_EQ(FirstDifference(got.patch.data() + size, Bytes(capacity - size, kSentinel).data(),
                                capacity - size),
                -1)
          << "written past the patch's end";
      const absl::Span<const uint8_t> gpu_patch(got.patch.data(), size);
      if (indexed) {  // applied on the GPU: next; applied twice: base again
        if (capacity != size) continue;
        const Bytes p(gpu_patch.begin(), gpu_patch.end());
        const GpuApplied once = ApplyOnGpu(p, base);
        EXPECT_EQ(once.error, 0u);
        EXPECT_EQ(FirstDifference(once.bucket.data(), next.data(), next.size()), -1)
            << "first byte of the GPU-applied bucket that differs from next";
        const GpuApplied twice = ApplyOnGpu(p, base, 2);
        EXPECT_EQ(FirstDifference(twice.bucket.data(), base.data(), base.size()), -1)
            << "applied twice: first byte that is not the base's";
        continue;
      }
      if (!xor_runs) {
        const absl::StatusOr<Bytes> applied = delta::ApplyBucketPatch(gpu_patch, base);
        ASSERT_TRUE(applied.ok()) << applied.status();
        EXPECT_TRUE(*applied == next) << "the applied GPU patch is not next";
        continue;
      }
      const absl::StatusOr<delta::BucketPatchPlan> sent = delta::UnitsFromXorRuns(gpu_patch, kAny);
      ASSERT_TRUE(sent.ok()) << sent.status();
      ASSERT_FALSE(sent->full);
      EXPECT_EQ(FirstDifference(sent->patch.data(), units.patch.data(),
                                std::min(sent->patch.size(), units.patch.size())),
                -1)
          << "first byte of the units patch that differs from DiffBucket's";
      EXPECT_EQ(sent->patch.size(), units.patch.size());
    }
  }
}

TEST_F(BucketDiffTest, NoChangeIsAHeaderOnlyPatch) {
  for (const uint64_t n : {uint64_t{8}, uint64_t{1} << 20, (uint64_t{1} << 20) + 5}) {
    const Bytes base = Random(n, n);
    ExpectOracle(base, base, "n " + std::to_string(n));
  }
}

TEST_F(BucketDiffTest, EveryWordChanged) {
  std::mt19937_64 rng(1);
  for (const uint64_t n :
       {uint64_t{8}, uint64_t{16}, 8 * kTile, 8 * kTile * 3 + 3, uint64_t{999}}) {
    const Bytes base = Random(n, n);
    Bytes next = base;
    TouchRange(next, 0, Words(next) - 1, rng);
    ExpectOracle(base, next, "n " + std::to_string(n));
  }
}

TEST_F(BucketDiffTest, OneWordFirstMiddleOrLast) {
  std::mt19937_64 rng(2);
  for (const uint64_t n : {uint64_t{8}, uint64_t{24}, uint64_t{1000}, uint64_t{1003}, 8 * kTile * 2,
                           8 * kTile * 2 + 7, (uint64_t{5} << 20) + 1}) {
    const Bytes base = Random(n, n + 1);
    const uint64_t words = Words(base);
    for (const uint64_t w : {uint64_t{0}, words / 2, words - 1}) {
      Bytes next = base;
      Touch(next, w, rng);
      ExpectOracle(base, next, "n " + std::to_string(n) + " word " + std::to_string(w));
    }
  }
}

TEST_F(BucketDiffTest, PartialLastWordChangedAndUnchanged) {
  std::mt19937_64 rng(3);
  for (const uint64_t whole : {uint64_t{0}, uint64_t{1}, uint64_t{63}, kTile - 1, kTile * 2}) {
    for (uint64_t tail = 1; tail < 8; ++tail) {
      const uint64_t n = 8 * whole + tail;
      const Bytes base = Random(n, n + 2);
      const std::string what = "n " + std::to_string(n);
      // Only the partial word, each of its bytes in turn.
      for (uint64_t b = 8 * whole; b < n; ++b) {
        Bytes next = base;
        next[b] ^= 0x80;
        ExpectOracle(base, next, what + " byte " + std::to_string(b));
      }
      if (whole == 0) continue;
      Bytes next = base;  // changes before it, the last word unchanged
      Touch(next, whole - 1, rng);
      Touch(next, 0, rng);
      ExpectOracle(base, next, what + ", last word unchanged");
      Touch(next, whole, rng);  // the run before it reaches into it
      ExpectOracle(base, next, what + ", a run ending in the partial word");
    }
  }
}

TEST_F(BucketDiffTest, EmptyBucketIsAHeaderOnlyPatch) {
  const Bytes empty;
  ExpectOracle(empty, empty, "n 0");
  // The header by hand: "WPBP", format 1, n = 0, the checksums, no runs, no words.
  const DeviceBuckets dev(empty, empty);
  const GpuDiff got = dev.Diff(0x1122334455667788ull, 0x99AABBCCDDEEFF00ull, 48);
  ASSERT_EQ(got.totals.written, 1u);
  EXPECT_EQ(got.totals.patch_bytes, 48u);
  const uint8_t want[48] = {'W',  'P',  'B',  'P',  1,    0,    0,    0,    0,    0,    0,    0,
                            0,    0,    0,    0,    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
                            0x00, 0xFF, 0xEE, 0xDD, 0xCC, 0xBB, 0xAA, 0x99, 0,    0,    0,    0,
                            0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0};
  EXPECT_EQ(FirstDifference(got.patch.data(), want, 48), -1);
  const GpuDiff small = dev.Diff(0, 0, 47);
  EXPECT_EQ(small.totals.written, 0u);
  EXPECT_EQ(small.totals.patch_bytes, 48u);
}

TEST_F(BucketDiffTest, BucketsShorterThanAWord) {
  for (uint64_t n = 1; n < 8; ++n) {
    const Bytes base = Random(n, n + 3);
    ExpectOracle(base, base, "unchanged, n " + std::to_string(n));
    for (uint64_t b = 0; b < n; ++b) {
      Bytes next = base;
      next[b] ^= 1;
      ExpectOracle(base, next, "n " + std::to_string(n) + " byte " + std::to_string(b));
    }
    Bytes next = base;
    for (auto& v : next) v = static_cast<uint8_t>(~v);
    ExpectOracle(base, next, "all bytes, n " + std::to_string(n));
  }
}

TEST_F(BucketDiffTest, RunsAtAndAcrossTileAndMaskWordBoundaries) {
  const uint64_t words = 6 * kTile + 100;
  const uint64_t n = 8 * words - 3;  // a partial last word too
  const Bytes base = Random(n, 4);
  const uint64_t T = kTile;
  // Each case: inclusive word ranges to change.
  const std::vector<std::vector<std::pair<uint64_t, uint64_t>>> cases = {
      {{T - 1, T - 1}},
      {{T, T}},
      {{T - 1, T}},              // one run across a tile boundary
      {{T - 2, T - 2}, {T, T}},  // two runs a word apart, on either side of it
      {{T - 1, T - 1}, {T + 1, T + 1}},
      {{63, 63}},
      {{64, 64}},
      {{63, 64}},  // across a mask word
      {{62, 62}, {64, 65}},
      {{0, T - 1}},          // exactly the first tile
      {{T, 2 * T - 1}},      // exactly the second
      {{T - 5, 3 * T + 7}},  // several tiles, two with no run start
      {{T - 5, 3 * T + 7}, {3 * T + 9, 3 * T + 9}, {4 * T - 1, 5 * T}},
      {{10, 20}, {T - 5, 3 * T + 7}, {4 * T + 64, 4 * T + 127}},
      {{2 * T + 3, words - 1}},  // to the partial last word, across tiles
      {{0, words - 1}},
  };
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < cases.size(); ++i) {
    Bytes next = base;
    for (const auto& [first, last] : cases[i]) TouchRange(next, first, last, rng);
    ExpectOracle(base, next, "case " + std::to_string(i));
  }
  // Every other word in two tiles (the most runs), and runs of 2 separated by 1.
  Bytes next = base;
  for (uint64_t w = T / 2; w < 5 * T / 2; w += 2) Touch(next, w, rng);
  ExpectOracle(base, next, "alternate words");
  next = base;
  for (uint64_t w = 0; w + 1 < words; w += 3) TouchRange(next, w, w + 1, rng);
  ExpectOracle(base, next, "pairs");
}

TEST_F(BucketDiffTest, AdjacentChangesMergeIntoOneRun) {
  std::mt19937_64 rng(6);
  const uint64_t n = 8 * 3 * kTile + 4;
  const Bytes base = Random(n, 6);
  Bytes next = base;
  // Single words changed one after another, in separate steps, make one run.
  for (uint64_t w = kTile - 40; w < kTile + 40; ++w) Touch(next, w, rng);
  const delta::BucketPatchPlan plan =
      delta::DiffBucket(base, Sum(base), next, Sum(next),
                        {.max_patch_fraction = 1.0, .format = delta::PatchFormat::kWordRuns});
  ASSERT_FALSE(plan.full);
  EXPECT_EQ(plan.runs, 1u);
  ExpectOracle(base, next, "80 words across a tile boundary");
}

// Random sparse changes at a rate over ~64 MiB: single words and clustered runs (the changed
// blocks of a tensor), both load widths.
void ExpectRandom(double rate, uint64_t seed, uint64_t base_offset, uint64_t next_offset,
                  uint64_t patch_offset) {
  std::mt19937_64 rng(seed);
  const uint64_t n = (uint64_t{64} << 20) + 5;
  const Bytes base = Random(n, seed);
  Bytes next = base;
  const uint64_t words = Words(base);
  std::bernoulli_distribution pick(rate / 2);
  for (uint64_t w = 0; w < words; ++w) {
    if (pick(rng)) Touch(next, w, rng);
  }
  // The other half of the rate as runs of 1..64 words.
  for (uint64_t changed = 0; changed < rate / 2 * words;) {
    const uint64_t len = 1 + rng() % 64, first = rng() % (words - len);
    TouchRange(next, first, first + len - 1, rng);
    changed += len;
  }
  ExpectOracle(base, next,
               "rate " + std::to_string(rate) + " offsets " + std::to_string(base_offset) + "/" +
                   std::to_string(next_offset) + "/" + std::to_string(patch_offset),
               base_offset, next_offset, patch_offset);
}

TEST_F(BucketDiffTest, RandomSparseChangesOver64MiB) {
  ExpectRandom(0.001, 7, 0, 0, 0);
  ExpectRandom(0.03, 8, 0, 0, 0);
  ExpectRandom(0.001, 9, 8, 8, 8);   // 8-byte aligned only: the 8-byte loads
  ExpectRandom(0.03, 10, 0, 8, 16);  // one of them 16-byte aligned
}

TEST_F(BucketDiffTest, LargeBucketOverSeveralScanRounds) {
  // 300 MiB: more tiles than the scan kernel takes per round, with runs across the round's end.
  const uint64_t n = (uint64_t{300} << 20) + 5;
  static_assert(8 * kTile * kScanRoundTiles < (uint64_t{300} << 20), "more than one round");
  std::mt19937_64 rng(11);
  const Bytes base = Random(n, 11);
  Bytes next = base;
  const uint64_t words = Words(base);
  for (int i = 0; i < static_cast<int>(words / 1000); ++i) Touch(next, rng() % words, rng);
  const uint64_t round_end = kTile * kScanRoundTiles;
  ASSERT_LT(round_end + kTile, words);
  TouchRange(next, round_end - kTile - 1, round_end + kTile, rng);
  TouchRange(next, round_end + kTile + 2, round_end + kTile + 2, rng);
  Touch(next, words - 1, rng);
  ExpectOracle(base, next, "300 MiB, 0.1%");
}

// The launches captured once in a CUDA graph (nothing synchronizes or reads back while
// capturing) and replayed after `next` changed on the device: each replay is the diff of what
// the buffers hold then (with the captured checksums).
TEST_F(BucketDiffTest, CapturedInAGraphAndReplayedOnNewBytes) {
  std::mt19937_64 rng(12);
  const uint64_t n = (uint64_t{1} << 20) + 3;
  const Bytes base = Random(n, 12);
  Bytes next1 = base, next2 = base;
  for (int i = 0; i < 300; ++i) Touch(next1, rng() % Words(base), rng);
  for (int i = 0; i < 900; ++i) Touch(next2, rng() % Words(base), rng);
  Touch(next2, Words(base) - 1, rng);
  const uint64_t base_sum = Sum(base), next_sum = Sum(next1);
  const DeviceBuckets dev(base, next1);
  DeviceBuffer patch, scratch, totals;
  const uint64_t capacity = n, scratch_bytes = BucketDiffScratchBytes(n, capacity);
  ASSERT_EQ(DeviceBuffer::Create(capacity, &patch), cudaSuccess);
  ASSERT_EQ(DeviceBuffer::Create(scratch_bytes, &scratch), cudaSuccess);
  ASSERT_EQ(DeviceBuffer::Create(sizeof(BucketDiffTotals), &totals), cudaSuccess);
  Stream stream;
  ASSERT_EQ(Stream::Create(&stream), cudaSuccess);
  ASSERT_EQ(Graph::BeginCapture(stream.get()), cudaSuccess);
  ASSERT_EQ(
      LaunchBucketDiff(dev.Base(), dev.Next(), n, base_sum, next_sum, patch.as<uint8_t>(), capacity,
                       scratch.data(), scratch_bytes, totals.as<BucketDiffTotals>(), stream.get()),
      cudaSuccess);
  Graph graph;
  ASSERT_EQ(Graph::EndCapture(stream.get(), &graph), cudaSuccess);
  for (const Bytes* next : {&next1, &next2}) {
    ASSERT_EQ(cudaMemcpy(dev.Next(), next->data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(graph.Launch(stream.get()), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    BucketDiffTotals got{};
    ASSERT_EQ(cudaMemcpy(&got, totals.data(), sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
    const delta::BucketPatchPlan plan =
        delta::DiffBucket(base, base_sum, *next, next_sum,
                          {.max_patch_fraction = 1.0, .format = delta::PatchFormat::kWordRuns});
    ASSERT_FALSE(plan.full) << plan.why;
    ASSERT_EQ(got.written, 1u);
    ASSERT_EQ(got.patch_bytes, plan.patch.size());
    EXPECT_EQ(got.runs, plan.runs);
    Bytes bytes(plan.patch.size());
    ASSERT_EQ(cudaMemcpy(bytes.data(), patch.data(), bytes.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(FirstDifference(bytes.data(), plan.patch.data(), bytes.size()), -1)
        << (next == &next1 ? "first replay" : "second replay");
  }
}

TEST_F(BucketDiffTest, RejectsMisalignedPointersAndShortScratch) {
  DeviceBuffer buf, scratch, totals;
  ASSERT_EQ(DeviceBuffer::Create(4096, &buf), cudaSuccess);
  ASSERT_EQ(DeviceBuffer::Create(sizeof(BucketDiffTotals), &totals), cudaSuccess);
  const uint64_t n = 1024;
  const uint64_t need = BucketDiffScratchBytes(n, 2048);
  ASSERT_EQ(DeviceBuffer::Create(need + 256, &scratch), cudaSuccess);
  auto* b = buf.as<uint8_t>();
  auto* t = totals.as<BucketDiffTotals>();
  auto* s = scratch.as<uint8_t>();
  EXPECT_EQ(LaunchBucketDiff(b + 4, b + 1024, n, 0, 0, b + 2048, 2048, s, need, t, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBucketDiff(b, b + 1024, n, 0, 0, b + 2052, 2040, s, need, t, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBucketDiff(b, b + 1024, n, 0, 0, b + 2048, 2048, s + 8, need, t, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBucketDiff(b, b + 1024, n, 0, 0, b + 2048, 2048, s, need - 256, t, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBucketDiff(b, b + 1024, n, 0, 0, b + 2048, 2048, s, need, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBucketDiff(b, b + 1024, n, 0, 0, b + 2048, 2048, s, need, t, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Every malformed format 3 patch the CPU parse refuses is refused on the GPU too, with the
// bucket untouched; the well-formed one applies (units 5, 400, 1500 and the lone last byte's).
TEST_F(BucketDiffTest, MalformedIndexedPatchesLeaveTheBucketUntouched) {
  const Bytes base = Random(4093, 71);  // a lone last byte
  Bytes next = base;
  for (size_t at : {10u, 11u, 800u, 3000u, 4092u}) next[at] ^= 0x11;
  const Bytes good = delta::DiffBucket(base, Sum(base), next, Sum(next),
                                       {.format = delta::PatchFormat::kIndexedUnits})
                         .patch;
  ASSERT_FALSE(good.empty());
  const GpuApplied ok = ApplyOnGpu(good, base);
  EXPECT_EQ(ok.error, 0u);
  EXPECT_TRUE(ok.bucket == next);
  auto put32 = [](Bytes& p, size_t at, uint32_t v) { std::memcpy(p.data() + at, &v, 4); };
  std::vector<std::pair<std::string, Bytes>> bad;
  const size_t count = (good.size() - 48) / 6, xors = 48 + 4 * count;
  Bytes p = good;
  p[0] = 'X';
  bad.emplace_back("magic", p);
  p = good;
  p[4] = 1;
  bad.emplace_back("format", p);
  p = good;
  p[8] ^= 2;
  bad.emplace_back("another bucket size", p);
  p = good;
  p[40] = 1;
  bad.emplace_back("reserved", p);
  p = good;
  p.pop_back();
  bad.emplace_back("size", p);
  p = good;
  put32(p, 48 + 4, 5);
  bad.emplace_back("not ascending", p);
  p = good;
  put32(p, 48 + 12, 2047);
  bad.emplace_back("range", p);
  p = good;
  p[xors + 2] = p[xors + 3] = 0;
  bad.emplace_back("zero XOR", p);
  p = good;
  p[xors + 7] = 0x80;
  bad.emplace_back("past the lone last byte", p);
  p = Bytes(good.begin(), good.begin() + 20);
  bad.emplace_back("shorter than a header", p);
  for (const auto& [what, patch] : bad) {
    SCOPED_TRACE(what);
    EXPECT_FALSE(delta::ApplyBucketPatch(patch, base).ok());
    const GpuApplied got = ApplyOnGpu(patch, base);
    EXPECT_NE(got.error, 0u);
    EXPECT_TRUE(got.bucket == base) << "a refused patch changed the bucket";
  }
}

}  // namespace
}  // namespace wpub::kernels::cuda
