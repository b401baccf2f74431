#include "core/delta/block_delta.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/transport/checksum.h"

namespace wpub::delta {
namespace {

constexpr char kMagic[4] = {'W', 'P', 'B', 'D'};
constexpr uint32_t kFormat = 1;

uint64_t Blocks(int64_t rows, int64_t cols) { return static_cast<uint64_t>(rows * (cols / 16)); }

template <typename T>
void Put(std::vector<uint8_t>& out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof(T));  // little-endian hosts only (x86, arm64)
}

template <typename T>
T Get(absl::Span<const uint8_t> in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

uint64_t Checksum(const uint8_t* data, uint64_t n) {
  return transport::ChecksumFinish(transport::ChecksumPartial(data, n, 0), n);
}

}  // namespace

Nvfp4Checksums ChecksumsOf(const Nvfp4View& t) {
  const uint64_t blocks = Blocks(t.rows, t.cols);
  return {Checksum(t.packed, blocks * 8), Checksum(t.scales, blocks)};
}

absl::Status ValidateView(const Nvfp4View& t, const char* what) {
  if (t.packed == nullptr || t.scales == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null codes or scales"));
  }
  if (t.rows <= 0 || t.cols <= 0 || t.cols % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape [", t.rows, ", ", t.cols,
                                                   "] is not [rows > 0, a multiple of 16]"));
  }
  if (t.rows > std::numeric_limits<uint32_t>::max() / (t.cols / 16)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", t.rows, " x ", t.cols / 16, " blocks overflow a block index"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeltaPlan> DiffNvfp4(const Nvfp4View& base, const Nvfp4View& next,
                                    const DiffOptions& options) {
  if (absl::Status s = ValidateView(base, "base"); !s.ok()) return s;
  if (absl::Status s = ValidateView(next, "next"); !s.ok()) return s;
  DeltaPlan plan;
  const uint64_t blocks = Blocks(next.rows, next.cols);
  plan.full_bytes = blocks * 9 + 4;
  if (base.rows != next.rows || base.cols != next.cols) {
    plan.full = true;
    plan.why = absl::StrCat("the shape changed from [", base.rows, ", ", base.cols, "] to [",
                            next.rows, ", ", next.cols, "]");
    return plan;
  }
  if (Bits(base.decode_scale) != Bits(next.decode_scale)) {
    plan.full = true;
    plan.why = absl::StrCat("the global decode scale changed (", base.decode_scale, " -> ",
                            next.decode_scale, "): every block is relative to it");
    return plan;
  }
  std::vector<uint32_t> changed;
  for (uint64_t b = 0; b < blocks; ++b) {
    if (base.scales[b] != next.scales[b] ||
        std::memcmp(base.packed + 8 * b, next.packed + 8 * b, 8) != 0) {
      changed.push_back(static_cast<uint32_t>(b));
    }
  }
  plan.changed_blocks = changed.size();
  const uint64_t patch_bytes = kPatchHeaderBytes + changed.size() * kPatchBytesPerBlock;
  if (static_cast<double>(patch_bytes) > options.max_patch_fraction * plan.full_bytes) {
    plan.full = true;
    plan.why = absl::StrCat(changed.size(), " of ", blocks, " blocks changed: a patch of ",
                            patch_bytes, " bytes is over ", options.max_patch_fraction,
                            " of the full tensor's ", plan.full_bytes);
    return plan;
  }
  std::vector<uint8_t>& out = plan.patch;
  out.assign(patch_bytes, 0);
  std::memcpy(out.data(), kMagic, 4);
  Put<uint32_t>(out, 4, kFormat);
  Put<int64_t>(out, 8, next.rows);
  Put<int64_t>(out, 16, next.cols);
  Put<uint32_t>(out, 24, Bits(next.decode_scale));
  Put<uint32_t>(out, 28, static_cast<uint32_t>(changed.size()));
  const Nvfp4Checksums from = ChecksumsOf(base), to = ChecksumsOf(next);
  Put<uint64_t>(out, 32, from.codes);
  Put<uint64_t>(out, 40, from.scales);
  Put<uint64_t>(out, 48, to.codes);
  Put<uint64_t>(out, 56, to.scales);
  const size_t n = changed.size();
  uint8_t* indices = out.data() + kPatchHeaderBytes;
  uint8_t* codes = indices + 4 * n;
  uint8_t* scales = codes + 8 * n;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(indices + 4 * i, &changed[i], 4);
    std::memcpy(codes + 8 * i, next.packed + 8 * static_cast<size_t>(changed[i]), 8);
    scales[i] = next.scales[changed[i]];
  }
  return plan;
}

