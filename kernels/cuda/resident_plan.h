// Work split of the resident fused QDQ (qdq_resident.cuh): which blocks of a round each CTA
// keeps in shared memory between the amax pass and the QDQ pass, which it reads twice, and how
// consecutive weight slices are grouped into rounds. Pure arithmetic on host and device, so the
// CPU tests (tests/kernels_cpu/resident_plan_test.cc) check the coverage the kernel relies on.
#pragma once

#include <cstdint>

#include "kernels/nvfp4_math.h"

namespace wpub::kernels::cuda::detail {

// Shares are multiples of this many 16-element blocks (except at the ends), so a warp's loads
// cover whole runs of 32 consecutive blocks.
inline constexpr uint64_t kResidentAlign = 32;

// One CTA's part of a round of n blocks (indices into the round's concatenated slices):
// [stash_begin, stash_end) is read once and kept in the CTA's shared memory, at most
// stash_blocks of it; [spill_begin, spill_end) does not fit and is read in both passes.
// Over all ctas CTAs the stash ranges partition [0, min(n, ctas * stash_blocks)) and the spill
// ranges the rest of [0, n).
struct ResidentShare {
  uint64_t stash_begin;
  uint64_t stash_end;
  uint64_t spill_begin;
  uint64_t spill_end;
};

WPUB_HD uint64_t MinU64(uint64_t a, uint64_t b) { return a < b ? a : b; }

WPUB_HD uint64_t AlignedShare(uint64_t n, uint64_t ctas) {
  const uint64_t per = (n + ctas - 1) / ctas;
  return (per + kResidentAlign - 1) / kResidentAlign * kResidentAlign;
}

// ctas >= 1 and stash_blocks >= 1.
WPUB_HD ResidentShare ShareOfCta(uint64_t n, uint32_t ctas, uint32_t stash_blocks, uint32_t cta) {
  const uint64_t stashed = MinU64(n, uint64_t{ctas} * stash_blocks);
  const uint64_t per = MinU64(AlignedShare(stashed, ctas), stash_blocks);
  const uint64_t spilled = n - stashed;
  const uint64_t per_spill = AlignedShare(spilled, ctas);
  ResidentShare s;
  s.stash_begin = MinU64(cta * per, stashed);
  s.stash_end = MinU64(cta * per + per, stashed);
  s.spill_begin = stashed + MinU64(cta * per_spill, spilled);
  s.spill_end = stashed + MinU64(cta * per_spill + per_spill, spilled);
  return s;
}

// Groups slices into rounds: consecutive slices while their blocks fit in `capacity` (the
// stash of the whole grid); a slice larger than the capacity is a round of its own. Writes
// round_begin[0..rounds] (round r is slices [round_begin[r], round_begin[r + 1])) and returns
// the number of rounds; round_begin needs num_slices + 1 entries.
inline int PlanRounds(const uint64_t* slice_blocks, int num_slices, uint64_t capacity,
                      uint32_t* round_begin) {
  int rounds = 0;
  uint64_t in_round = 0;
  round_begin[0] = 0;
  for (int i = 0; i < num_slices; ++i) {
    if (i > static_cast<int>(round_begin[rounds]) && in_round + slice_blocks[i] > capacity) {
      round_begin[++rounds] = static_cast<uint32_t>(i);
      in_round = 0;
    }
    in_round += slice_blocks[i];
  }
  if (num_slices > 0) round_begin[++rounds] = static_cast<uint32_t>(num_slices);
  return rounds;
}

}  // namespace wpub::kernels::cuda::detail
