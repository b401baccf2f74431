// Internal to core/gpu: one publication through the GPU backend, as named phases. The
// backend (gpu_backend.cc) keeps its device resources between publications (BackendResources)
// and runs each publication as a PublicationRun:
//   ResolveInputs     every used part to a device pointer (CUDA IPC mappings in place, host
//                     parts through pinned staging, misaligned quantized parts relocated);
//   LayOutStatus      amax slots per bucket, non-finite count slots, the status block
//                     (non-finite counts | bucket checksum sums), buffers grown;
//   EnqueueStart      staging copies and the status block's reset on the compute stream;
//   CheckBeforeSending (amax first) every amax and count, one status read, the first bucket
//                     packed meanwhile; nothing is emitted before the check passes;
//   BuildBucket       bucket b's device work into staging[b % 2], `ready` recorded;
//   EmitBucket        bucket b as a device bucket (transport::DeviceBytes) through the hooks;
//                     its host copy when the transport group asks (CopyToHost);
//   Finish            one read of the status block and the completion of every transfer.
// The bucket phases live in backend_buckets.cc, the others in backend_run.cc. Not part of the
// public API.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/backend.h"
#include "core/engine/weight_pieces.h"
#include "core/gpu/backend_parts.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/sm_partition.h"
#include "core/transport/bucket.h"
#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::gpu::detail {

using HostClock = std::chrono::steady_clock;
inline double SecondsSince(HostClock::time_point t0) {
  return std::chrono::duration<double>(HostClock::now() - t0).count();
}

// Per-input tables of one publication, flat (one entry per part and per weight piece, found
// through per-input offsets) and kept by the backend between publications: a publication of
// tens of thousands of tensors then allocates (and page-faults) nothing for them once warm.
// Weight pieces (~420 bytes each, one per expert) are built when a bucket first needs them, so
// that building them overlaps the device work of earlier buckets instead of delaying the first
// launch; every quantized input is checked up front (engine::CheckWeightPieces), so building one
// later cannot fail on bad input.
struct InputTables {
  static constexpr uint32_t kNotBuilt = UINT32_MAX;
  std::vector<uint32_t> part_begin;      // [input] -> its first part entry; inputs + 1 entries
  std::vector<const uint8_t*> part_ptr;  // where the kernels read each part (device memory)
  std::vector<char> part_staged;         // 1: a host part, staged through pinned memory
  std::vector<uint32_t> piece_begin;     // [input] -> its first piece, kNotBuilt until built
  std::vector<uint32_t> piece_end;       // [input] -> one past its last piece
  std::vector<engine::WeightPiece> pieces;

  std::span<const uint8_t* const> parts(size_t input) const {
    return {part_ptr.data() + part_begin[input], part_begin[input + 1] - part_begin[input]};
  }
  const uint8_t*& part(size_t input, size_t p) { return part_ptr[part_begin[input] + p]; }
  // The pieces of a quantized input, built on first use. The span stays valid until the next
  // call (building may grow `pieces`).
  absl::StatusOr<std::span<const engine::WeightPiece>> pieces_of(
      const std::vector<engine::InputTensor>& inputs, size_t input);
};

// The backend's device resources, kept between publications. Destruction waits for the compute
// stream, then every owner releases its object.
struct BackendResources {
  BackendResources() = default;
  ~BackendResources();
  BackendResources(const BackendResources&) = delete;
  BackendResources& operator=(const BackendResources&) = delete;

  cudaStream_t compute = nullptr;  // own_stream's, or partition's when compute_sms is set
  kernels::cuda::Stream own_stream;
  std::unique_ptr<PartitionedStream> partition;
  // Per staging buffer: packed; each device reader is done with it (transport::DeviceBytes::
  // reader_done: the rollout groups of several engine families read the same bytes).
  kernels::cuda::Event ready[2];
  kernels::cuda::Event done[2][transport::kMaxDeviceReaders];
  kernels::cuda::Event status_ready;  // non-finite counts copied (amax-first mode)
  kernels::cuda::Event finished;
  kernels::cuda::Event bounce_ready;                      // a bucket's host copy landed
  kernels::cuda::Event t_begin, t_amax, t_packed, t_end;  // device timing
  GrowBuffer staging[2], scratch, amax, status, arena;
  GrowBuffer status_host{true}, host_stage{true}, bounce{true};
  bool dirty = false;  // device work of a failed publication may still run
  // Makes `stream` wait (on the device) for every reader of staging buffer k.
  absl::Status WaitReaders(cudaStream_t stream, int k) const;
  InputTables tables;  // rebuilt by every publication, capacity kept
};

