// Ingestion of a publication's tensors on the host: validation of tensor inputs against their
// descriptors, read-only POSIX shared-memory mappings, inline buffers filled chunk by chunk with
// coverage tracking, and the resolved host views the quantizer reads in place.
// Thread-compatible: an InputStore belongs to one publication and is driven by its one
// producer thread; after CheckComplete it is only read.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"
#include "core/engine/types.h"

namespace wpub::engine {

// Shared-memory names: non-empty, at most 255 bytes, one optional leading '/', no other '/',
// no "..", no NUL. INVALID_ARGUMENT naming `tensor` otherwise.
absl::Status ValidateShmName(absl::string_view name, absl::string_view tensor);

// A read-only mapping of a whole POSIX shared-memory segment (shm_open O_RDONLY + mmap
// PROT_READ, MAP_SHARED). Unmapped on destruction. Not copyable.
class ShmMapping {
 public:
  // NOT_FOUND naming the tensor and segment when it does not exist; PERMISSION_DENIED or
  // INTERNAL for other failures.
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Open(absl::string_view name,
                                                          absl::string_view tensor);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  ShmMapping(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  const uint8_t* data_;
  uint64_t size_;
};

// Byte ranges written so far into one inline part (overlaps merge).
class IntervalSet {
 public:
  void Add(uint64_t begin, uint64_t end);
  // True when [0, size) is fully covered.
  bool Covers(uint64_t size) const;
  // First missing byte offset in [0, size), or size when complete.
  uint64_t FirstGap(uint64_t size) const;

 private:
  std::map<uint64_t, uint64_t> ranges_;  // begin -> end, disjoint, non-adjacent
};

// Where a part's bytes live, when the ingestion knows it (the GPU backend then needs no pointer
// query per part): inline buffers and shm mappings are host memory; CUDA IPC mappings are
// device memory of the GPU backend's device (the IPC cache checks the device).
enum class PartMemory : uint8_t { kUnknown = 0, kHost, kDevice };

// View of one part: host bytes in an inline buffer or a shm mapping, or device bytes of a
// CUDA IPC mapping (GPU path).
struct PartView {
  const uint8_t* data = nullptr;
  Shape shape;
  uint64_t nbytes = 0;
  PartMemory memory = PartMemory::kUnknown;
};

// A validated, resolved input tensor.
struct InputTensor {
  TensorDesc desc;
  int concat_dim = 0;
  std::vector<PartView> parts;
  uint64_t batch = 0;           // conversion batch index
  uint32_t index_in_batch = 0;  // position within the batch
};

// Checks one tensor input against its desc, without touching any bytes: known dtype, non-empty
// name, non-negative dims, at least one part, concat_dim 0/1 within the rank, parts' shapes
// consistent with the desc, shm lengths equal to the part's byte size, shm names valid, CUDA
// IPC lengths equal to the part's byte size -- or CUDA IPC rejected with UNIMPLEMENTED when
// `cuda_ipc` is false (the CPU path). Messages name the tensor and part.
absl::Status ValidateTensorInput(const TensorInput& input, bool cuda_ipc = false);

// Maps a CUDA IPC part to a device pointer the backend reads in place; errors name `tensor`.
// Null when the engine has no CUDA IPC resolver (the CPU path).
using CudaIpcResolveFn = std::function<absl::StatusOr<const uint8_t*>(
    const CudaIpcSource& source, uint64_t expected_bytes, absl::string_view tensor)>;

class InputStore {
 public:
  explicit InputStore(uint64_t max_inline_bytes, CudaIpcResolveFn resolve_ipc = nullptr)
      : max_inline_bytes_(max_inline_bytes), resolve_ipc_(std::move(resolve_ipc)) {}

  // Validates and resolves every tensor of batch `batch` (which must be the next batch index):
  // maps shm segments (once per segment per publication, bounds-checked against the segment
  // size) and allocates inline buffers. All or nothing: on error nothing of the batch is kept.
  absl::Status AddBatch(uint64_t batch, absl::Span<const TensorInput> tensors);

  // Copies a chunk into an inline part (see PublicationSession::AppendInline).
  absl::Status AppendInline(uint64_t batch, uint32_t tensor, uint32_t part, uint64_t offset,
                            absl::Span<const uint8_t> bytes);

  // INVALID_ARGUMENT naming the first tensor/part whose inline bytes are incomplete.
  absl::Status CheckComplete() const;

  const std::vector<InputTensor>& tensors() const { return tensors_; }
  uint64_t num_batches() const { return batch_first_.size(); }
  // Flat index of tensor `tensor` of batch `batch`.
  size_t FlatIndex(uint64_t batch, uint32_t tensor) const { return batch_first_[batch] + tensor; }
  uint64_t bytes_in() const { return bytes_in_; }
  uint64_t inline_bytes() const { return inline_bytes_; }

 private:
  struct InlineBuffer {
    std::unique_ptr<uint8_t[]> bytes;
    uint64_t size = 0;
    IntervalSet written;
  };

  const uint64_t max_inline_bytes_;
  const CudaIpcResolveFn resolve_ipc_;
  std::vector<InputTensor> tensors_;
  std::vector<size_t> batch_first_;
  // Parallel to tensors_: one entry per part, null for non-inline parts.
  std::vector<std::vector<std::unique_ptr<InlineBuffer>>> inline_;
  std::unordered_map<std::string, std::unique_ptr<ShmMapping>> shm_;
  std::unordered_map<std::string, uint64_t> names_;  // tensor name -> batch
  uint64_t bytes_in_ = 0;
  uint64_t inline_bytes_ = 0;
};

}  // namespace wpub::engine
