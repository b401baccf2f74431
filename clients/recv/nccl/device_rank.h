// One GPU of a receiving engine: its streams and its two bucket slots, and the device-side
// verification of a received bucket (the publisher's checksum kernel, read back into pinned
// memory). Every CUDA object is owned through kernels/cuda/cuda_raii.h.
//
// A slot is one bucket buffer (both slots grow together, Reserve), a device checksum
// accumulator with its pinned read-back word, and three events: `posted` and `landed` bracket
// the receive on the receive stream (timed), `verified` ends the checksum's read-back on the
// verify stream. With device checksums bucket k + 1 is received into one slot while bucket k's
// checksum is computed from the other; which slot is free is the caller's bookkeeping
// (BucketReceiver).
//
// Thread-compatible: the caller serializes the calls on one rank (BucketReceiver holds its lock
// while it enqueues); only the const queries may run beside them. Every method selects the
// rank's device on the calling thread first (httplib's pool threads start on the process
// default device). Nothing here blocks in CUDA except CopyToHost and Reserve (a cudaMalloc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "clients/recv/nccl/group_member.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::recv::nccl {

class DeviceRank {
 public:
  static constexpr int kSlots = 2;

  // Creates the rank's streams (receives at the device's greatest priority, checksums at its
  // least: core/gpu/streams.h), events and checksum words on `device`. FAILED_PRECONDITION
  // naming the device when any of them cannot be created.
  static absl::StatusOr<std::unique_ptr<DeviceRank>> Create(int device);
  // Selects the device, so every resource is released on it.
  ~DeviceRank();
  DeviceRank(const DeviceRank&) = delete;
  DeviceRank& operator=(const DeviceRank&) = delete;

  int device() const { return device_; }
  // Makes the rank's device current on the calling thread.
  absl::Status UseDevice() const;

  // Grows both slots to at least `n` bytes (contents lost; no-op when they are large enough).
  // Nothing may be in flight on either slot, and no receive of another device of this process
  // either (a cudaMalloc beside a broadcast in flight can deadlock with it). RESOURCE_EXHAUSTED
  // naming the size and device; both slots are then empty.
  absl::Status Reserve(uint64_t n);
  uint64_t slot_bytes() const { return slot_bytes_; }

  // Enqueues the receive of a bucket of `chunks` (byte sizes, summing to <= slot_bytes()) into
  // `slot` on the receive stream; no checksum, no events (the plain receive of the host-checksum
  // path and of /receive_raw).
  absl::Status EnqueueReceive(GroupMember& member, int slot, absl::Span<const uint64_t> chunks);
  // The device-checksum pipeline for one bucket in `slot`: on the receive stream, after the
  // slot's previous checksum read the buffer, `posted`, the receive and `landed`; on the verify
  // stream, after `landed`, the checksum, its read-back and `verified`. Never waits.
  absl::Status EnqueueVerifiedReceive(GroupMember& member, int slot,
                                      absl::Span<const uint64_t> chunks);
  // Enqueues vLLM's warm-up all-reduce (GroupMember::WarmUp) on the receive stream.
  absl::Status EnqueueWarmUp(GroupMember& member);
  // Enqueues on the receive stream the checksum of `slot`'s first `n` bytes and its read-back
  // (the host-copy path's other ranks, which verify without copying).
  absl::Status EnqueueChecksum(int slot, uint64_t n);

  // Copies `slot`'s first `n` bytes to *bytes (synchronous; the receive must be complete).
  absl::Status CopyToHost(int slot, uint64_t n, std::vector<uint8_t>* bytes) const;
  // The bucket's checksum (core/transport/checksum.h) from `slot`'s read-back word, once the
  // stream that read it back is past it.
  uint64_t Checksum(int slot, uint64_t n) const;
  // The device time of `slot`'s last verified receive, from `posted` to `landed`, in seconds
  // (including any wait for the publisher's broadcast to start); 0 when not measurable.
  double ReceiveDeviceSeconds(int slot) const;

  // Kept weights (ReceiverEndpointOptions::keep_weights): the engine's own copy of each bucket
  // of the last version it received, by bucket index, as an engine keeps its parameters. The
  // calls below are enqueued on the receive stream, in order.
  // Makes kept bucket `index` n bytes (allocated when missing or of another size; its contents
  // are then undefined). The same precondition as Reserve (nothing in flight on this device).
  absl::Status ReserveKept(uint32_t index, uint64_t n);
  // Whether kept bucket `index` exists with n bytes.
  bool HasKept(uint32_t index, uint64_t n) const;
  // The receive of a whole bucket into kept bucket `index`, then its checksum and read-back.
  absl::Status EnqueueKeptReceive(GroupMember& member, uint32_t index,
                                  absl::Span<const uint64_t> chunks);
  // A format 3 patch of `patch_bytes` received into slot 0 (EnqueueReceive) applied to kept
  // bucket `index` in place (kernels/cuda/bucket_diff.h: all or nothing, its validation's error
  // word read back), then the bucket's checksum and read-back.
  absl::Status EnqueueKeptPatch(uint32_t index, uint64_t n, uint64_t patch_bytes);
  // After EnqueueKeptReceive / EnqueueKeptPatch completed: the kept bucket's checksum, and
  // whether the patch was refused by its validation (the bucket then unchanged).
  uint64_t KeptChecksum(uint32_t index) const;
  bool PatchRefused() const;

  cudaStream_t receive_stream() const { return receive_.get(); }
  cudaEvent_t verified(int slot) const { return slots_[slot].verified.get(); }

 private:
  struct Slot {
    kernels::cuda::DeviceBuffer buffer;
    kernels::cuda::DeviceBuffer sum;           // device checksum accumulator (one word)
    kernels::cuda::PinnedHostBuffer sum_host;  // pinned: the read-back never pages
    kernels::cuda::Event posted;
    kernels::cuda::Event landed;
    kernels::cuda::Event verified;
  };

  explicit DeviceRank(int device) : device_(device) {}
  // The checksum and its read-back of `slot`'s first `n` bytes, on `stream`.
  cudaError_t EnqueueChecksumOn(int slot, uint64_t n, cudaStream_t stream);
  absl::Status CudaError(const char* what, cudaError_t e) const;

  const int device_;
  // Declared before the slots so they are destroyed after them: a stream outlives the events
  // and buffers its work used.
  kernels::cuda::Stream receive_;  // receives (and copies to the host)
  kernels::cuda::Stream verify_;   // checksums of received buckets
  Slot slots_[kSlots];
  uint64_t slot_bytes_ = 0;             // of each slot's buffer
  kernels::cuda::DeviceBuffer warmup_;  // EnqueueWarmUp's float, allocated on first use
  // Kept weights: one buffer per bucket index; the checksum word, the patch's error word and
  // their pinned read-backs (allocated with the first kept bucket).
  std::vector<kernels::cuda::DeviceBuffer> kept_;
  std::vector<uint64_t> kept_sizes_;        // the bucket each holds (bytes)
  kernels::cuda::DeviceBuffer kept_words_;  // checksum word, then the error word
  kernels::cuda::PinnedHostBuffer kept_words_host_;
  uint64_t kept_n_ = 0;  // the size of the bucket the checksum word sums
};

// The engine's checksum of a bucket: every rank's must agree (DATA_LOSS naming the version and
// the two devices otherwise). `sums` and `ranks` are in rank order, not empty.
absl::StatusOr<uint64_t> AgreedChecksum(const std::vector<uint64_t>& sums,
                                        const std::vector<std::unique_ptr<DeviceRank>>& ranks,
                                        const std::string& version);

}  // namespace wpub::recv::nccl
