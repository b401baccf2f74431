// Block deltas of served NVFP4 tensors: the 16-element blocks whose codes or scale changed from a
// base version to the next, as one self-checking patch, and its exact application
// (docs/scale.md, "Delta publication"; bench/delta measures how few blocks an RL step changes).
//
// A tensor is in the served layout (docs/specs/nvfp4.md): `packed` [rows, cols/2] (two E2M1
// codes per byte), `scales` [rows, cols/16] (one E4M3 byte per block), one fp32 decode scale
// (weight_scale_2). Block b covers packed bytes [8b, 8b + 8) and scale byte b.
//
// The rule (DiffNvfp4): a patch when the shape and the decode scale are unchanged and the patch
// is smaller than `max_patch_fraction` of the full tensor; otherwise the full tensor (a changed
// global scale re-bases every block: each block's scale is relative to it). A patch carries the
// checksums (core/transport/checksum.h) of the base's and of the target's codes and scales: the
// receiver applies it only to the exact base, and keeps it only when the result is the exact
// target -- the reconstruction is checked against the full tensor, not the patch.
//
// Patch format, little-endian, 64-byte header then three arrays:
//   0  "WPBD"   4  u32 format (1)   8  i64 rows   16 i64 cols   24 f32 decode scale (bits)
//   28 u32 n (changed blocks)   32 u64 base codes checksum   40 u64 base scales checksum
//   48 u64 target codes checksum   56 u64 target scales checksum
//   64 u32[n] block indices, strictly ascending, each < rows * cols / 16
//   then n x 8 code bytes, then n scale bytes.
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

// One NVFP4 tensor as served (read-only).
struct Nvfp4View {
  const uint8_t* packed = nullptr;  // rows * cols / 2 bytes
  const uint8_t* scales = nullptr;  // rows * cols / 16 bytes
  float decode_scale = 0;
  int64_t rows = 0;
  int64_t cols = 0;  // a positive multiple of 16
};

// The same, writable in place (a receiver's copy of the base).
struct Nvfp4Mutable {
  uint8_t* packed = nullptr;
  uint8_t* scales = nullptr;
  float decode_scale = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

inline constexpr size_t kPatchHeaderBytes = 64;
inline constexpr size_t kPatchBytesPerBlock = 4 + 8 + 1;  // index, codes, scale

struct DiffOptions {
  // A patch larger than this fraction of the full tensor (codes + scales + decode scale) is not
  // worth its indices: the full tensor goes instead.
  double max_patch_fraction = 0.5;
};

// What to send for `next` given the receiver holds `base`.
struct DeltaPlan {
  bool full = false;           // send the full tensor (why says why); patch is empty
  std::string why;             // "" for a patch
  std::vector<uint8_t> patch;  // the patch (format above) when !full
  uint64_t changed_blocks = 0;
  uint64_t full_bytes = 0;  // the full tensor's codes + scales + 4
};

// The codes and scales checksums of a tensor (as a patch records them).
struct Nvfp4Checksums {
  uint64_t codes = 0;
  uint64_t scales = 0;
  bool operator==(const Nvfp4Checksums& o) const { return codes == o.codes && scales == o.scales; }
};
Nvfp4Checksums ChecksumsOf(const Nvfp4View& t);

// INVALID_ARGUMENT naming the field for a view with null arrays, rows <= 0 or cols not a
// positive multiple of 16 (or too many blocks for a u32 index).
absl::Status ValidateView(const Nvfp4View& t, const char* what);

// The patch from `base` to `next`, or the decision to send `next` whole. INVALID_ARGUMENT for an
// invalid view.
absl::StatusOr<DeltaPlan> DiffNvfp4(const Nvfp4View& base, const Nvfp4View& next,
                                    const DiffOptions& options = {});

// Applies `patch` to `tensor` in place, all or nothing: INVALID_ARGUMENT naming the field for a
// patch that is malformed (size, magic, format, shape, indices out of range or not ascending) or
// whose decode scale is not the tensor's; FAILED_PRECONDITION when the tensor is not the patch's
// base (its checksums differ: the receiver lost or never had the base and needs the full
// tensor); DATA_LOSS when the result is not the patch's target (a corrupted patch), after
// putting the base back. On any error the tensor is unchanged.
absl::Status ApplyNvfp4Patch(absl::Span<const uint8_t> patch, const Nvfp4Mutable& tensor);

}  // namespace wpub::delta
