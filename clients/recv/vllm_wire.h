// vLLM's weight-transfer request bodies as a vLLM engine decodes them (the dev-mode routes of
// `vllm serve --weight-transfer-config`; docs/specs/engines.md, "vLLM"): init, update and finish
// bodies, vLLM's packed chunks, and the ncclUniqueId pickle its rendezvous stores. What
// VllmEngine (vllm_engine.h) serves with, and what the CPU tests check a publisher's requests
// against. Nothing here runs what it reads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/transport/types.h"

namespace wpub::recv {

struct VllmInitInfo {
  std::string master_address;
  int master_port = 0;
  int rank_offset = 1;
  int world_size = 2;
  bool packed = false;  // given in init_info (packing_in_init) or per update
  uint64_t packed_buffer_size_bytes = uint64_t{1} << 30;  // vLLM's default when not given
  int packed_num_buffers = 2;
};

// One /update_weights: the tensors back to back (offsets from the dtypes and shapes, in request
// order), and the broadcasts that carry them.
struct VllmUpdate {
  std::vector<transport::ManifestTensor> tensors;
  uint64_t nbytes = 0;
  std::vector<uint64_t> chunks;  // byte sizes, in order, summing to nbytes
};

// vLLM's packed chunks of tensors of `sizes` bytes (request order): a chunk closes after the
// tensor that takes it past `limit`; the rest is the last chunk. Computed here from the request
// alone, as vLLM's receiver does, independently of the publisher's planner.
std::vector<uint64_t> VllmChunks(absl::Span<const uint64_t> sizes, uint64_t limit);

// The request bodies. INVALID_ARGUMENT naming the field (and the tensor by index and name) for a
// body that is not the route's JSON object, missing or mistyped fields, arrays of different
// lengths, an unknown dtype name, a negative dimension, a size past 2^48 bytes, or packing
// fields where this release does not take them (`packing_allowed`).
absl::StatusOr<VllmInitInfo> DecodeVllmInit(std::string_view body, bool packing_allowed);
// `init` supplies the packing of releases that take it at init; an update's own packing fields
// are refused unless `packing_allowed`.
absl::StatusOr<VllmUpdate> DecodeVllmUpdate(std::string_view body, const VllmInitInfo& init,
                                            bool packing_allowed);

// The ncclUniqueId in a pickle of vLLM's ctypes `ncclUniqueId` (what StatelessProcessGroup's
// broadcast_obj stores for the workers): pickle protocols 3 to 5 as Python writes a ctypes
// Structure (`_ctypes._unpickle(cls, (state, bytes))`). Walks the opcodes it knows and refuses
// any other (INVALID_ARGUMENT naming it), a class other than ncclUniqueId, and anything but
// exactly one 128-byte bytes object; nothing is executed.
absl::StatusOr<std::vector<uint8_t>> DecodeVllmUniqueIdPickle(std::string_view pickle);

// A route's body as the engine reads one it takes no field of: INVALID_ARGUMENT naming the
// route unless it is empty or a JSON object within the request bounds.
absl::Status CheckVllmBody(std::string_view body, const char* route);
// /finish_weight_update's body: its weight_version (nullopt when absent or null);
// INVALID_ARGUMENT for a body CheckVllmBody refuses or a version that is not a string.
absl::StatusOr<std::optional<std::string>> DecodeVllmFinish(std::string_view body);

}  // namespace wpub::recv
