// Bucket patches: what a delta publication sends a receiver that holds the committed version
// instead of a bucket's bytes -- the parts that differ between the receiver's copy of the bucket
// (the base) and the new one, and their exact, self-checking application (docs/DESIGN.md,
// "Delta publication").
//
// A bucket is the concatenation of its tensors as served, and a patch is format-agnostic: the
// rule that decides patch or whole bucket is its size (a re-based NVFP4 tensor, whose global
// scale changed, changes nearly every block and its patch grows past the limit by itself).
//
// Two formats share a 48-byte little-endian header:
//   0  "WPBP"   4  u32 format   8  u64 bucket bytes n (base and target alike)
//   16 u64 base checksum   24 u64 target checksum (core/transport/checksum.h, whole buckets)
//
// Format 2, units (what wpubd sends): the changed 16-bit units. Unit u is bytes [2u, 2u + 2)
// read little-endian (the last unit of an odd n is its one byte).
//   32 u64 changed units   40 u64 entry bytes (the patch's size - 48)
//   48 one entry per changed unit, ascending: LEB128 varint (u - next), where next is 1 + the
//      previous entry's unit (0 for the first), then LEB128 varint (base unit XOR target unit),
//      never 0 (under 2^16; under 2^8 for an odd n's last unit).
// An isolated change costs 2-3 bytes: a bf16 element that moved by an ulp, one NVFP4 code byte
// or block scale. (Measured against format 1 on the update model: bench/delta, docs/scale.md.)
//
// Format 1, word runs (kept: older daemons send it, and it is how the GPU diff finds changes):
//   32 u32 runs   36 u32 flags (0)   40 u64 changed words
//   48 runs, in ascending word order, none touching the next: u32 first word, u32 words,
//      then the run's bytes (8 per word; the bucket's last word only as far as the bucket goes).
//   Flags bit 0 ("xor runs"): the run bytes are base XOR target -- the GPU diff's output
//   (kernels/cuda/bucket_diff.h), turned into format 2 on the host (UnitsFromXorRuns), never
//   sent to or applied by a receiver.
//
// Format 3, indexed units (what wpubd broadcasts to NCCL engines that take patches: made and
// applied on the GPU, each entry independently, kernels/cuda/bucket_diff.h):
//   32 u64 changed units c   40 u64 0 (reserved)
//   48 c x u32 unit index, ascending
//   48 + 4c: c x u16 XOR (base unit XOR target unit), never 0 (under 2^8 for an odd n's last
//      unit). Size 48 + 6c; a bucket of more than 2^32 units goes whole.
// An isolated change costs 6 bytes (format 2's 2-3 decode only in sequence). Applying it twice
// gives the base back: a receiver that patched its live copy and found the wrong checksum undoes
// the patch by applying it again.
//
// The receiver applies a patch only to the exact base (its checksum) and keeps the result only
// when it has the target's checksum -- the reconstruction is checked against the full bucket,
// never against the patch.
//
// Pure functions; thread-safe. Every pointer is borrowed for the call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wpub::delta {

inline constexpr size_t kBucketPatchHeaderBytes = 48;

enum class PatchFormat : uint32_t {
  kWordRuns = 1,
  kUnits = 2,
  kIndexedUnits = 3,
};

struct BucketPatchOptions {
  // A patch larger than this fraction of the bucket is not worth its entries' overhead and the
  // rebuild: the bucket goes whole.
  double max_patch_fraction = 0.5;
  // Threads for the comparison (<= 0: the hardware's); the patch does not depend on it.
  int threads = 1;
  PatchFormat format = PatchFormat::kUnits;
  // Format 1 only: run bytes are base XOR target (flags bit 0) -- the GPU diff's oracle.
  bool xor_runs = false;
};

