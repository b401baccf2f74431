// The flattened-bucket weight-update request: the body of SGLang's
// `/update_weights_from_distributed` with `load_format: "flattened_bucket"`
// (docs/specs/engines.md): the bucket's tensors as three parallel arrays (names, dtypes, shapes),
// laid back to back in the broadcast buffer in that order, plus the request's scalar fields. The
// publisher encodes one per bucket (thousands of tensors each, 56,000 per publication of a 30B MoE
// model) and a C++ engine (nccl::ReceiverEndpoint) decodes it before it posts its receive, so both
// sides are on the per-bucket critical path: encoding writes the JSON text directly (strings that
// need escaping go through nlohmann::json), decoding uses simdjson's on-demand parser.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/types.h"

namespace wpub::rollout {

// `wpub_patch` (wpub's own engines, whose server info lists format 3 in
// "wpub_bucket_patches": nccl::ReceiverEndpoint): the request's broadcast carries not the
// bucket but its format 3 patch (core/delta/bucket_patch.h), `bytes` long, against the
// engine's copy of the bucket in version `base_version` -- the copy whose checksum
// (core/transport/checksum.h) is `base_checksum`; the patched bucket must have
// `target_checksum`, else the engine restores its copy and fails the request.
struct UpdatePatch {
  uint64_t base_version = 0;
  uint64_t base_checksum = 0;
  uint64_t target_checksum = 0;
  uint64_t bytes = 0;
  bool operator==(const UpdatePatch&) const = default;
};

struct UpdateRequestFields {
  std::string group_name;
  bool flush_cache = false;
  // Empty: the field is not sent (SGLang would adopt even "" as the version it serves).
  std::string weight_version;
  std::string load_format = "flattened_bucket";  // empty: the field is not sent
  // `wpub_sequence`: the bucket's index within its publication, for engines that take several
  // requests in flight and must receive them in order; -1: the field is not sent.
  int64_t sequence = -1;
  // `wpub_patch` (above); nullopt: the field is not sent, the broadcast carries the bucket.
  std::optional<UpdatePatch> patch;
};

// The request body as one JSON object. Tensor names are UTF-8 (ingestion checks); a byte
// sequence that is not is replaced with U+FFFD rather than failing the publication.
std::string EncodeUpdateRequest(const std::vector<transport::ManifestTensor>& tensors,
                                const UpdateRequestFields& fields);

struct UpdateRequest {
  UpdateRequestFields fields;  // load_format and flush_cache as sent (defaults when absent)
  // Offsets and sizes laid out back to back from the dtypes and shapes.
  std::vector<transport::ManifestTensor> tensors;
  uint64_t nbytes = 0;  // the bucket's size: the sum of the tensors' sizes
};

// INVALID_ARGUMENT for a body that is not one JSON object, for names/dtypes/shapes missing or
// not arrays of one length, and (naming the tensor by index and name) for a name or dtype that
// is not a string, an unknown dtype, or a shape that is not a list of non-negative integers;
// for a wpub_sequence that is not an integer in [0, 2^31]; for a wpub_patch that is not an object
// of the four unsigned integers (naming the field). Other fields are optional; fields
// this decoder does not know are ignored.
absl::StatusOr<UpdateRequest> DecodeUpdateRequest(std::string_view body);

}  // namespace wpub::rollout
