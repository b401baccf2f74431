// The work split of the resident fused QDQ (kernels/cuda/resident_plan.h): every block of a
// round belongs to exactly one CTA, in its stash or its spill; no stash share exceeds the CTA's
// shared memory; the stash takes as much of the round as the grid holds; rounds group
// consecutive slices without exceeding the grid's capacity unless a slice is larger on its own.
#include "kernels/cuda/resident_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace wpub::kernels::cuda::detail {
namespace {

// "" when the shares of all CTAs partition [0, n) as documented, else what is wrong.
std::string CheckShares(uint64_t n, uint32_t ctas, uint32_t stash_blocks) {
  const uint64_t capacity = uint64_t{ctas} * stash_blocks;
  const uint64_t stashed = n < capacity ? n : capacity;
  uint64_t next_stash = 0;
  uint64_t next_spill = stashed;
  const std::string at = " (n " + std::to_string(n) + ", ctas " + std::to_string(ctas) +
                         ", stash " + std::to_string(stash_blocks) + ")";
  for (uint32_t c = 0; c < ctas; ++c) {
    const ResidentShare s = ShareOfCta(n, ctas, stash_blocks, c);
    if (s.stash_begin > s.stash_end || s.spill_begin > s.spill_end) {
      return "CTA " + std::to_string(c) + ": reversed range" + at;
    }
    if (s.stash_end - s.stash_begin > stash_blocks) {
      return "CTA " + std::to_string(c) + ": stash share over the shared memory" + at;
    }
    // Consecutive CTAs take consecutive ranges (empty ones sit at the end).
    if (s.stash_begin != s.stash_end && s.stash_begin != next_stash) {
      return "CTA " + std::to_string(c) + ": stash gap or overlap" + at;
    }
    if (s.spill_begin != s.spill_end && s.spill_begin != next_spill) {
      return "CTA " + std::to_string(c) + ": spill gap or overlap" + at;
    }
    if (s.stash_begin != s.stash_end) next_stash = s.stash_end;
    if (s.spill_begin != s.spill_end) next_spill = s.spill_end;
    // Shares start on whole runs of kResidentAlign blocks, so warps load whole runs.
    if (s.stash_begin != s.stash_end && s.stash_begin % kResidentAlign != 0 &&
        stash_blocks % kResidentAlign == 0) {
      return "CTA " + std::to_string(c) + ": unaligned stash share" + at;
    }
  }
  if (next_stash != stashed) return "stash covers " + std::to_string(next_stash) + at;
  if (next_spill != n) return "spill ends at " + std::to_string(next_spill) + at;
  return "";
}

TEST(ResidentPlan, SharesPartitionEveryRound) {
  // The H200 shape (132 CTAs x 7232 blocks), small grids, and shared memory that holds less
  // than, exactly, and more than the round.
  for (uint32_t ctas : {1u, 2u, 3u, 7u, 132u}) {
    for (uint32_t stash : {32u, 64u, 96u, 7232u}) {
      const uint64_t cap = uint64_t{ctas} * stash;
      for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{31}, uint64_t{32}, uint64_t{33},
                         cap - 1, cap, cap + 1, 2 * cap + 5, 10 * cap + 31, uint64_t{1} << 33}) {
        ASSERT_EQ(CheckShares(n, ctas, stash), "");
      }
    }
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const uint32_t ctas = 1 + static_cast<uint32_t>(rng() % 200);
    const uint32_t stash = 1 + static_cast<uint32_t>(rng() % 300);
    const uint64_t n = rng() % (uint64_t{ctas} * stash * 3 + 100);
    ASSERT_EQ(CheckShares(n, ctas, stash), "");
  }
}

TEST(ResidentPlan, StashTakesWhatTheGridHolds) {
  // A round that fits is stashed whole; a larger one fills every CTA's stash.
  const ResidentShare fits = ShareOfCta(1000, 4, 512, 0);
  EXPECT_EQ(fits.stash_begin, 0u);
  EXPECT_EQ(fits.stash_end, 256u);  // ceil(1000 / 4) = 250, rounded up to 32
  EXPECT_EQ(fits.spill_begin, fits.spill_end);
  for (uint32_t c = 0; c < 4; ++c) {
    const ResidentShare s = ShareOfCta(5000, 4, 512, c);
    EXPECT_EQ(s.stash_end - s.stash_begin, 512u) << c;
    EXPECT_EQ(s.spill_end - s.spill_begin, c < 3 ? 768u : 5000u - 2048u - 3 * 768u) << c;
  }
}

TEST(ResidentPlan, RoundsGroupConsecutiveSlicesWithinCapacity) {
  uint32_t begin[8];
  const uint64_t small[5] = {10, 20, 30, 40, 50};
  ASSERT_EQ(PlanRounds(small, 5, 60, begin), 3);  // {10,20,30} {40} {50}
  EXPECT_EQ((std::vector<uint32_t>(begin, begin + 4)), (std::vector<uint32_t>{0, 3, 4, 5}));
  const uint64_t mixed[4] = {5, 100, 5, 5};  // the large slice is a round of its own
  ASSERT_EQ(PlanRounds(mixed, 4, 60, begin), 3);
  EXPECT_EQ((std::vector<uint32_t>(begin, begin + 4)), (std::vector<uint32_t>{0, 1, 2, 4}));
  const uint64_t exact[3] = {30, 30, 30};
  ASSERT_EQ(PlanRounds(exact, 3, 60, begin), 2);
  EXPECT_EQ((std::vector<uint32_t>(begin, begin + 3)), (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_EQ(PlanRounds(exact, 0, 60, begin), 0);
  EXPECT_EQ(begin[0], 0u);

  // Random lists: rounds are consecutive, cover every slice, stay within the capacity unless
  // they hold one slice, and no round could have taken the next slice.
  std::mt19937_64 rng(11);
  for (int t = 0; t < 500; ++t) {
    const int n = 1 + static_cast<int>(rng() % 128);
    const uint64_t cap = 1 + rng() % 1000;
    std::vector<uint64_t> b(n);
    for (auto& x : b) x = rng() % (2 * cap);
    std::vector<uint32_t> rb(n + 1);
    const int rounds = PlanRounds(b.data(), n, cap, rb.data());
    ASSERT_GE(rounds, 1);
    ASSERT_EQ(rb[0], 0u);
    ASSERT_EQ(rb[rounds], static_cast<uint32_t>(n));
    for (int r = 0; r < rounds; ++r) {
      ASSERT_LT(rb[r], rb[r + 1]);
      uint64_t sum = 0;
      for (uint32_t i = rb[r]; i < rb[r + 1]; ++i) sum += b[i];
      if (rb[r + 1] - rb[r] > 1) ASSERT_LE(sum, cap);
      if (r + 1 < rounds) ASSERT_GT(sum + b[rb[r + 1]], cap) << "round " << r << " stopped early";
    }
  }
}

}  // namespace
}  // namespace wpub::kernels::cuda::detail
