// Bucket planning in the flattened-bucket layout (see planner.h).
#include "core/transport/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace wpub::transport {

absl::StatusOr<std::vector<BucketLayout>> PlanBuckets(absl::Span<const TensorDesc> outputs,
                                                      absl::Span<const uint32_t> unit_sizes,
                                                      uint64_t bucket_bytes) {
  if (bucket_bytes == 0) return absl::InvalidArgumentError("bucket_bytes must be positive");
  uint64_t total = 0;
  for (uint32_t n : unit_sizes) {
    if (n == 0) return absl::InvalidArgumentError("planner: empty unit");
    total += n;
  }
  if (total != outputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner: units cover ", total, " outputs, ", outputs.size(), " given"));
  }

  // Group units into buckets in order.
  std::vector<std::vector<size_t>> groups;  // output indices per bucket, publication order
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  size_t first = 0;
  for (uint32_t n : unit_sizes) {
    uint64_t unit_bytes = 0;
    for (size_t i = first; i < first + n; ++i) unit_bytes += outputs[i].nbytes();
    if (!current.empty() && current_bytes + unit_bytes > bucket_bytes) {
      groups.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    for (size_t i = first; i < first + n; ++i) current.push_back(i);
    current_bytes += unit_bytes;
    if (current_bytes >= bucket_bytes) {  // full, or an oversize unit alone
      groups.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    first += n;
  }
  if (!current.empty()) groups.push_back(std::move(current));

  std::vector<BucketLayout> buckets;
  buckets.reserve(groups.size());
  for (auto& group : groups) {
    // Largest element first: every offset is then a sum of sizes that are multiples of the
    // current element size.
    std::stable_sort(group.begin(), group.end(), [&](size_t a, size_t b) {
      return DTypeSize(outputs[a].dtype) > DTypeSize(outputs[b].dtype);
    });
    BucketLayout layout;
    layout.index = static_cast<uint32_t>(buckets.size());
    for (size_t i : group) {
      const uint64_t n = static_cast<uint64_t>(outputs[i].nbytes());
      layout.tensors.push_back(PlacedTensor{i, layout.nbytes, n});
      layout.nbytes += n;
    }
    buckets.push_back(std::move(layout));
  }
  return buckets;
}

absl::Status CheckLayout(absl::Span<const BucketLayout> buckets,
                         absl::Span<const TensorDesc> outputs,
                         absl::Span<const uint32_t> unit_sizes, uint64_t bucket_bytes) {
  std::vector<int> placed(outputs.size(), 0);
  std::vector<size_t> unit_of(outputs.size(), 0);
  {
    size_t first = 0;
    for (size_t u = 0; u < unit_sizes.size(); ++u) {
      for (size_t i = first; i < first + unit_sizes[u] && i < outputs.size(); ++i) unit_of[i] = u;
      first += unit_sizes[u];
    }
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketLayout& layout = buckets[b];
    if (layout.index != b) {
      return absl::InternalError(absl::StrCat("bucket ", b, " has index ", layout.index));
    }
    uint64_t offset = 0;
    bool single_unit = true;
    for (const PlacedTensor& t : layout.tensors) {
      if (t.output >= outputs.size()) {
        return absl::InternalError(absl::StrCat("bucket ", b, ": output ", t.output, " unknown"));
      }
      const TensorDesc& desc = outputs[t.output];
      if (t.offset != offset) {
        return absl::InternalError(absl::StrCat("bucket ", b, ": tensor ", desc.name, " at offset ",
                                                t.offset, ", expected ", offset));
      }
      if (t.offset % static_cast<uint64_t>(DTypeSize(desc.dtype)) != 0) {
        return absl::InternalError(absl::StrCat("bucket ", b, ": tensor ", desc.name, " (",
                                                DTypeName(desc.dtype), ") at offset ", t.offset,
                                                " is not aligned to its element size"));
      }
      if (t.nbytes != static_cast<uint64_t>(desc.nbytes())) {
        return absl::InternalError(
            absl::StrCat("bucket ", b, ": tensor ", desc.name, " nbytes ", t.nbytes));
      }
      if (++placed[t.output] != 1) {
        return absl::InternalError(absl::StrCat("tensor ", desc.name, " placed twice"));
      }
      if (unit_of[t.output] != unit_of[layout.tensors.front().output]) single_unit = false;
      offset += t.nbytes;
    }
    if (offset != layout.nbytes) {
      return absl::InternalError(
          absl::StrCat("bucket ", b, ": nbytes ", layout.nbytes, " but tensors cover ", offset));
    }
    if (layout.nbytes > bucket_bytes && !single_unit) {
      return absl::InternalError(absl::StrCat("bucket ", b, " holds ", layout.nbytes, " bytes (> ",
                                              bucket_bytes, ") in several units"));
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (placed[i] != 1) {
      return absl::InternalError(absl::StrCat("tensor ", outputs[i].name, " not placed"));
    }
  }
  return absl::OkStatus();
}

BucketManifest MakeBucketManifest(const BucketLayout& layout,
                                  absl::Span<const TensorDesc> outputs) {
  BucketManifest m;
  m.index = layout.index;
  m.nbytes = layout.nbytes;
  m.tensors.reserve(layout.tensors.size());
  for (const PlacedTensor& t : layout.tensors) {
    const TensorDesc& d = outputs[t.output];
    m.tensors.push_back(ManifestTensor{d.name, d.dtype, d.shape, t.offset, t.nbytes});
  }
  return m;
}

}  // namespace wpub::transport