absl::Status ApplyNvfp4Patch(absl::Span<const uint8_t> patch, const Nvfp4Mutable& tensor) {
  const Nvfp4View view{tensor.packed, tensor.scales, tensor.decode_scale, tensor.rows, tensor.cols};
  if (absl::Status s = ValidateView(view, "tensor"); !s.ok()) return s;
  if (patch.size() < kPatchHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch: ", patch.size(), " bytes, shorter than its 64-byte header"));
  }
  if (std::memcmp(patch.data(), kMagic, 4) != 0) {
    return absl::InvalidArgumentError("patch: not a block delta (magic is not \"WPBD\")");
  }
  if (const uint32_t format = Get<uint32_t>(patch, 4); format != kFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch: format ", format, ", this receiver reads ", kFormat));
  }
  const int64_t rows = Get<int64_t>(patch, 8), cols = Get<int64_t>(patch, 16);
  if (rows != tensor.rows || cols != tensor.cols) {
    return absl::InvalidArgumentError(absl::StrCat("patch: shape [", rows, ", ", cols,
                                                   "], the tensor's is [", tensor.rows, ", ",
                                                   tensor.cols, "]"));
  }
  if (Get<uint32_t>(patch, 24) != Bits(tensor.decode_scale)) {
    return absl::InvalidArgumentError(
        "patch: its decode scale is not the tensor's (a changed global scale needs the full "
        "tensor)");
  }
  const uint64_t n = Get<uint32_t>(patch, 28);
  if (patch.size() != kPatchHeaderBytes + n * kPatchBytesPerBlock) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch: ", patch.size(), " bytes for ", n, " blocks (",
                     kPatchHeaderBytes + n * kPatchBytesPerBlock, " expected)"));
  }
  const uint64_t blocks = Blocks(rows, cols);
  const uint8_t* indices = patch.data() + kPatchHeaderBytes;
  const uint8_t* codes = indices + 4 * n;
  const uint8_t* scales = codes + 8 * n;
  std::vector<uint32_t> at(n);
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(&at[i], indices + 4 * i, 4);
    if (at[i] >= blocks || (i > 0 && at[i] <= at[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "patch: block index ", at[i], " at position ", i,
          at[i] >= blocks ? absl::StrCat(" is not below ", blocks) : " is not ascending"));
    }
  }
  const Nvfp4Checksums base{Get<uint64_t>(patch, 32), Get<uint64_t>(patch, 40)};
  const Nvfp4Checksums target{Get<uint64_t>(patch, 48), Get<uint64_t>(patch, 56)};
  if (!(ChecksumsOf(view) == base)) {
    return absl::FailedPreconditionError(
        "patch: the tensor is not the patch's base (its checksums differ): the full tensor is "
        "needed");
  }
  std::vector<uint8_t> saved(9 * n);  // the base's blocks, to put back on a bad result
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(saved.data() + 9 * i, tensor.packed + 8 * static_cast<size_t>(at[i]), 8);
    saved[9 * i + 8] = tensor.scales[at[i]];
    std::memcpy(tensor.packed + 8 * static_cast<size_t>(at[i]), codes + 8 * i, 8);
    tensor.scales[at[i]] = scales[i];
  }
  if (!(ChecksumsOf(view) == target)) {
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(tensor.packed + 8 * static_cast<size_t>(at[i]), saved.data() + 9 * i, 8);
      tensor.scales[at[i]] = saved[9 * i + 8];
    }
    return absl::DataLossError(
        "patch: the patched tensor is not the patch's target (its checksums differ): the base "
        "is kept");
  }
  return absl::OkStatus();
}

}  // namespace wpub::delta