class PublicationRun {
 public:
  // Everything is borrowed for the run's lifetime.
  PublicationRun(BackendResources& res, const GpuBackendOptions& options,
                 const engine::ExecutionPlan& plan, const engine::ExecutionHooks& hooks,
                 GpuTiming* timing);
  // The whole publication (gpu_backend.h states the contract); on success, the buckets'
  // checksums in index order.
  absl::StatusOr<engine::ExecutionResult> Execute(std::vector<uint64_t>* checksums);

 private:
  absl::Status ResolveInputs();
  absl::Status LayOutStatus();
  absl::Status EnqueueStart();
  absl::Status CheckBeforeSending();
  // Amax of the groups first needed by bucket b, and non-finite counts of its passed floats.
  absl::Status EnqueueChecks(size_t b);
  // Names the tensors behind non-zero counts; OK when none (or when allowed).
  absl::Status CheckNonFinite(const uint8_t* host_status, uint64_t* total) const;
  absl::StatusOr<uint8_t*> BuildBucket(size_t b);
  // Bucket b's passed-through tensors into `buf` (one gather-copy launch, 2-D copies for
  // column-concatenated parts).
  absl::Status GatherPassthrough(size_t b, uint8_t* buf);
  absl::Status EnqueueQuantize(size_t b, uint8_t* buf);
  absl::Status EmitBucket(size_t b, uint8_t* buf);
  absl::StatusOr<std::shared_ptr<const transport::Bucket>> CopyToHost(
      size_t b, const uint8_t* buf, const transport::BucketManifest& manifest);
  // Bucket b's finished checksum: its 8-byte sum read back, one counted wait.
  absl::StatusOr<uint64_t> ChecksumToHost(size_t b);
  absl::StatusOr<engine::ExecutionResult> Finish(std::vector<uint64_t>* checksums);
  kernels::cuda::LaunchLimits LimitsOf(size_t b) const;

  BackendResources& res_;
  const GpuBackendOptions& options_;
  const engine::ExecutionPlan& plan_;
  const engine::ExecutionHooks& hooks_;
  const std::vector<engine::InputTensor>& inputs_;
  GpuTiming* const timing_;
  HostSyncs syncs_;
  const cudaStream_t s_;
  const size_t num_buckets_;
  bool amax_first_ = false;

  // ResolveInputs
  std::vector<char> used_;       // [input] has an output
  std::vector<char> quantized_;  // [input] is quantized
  uint64_t host_bytes_ = 0;      // staged host parts
  struct Relocation {
    const uint8_t* from;
    uint64_t offset;  // in the arena
    uint64_t nbytes;
  };
  std::vector<Relocation> relocations_;
  // LayOutStatus
  std::vector<int64_t> group_base_;              // [amax group] -> its first slot, -1: none
  std::vector<std::vector<int>> bucket_groups_;  // [bucket] -> groups it first needs
  std::vector<int64_t> bucket_slot_begin_;       // [bucket] -> first slot; buckets + 1 entries
  std::vector<uint32_t> pass_slot_;              // [output] -> count slot, UINT32_MAX: none
  std::vector<size_t> pass_outputs_;             // count slot -> output
  uint64_t num_slots_ = 0;
  uint64_t nf_bytes_ = 0, status_bytes_ = 0, max_bucket_ = 0;
  int64_t* nf_slots_ = nullptr;
  unsigned long long* nf_pass_ = nullptr;
  unsigned long long* sum_dev_ = nullptr;
  float* amax_dev_ = nullptr;
  // Buckets
  std::vector<uint8_t*> built_;  // staging address of each bucket whose work is enqueued
  std::optional<transport::BucketManifest> first_manifest_;  // made while the host waits
};

}  // namespace wpub::gpu::detail
