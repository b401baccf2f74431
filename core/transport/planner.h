// The bucket planner: lays a publication's output tensors out in SGLang's flattened-bucket
// layout. Tensors are grouped into buckets of at most `bucket_bytes` in publication order (the
// outputs of one input tensor -- a passed tensor, or the three NVFP4 outputs of a quantized
// one -- always share a bucket, so a quantizer writes them in place); a unit larger than a
// bucket gets a bucket of its own. Inside a bucket the tensors lie back to back with no padding,
// ordered by element size, largest first (8-, 4-, 2-, then 1-byte dtypes; stable otherwise), so
// every offset is a multiple of its element size. Pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"
#include "core/transport/types.h"

namespace wpub::transport {

// One output tensor inside a bucket: outputs[output] at [offset, offset + nbytes).
struct PlacedTensor {
  size_t output = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

struct BucketLayout {
  uint32_t index = 0;
  uint64_t nbytes = 0;
  std::vector<PlacedTensor> tensors;  // in offset order
};

// `outputs` in publication order; `unit_sizes` splits them into consecutive units that must
// share a bucket (their sum must equal outputs.size()). INVALID_ARGUMENT for bucket_bytes == 0
// or inconsistent unit sizes.
absl::StatusOr<std::vector<BucketLayout>> PlanBuckets(absl::Span<const TensorDesc> outputs,
                                                      absl::Span<const uint32_t> unit_sizes,
                                                      uint64_t bucket_bytes);

// Checks the layout invariants: every output placed exactly once, buckets indexed 0..n-1,
// tensors back to back from offset 0 without gaps or overlap, each offset a multiple of its
// element size, nbytes matching the desc, and no bucket above bucket_bytes unless it holds a
// single unit. INTERNAL naming the bucket and tensor on violation.
absl::Status CheckLayout(absl::Span<const BucketLayout> buckets,
                         absl::Span<const TensorDesc> outputs,
                         absl::Span<const uint32_t> unit_sizes, uint64_t bucket_bytes);

// The manifest entry of one bucket (checksum left 0).
BucketManifest MakeBucketManifest(const BucketLayout& layout, absl::Span<const TensorDesc> outputs);

}  // namespace wpub::transport
