// Ingestion of a publication's tensors on the host: validation of tensor inputs against their
// descriptors, copies of POSIX shared-memory ranges, inline buffers filled chunk by chunk with
// coverage tracking, and the resolved views the quantizer reads in place.
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

// Host memory the daemon owns for one part: an anonymous private mapping reserved without
// swap accounting (MAP_NORESERVE), so a declaration costs address space only and physical pages
// arrive with the bytes written into them. Zero-filled. Movable, not copyable; unmapped on
// destruction.
class HostBuffer {
 public:
  // RESOURCE_EXHAUSTED naming `tensor` when the address space cannot be reserved.
  static absl::StatusOr<HostBuffer> Allocate(uint64_t bytes, absl::string_view tensor);
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  HostBuffer(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// An open POSIX shared-memory segment (shm_open O_RDONLY), read with pread: the trainer owns
// the segment and may truncate or rewrite it at any time, which would turn a read through a
// mapping into SIGBUS (a dead daemon) or a torn publication. A pread past the segment's end is
// a short read instead, reported as an error. Closed on destruction. Not copyable.
class ShmSegment {
 public:
  // NOT_FOUND naming the tensor and segment when it does not exist; PERMISSION_DENIED or
  // INTERNAL for other failures.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(absl::string_view name,
                                                          absl::string_view tensor);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // The size when it was opened.
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }

  // Copies [offset, offset + dst.size()) into dst. INVALID_ARGUMENT naming `tensor` and the
  // segment when the segment no longer holds that range (it was truncated); INTERNAL for other
  // read errors. Blocks for the copy only.
  absl::Status ReadAt(uint64_t offset, absl::Span<uint8_t> dst, absl::string_view tensor) const;

 private:
  ShmSegment(int fd, uint64_t size, std::string name)
      : fd_(fd), size_(size), name_(std::move(name)) {}
  int fd_;
  uint64_t size_;
  std::string name_;
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
// query per part): inline buffers and shm copies are host memory; CUDA IPC mappings are
// device memory of the GPU backend's device (the IPC cache checks the device).
enum class PartMemory : uint8_t { kUnknown = 0, kHost, kDevice };

// View of one part: host bytes the daemon owns (an inline buffer, or the copy of a shm range
// made at AddBatch), or device bytes of a CUDA IPC mapping (GPU path).
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
  // copies shm ranges into buffers of its own (segments opened once per publication, ranges
  // bounds-checked against the segment size; the trainer may reuse a segment once its batch
  // was added) and reserves inline buffers. Host staging (inline + shm bytes) is bounded by
  // `max_inline_bytes` (OUT_OF_RANGE) and by the host's available memory (RESOURCE_EXHAUSTED
  // naming the tensor). All or nothing: on error nothing of the batch is kept.
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
  // Host bytes staged (inline parts and shm copies).
  uint64_t inline_bytes() const { return inline_bytes_; }

 private:
  struct InlineBuffer {
    HostBuffer bytes;
    IntervalSet written;
  };

  const uint64_t max_inline_bytes_;
  const CudaIpcResolveFn resolve_ipc_;
  std::vector<InputTensor> tensors_;
  std::vector<size_t> batch_first_;
  // Parallel to tensors_: one entry per part, null for non-inline parts.
  std::vector<std::vector<std::unique_ptr<InlineBuffer>>> inline_;
  // The copies of shm parts (views point into them).
  std::vector<HostBuffer> shm_copies_;
  std::unordered_map<std::string, std::unique_ptr<ShmSegment>> shm_;
  std::unordered_map<std::string, uint64_t> names_;  // tensor name -> batch
  uint64_t bytes_in_ = 0;
  uint64_t inline_bytes_ = 0;
  uint64_t inline_declared_ = 0;  // inline parts' sizes
  uint64_t inline_received_ = 0;  // chunk bytes copied (overlaps counted twice)
};

}  // namespace wpub::engine
