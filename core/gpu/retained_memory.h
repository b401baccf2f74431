// The GPU path's memory for the retained copy (core/transport/retained_memory.h): the committed
// version's bytes in device memory of the publishing GPU (--retain=device) or in pinned host
// memory (--retain=pinned), copied from the device buckets as they are published and emitted
// back as device buckets when the version is replayed.
//
// Buffers. A version's bytes live in one arena (its buckets at 256-byte aligned offsets, their
// checksum sums beside it on the device). At most two arenas: the retained version's and the
// one a publication stages into; at commit they swap roles, so a retaining daemon holds two
// versions' worth once it has published twice (held_bytes). An arena is reused when nothing
// else holds it (no replay still reads the version in it) and it is large enough; otherwise it
// is reallocated -- one synchronizing allocation, only when the published size grows. With
// both arenas held (the retained version and a replay of an older one) Reserve refuses.
//
// Staging, per bucket, on this memory's own stream and without a host synchronization: wait
// for the bucket's `ready`, copy its bytes (device to device, or device to pinned host), add
// its checksum on the device (of the copy in device memory; of the source, which the copy
// reproduces exactly, for pinned memory), record the bucket's `done` -- the producer reuses its
// staging buffer only after it. Seal: one host wait for the copies and the checksums.
//
// Emission for a replay: a device arena's bucket is emitted in place (its `ready` the seal's
// event, long complete; its readers' `done` events belong to the arena, and the next staging
// into it waits for them); a pinned arena's bucket is first copied into one of two device
// bounce buffers (the copy of bucket k+2 waits on the device for bucket k's readers), so the
// host-to-device copy of one bucket overlaps the broadcast of the previous one. A host copy of
// an emitted bucket (for pull receivers behind), or of any sealed bucket (HostCopy: what a
// bucket patch is diffed against), costs a device-to-host copy and one wait (device) or a
// memcpy (pinned).
//
// Patches (Patch): the staging version's bucket, once its copy is done, is diffed against the
// retained version's on the device (kernels/cuda/bucket_diff.h: xor runs), turned into units on
// the host (delta::UnitsFromXorRuns), byte for byte what delta::DiffBucket makes of host copies;
// the host waits twice (the totals, then the xor runs) on the reading receiver's thread, never
// the publication's, and only the xor runs cross PCIe. A pinned copy leaves patches to the host
// (UNIMPLEMENTED). The diff's device buffers (room for the xor runs of any patch within
// max_patch_fraction, delta::XorRunsCapacity: up to the largest bucket, and its run scratch)
// are kept and counted in held_bytes. PatchOnDevice (a sealed version's bucket against a bucket
// the producer emits, for NCCL engines that take patches) writes format 3 into one of two
// broadcast buffers of its own (each waits on the device for its previous reader), one host
// wait for the size, on the publication's thread and counted there; a bucket the producer packed
// at an offset that is not 16-byte aligned is copied to an aligned buffer first (on the device).
// StagedHostCopy reads a staging bucket back once its copy is done (a deferred bucket a receiver
// takes whole).
//
// Thread-safety: see retained_memory.h. Create the memory once; it must outlive nothing: every
// RetainedBytes it hands out keeps it alive.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "core/transport/retained_memory.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::gpu {

struct RetainedMemoryOptions {
  int device = 0;
  transport::RetainWhere where = transport::RetainWhere::kDevice;  // kDevice or kPinned
  // Host threads that turn a device diff's xor runs into the patch (delta::UnitsFromXorRuns),
  // on the reading receiver's thread and these; <= 0: the hardware's.
  int host_threads = 8;
};