struct BucketPatchPlan {
  bool full = false;           // send the bucket whole (why says why); patch is empty
  std::string why;             // "" for a patch
  std::vector<uint8_t> patch;  // the patch (format above) when !full
  uint64_t changed_words = 0;  // formats 1 and 3: words that differ
  uint32_t runs = 0;           // format 1: runs of them
  uint64_t changed_units = 0;  // formats 2 and 3: 16-bit units that differ
};

// The patch from `base` to `next` (the same bucket index of two versions, laid out alike) in
// options.format, or the decision to send `next` whole: a size that differs, a patch over
// max_patch_fraction, or more words, runs (format 1) or units (format 3) than a u32 counts.
// `base_checksum` and `next_checksum` are the buckets' checksums (the manifests'): they go into
// the patch unverified here.
BucketPatchPlan DiffBucket(absl::Span<const uint8_t> base, uint64_t base_checksum,
                           absl::Span<const uint8_t> next, uint64_t next_checksum,
                           const BucketPatchOptions& options = {});

// The format 2 patch that the format 1 xor-runs patch `xor_runs` (flags bit 0) stands for --
// byte for byte what DiffBucket makes in format 2 of the same two buckets -- or the decision to
// send the bucket whole when it would be larger than `max_patch_fraction` of the bucket (as
// DiffBucket decides; the plan's why says so). INVALID_ARGUMENT naming the field for a
// malformed input (header, flags, runs out of order or range, a word of zeros inside a run).
// `threads` (<= 0: the hardware's) share the work; the patch does not depend on them.
absl::StatusOr<BucketPatchPlan> UnitsFromXorRuns(absl::Span<const uint8_t> xor_runs,
                                                 double max_patch_fraction, int threads = 1);

// The largest format 1 patch whose format 2 transcoding can be at most `limit` bytes, for an
// n-byte bucket: each changed unit costs format 2 at least 2 bytes and format 1 at most 16 (an
// isolated word and its run header), and a format 1 patch is never over n + 64 bytes. The GPU
// diff's capacity, so that its decision is DiffBucket's.
uint64_t XorRunsCapacity(uint64_t n, uint64_t limit);

struct ApplyPatchOptions {
  // Threads for the copy of the base and the checksums, fused in one pass of 1 MiB slices
  // (<= 0: the hardware's); the result does not depend on it.
  int threads = 1;
  // The base's checksum when the caller holds it (the receiver verified the bucket when it got
  // it and has not written it since): compared with the patch's instead of reading the base
  // for it. The result's checksum is always computed over the result.
  std::optional<uint64_t> base_checksum;
  // When set, receives the result's checksum (the target's): a caller that acknowledges it
  // need not checksum the bucket again.
  uint64_t* checksum = nullptr;
};

// The bucket `patch` (format 1 without flags, 2 or 3) makes of `base`, all or nothing:
// INVALID_ARGUMENT naming the field for a malformed patch (header, sizes, entries out of range,
// overlapping or out of order, a zero XOR); FAILED_PRECONDITION when `base` is not the patch's
// base (size or checksum: the receiver needs the whole bucket); DATA_LOSS when the result does
// not have the target's checksum. Both checksums are of the whole buckets, computed here over
// `base` (unless options.base_checksum) and over the result.
absl::StatusOr<std::vector<uint8_t>> ApplyBucketPatch(absl::Span<const uint8_t> patch,
                                                      absl::Span<const uint8_t> base,
                                                      const ApplyPatchOptions& options = {});

// The same into `*out` (resized to the bucket; a buffer of that size already is reused without
// being cleared: a receiver recycles the buckets of the version before last). On error `*out`
// holds no bucket the caller may use. `out` must not alias `base` or `patch`.
absl::Status ApplyBucketPatchInto(absl::Span<const uint8_t> patch, absl::Span<const uint8_t> base,
                                  std::vector<uint8_t>* out, const ApplyPatchOptions& options = {});

// The target checksum a patch promises (0 for a patch too short to have a header).
uint64_t PatchTargetChecksum(absl::Span<const uint8_t> patch);

}  // namespace wpub::delta
