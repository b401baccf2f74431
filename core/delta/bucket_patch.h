// Bucket patches: what a delta publication sends a receiver that holds the committed version
// instead of a bucket's bytes -- the runs of 8-byte words that differ between the receiver's
// copy of the bucket (the base) and the new one, and their exact, self-checking application
// (docs/DESIGN.md, "Delta publication").
//
// A bucket is the concatenation of its tensors as served, so a patch carries, for NVFP4
// weights, the 16-element blocks whose codes changed (8 code bytes each: one word), the words of
// block scales that changed and the decode scale's word when it changed; for BF16 tensors the
// changed words. It is format-agnostic: the rule that decides patch or full bucket is its size
// (a re-based NVFP4 tensor, whose global scale changed, changes nearly every block and its patch
// grows past the limit by itself).
//
// Patch format, little-endian, a 48-byte header then the runs:
//   0  "WPBP"   4  u32 format (1)   8  u64 bucket bytes (base and target alike)
//   16 u64 base checksum   24 u64 target checksum (core/transport/checksum.h, whole buckets)
//   32 u32 runs   36 u32 reserved (0)   40 u64 changed words
//   48 runs, in ascending word order, none touching the next: u32 first word, u32 words,
//      then the run's bytes (8 per word; the bucket's last word only as far as the bucket goes).
// The receiver applies a patch only to the exact base (its checksum) and keeps the result only
// when it has the target's checksum -- the reconstruction is checked against the full bucket,
// never against the patch.
//
// Pure functions; thread-safe. Every pointer is borrowed for the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wpub::delta {

inline constexpr size_t kBucketPatchHeaderBytes = 48;

struct BucketPatchOptions {
  // A patch larger than this fraction of the bucket is not worth its run headers: the bucket
  // goes whole.
  double max_patch_fraction = 0.5;
  // Threads for the comparison (<= 0: the hardware's); the patch does not depend on it.
  int threads = 1;
};

struct BucketPatchPlan {
  bool full = false;           // send the bucket whole (why says why); patch is empty
  std::string why;             // "" for a patch
  std::vector<uint8_t> patch;  // the patch (format above) when !full
  uint64_t changed_words = 0;
  uint32_t runs = 0;
};

// The patch from `base` to `next` (the same bucket index of two versions, laid out alike), or
// the decision to send `next` whole: a size that differs, a patch over max_patch_fraction, or
// more words or runs than a u32 counts.
// `base_checksum` and `next_checksum` are the buckets' checksums (the manifests'): they go into
// the patch unverified here.
BucketPatchPlan DiffBucket(absl::Span<const uint8_t> base, uint64_t base_checksum,
                           absl::Span<const uint8_t> next, uint64_t next_checksum,
                           const BucketPatchOptions& options = {});

struct ApplyPatchOptions {
  // Threads for the two whole-bucket checksums and the copy of the base (<= 0: the
  // hardware's); the result does not depend on it.
  int threads = 1;
  // When set, receives the result's checksum (the target's): a caller that acknowledges it
  // need not checksum the bucket again.
  uint64_t* checksum = nullptr;
};

// The bucket `patch` makes of `base`, all or nothing: INVALID_ARGUMENT naming the field for a
// malformed patch (header, sizes, runs out of range, overlapping or out of order);
// FAILED_PRECONDITION when `base` is not the patch's base (size or checksum: the receiver needs
// the whole bucket); DATA_LOSS when the result does not have the target's checksum. Both
// checksums are of the whole buckets, computed here over `base` and over the result.
absl::StatusOr<std::vector<uint8_t>> ApplyBucketPatch(absl::Span<const uint8_t> patch,
                                                      absl::Span<const uint8_t> base,
                                                      const ApplyPatchOptions& options = {});

// The target checksum a patch promises (0 for a patch too short to have a header).
uint64_t PatchTargetChecksum(absl::Span<const uint8_t> patch);

}  // namespace wpub::delta