class GpuRetainedMemory final : public transport::RetainedMemory,
                                public std::enable_shared_from_this<GpuRetainedMemory> {
 public:
  // INVALID_ARGUMENT for a `where` other than kDevice / kPinned; FAILED_PRECONDITION without
  // the CUDA device. Allocates nothing until the first Reserve.
  static absl::StatusOr<std::shared_ptr<GpuRetainedMemory>> Create(RetainedMemoryOptions options);
  ~GpuRetainedMemory() override;

  transport::RetainWhere where() const override { return options_.where; }
  transport::LocationSet accepts() const override { return transport::kHostOrDevice; }
  absl::StatusOr<std::shared_ptr<transport::RetainedBytes>> Reserve(
      const transport::PublicationManifest& manifest) override;
  uint64_t held_bytes() const override;

  struct Arena;  // retained_memory.cc

 private:
  class Version;
  explicit GpuRetainedMemory(RetainedMemoryOptions options) : options_(options) {}
  // A pinned version's bucket in bounce buffer `slot`, for a replay (Version::Emit).
  absl::StatusOr<std::shared_ptr<const transport::Bucket>> EmitThroughBounce(
      const std::shared_ptr<Arena>& arena, uint64_t offset, uint64_t version,
      const transport::BucketManifest& manifest);
  // The patch between two device buckets of n bytes (Version::Patch), once `next_copied` is
  // complete: diffed on diff_stream_ (kernels/cuda/bucket_diff.h), one wait for its totals and
  // one for the patch's bytes. Serialized by diff_mu_.
  absl::StatusOr<transport::RetainedPatch> Diff(const uint8_t* base, const uint8_t* next,
                                                uint64_t n, cudaEvent_t next_copied,
                                                uint64_t base_checksum, uint64_t next_checksum,
                                                double max_patch_fraction);

  // Version::PatchOnDevice's diff of `next` (a producer's device bucket) against `base`.
  // Serialized by bcast_mu_.
  absl::StatusOr<transport::DevicePatch> DiffForBroadcast(const uint8_t* base,
                                                          const transport::Bucket& next,
                                                          uint64_t base_checksum,
                                                          uint64_t next_checksum,
                                                          double max_patch_fraction);

  const RetainedMemoryOptions options_;
  kernels::cuda::Stream stream_;  // staging, sealing and bounce copies
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Arena>> arenas_;  // at most two (guarded by mu_)
  // Pinned emission: two device bounce buffers and their events (guarded by mu_).
  kernels::cuda::DeviceBuffer bounce_[2];
  kernels::cuda::Event bounce_ready_[2];
  kernels::cuda::Event bounce_done_[2][transport::kMaxDeviceReaders];
  // Patches (Diff): made one at a time; the buffers grow to the largest bucket's needs.
  mutable std::mutex diff_mu_;
  kernels::cuda::Stream diff_stream_;               // created by the first patch
  kernels::cuda::DeviceBuffer diff_patch_;          // delta::XorRunsCapacity: <= bucket + 64
  kernels::cuda::DeviceBuffer diff_scratch_;        // kernels::cuda::BucketDiffScratchBytes
  kernels::cuda::DeviceBuffer diff_totals_device_;  // one BucketDiffTotals, written by the diff
  kernels::cuda::PinnedHostBuffer diff_totals_;     // ... read back here
  // Device patches for broadcasts (DiffForBroadcast): two patch buffers, alternating, each with
  // the event its diff records (ready) and the one its reader records (done).
  mutable std::mutex bcast_mu_;
  kernels::cuda::Stream bcast_stream_;  // created by the first device patch
  kernels::cuda::DeviceBuffer bcast_patch_[2];
  kernels::cuda::Event bcast_ready_[2], bcast_done_[2];
  kernels::cuda::DeviceBuffer bcast_scratch_, bcast_totals_device_;
  // A bucket packed at an offset that is not 16-byte aligned, copied here to be diffed.
  kernels::cuda::DeviceBuffer bcast_aligned_;
  kernels::cuda::PinnedHostBuffer bcast_totals_;
  uint64_t bcast_next_ = 0;  // patches made: the next one's buffer is bcast_next_ % 2
};

}  // namespace wpub::gpu
