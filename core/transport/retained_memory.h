// Where a retained version's bytes live when they are not the emitted host buckets kept by
// reference (retained_copy.h): device memory or pinned host memory, which the GPU layer provides
// (core/gpu/retained_memory.h). This header is the contract, free of CUDA, so that the retained
// copy and its tests build without a GPU.
//
// Per publication the retained copy reserves one RetainedBytes for the version it stages, hands
// it each bucket as it is sent (Stage: an enqueued copy, no host synchronization), and seals it
// when the version commits (Seal: the one wait for the copies, the checksums of the copied
// bytes). A sealed RetainedBytes is the retained version's bytes: immutable, emitted bucket by
// bucket to a replay as a producer emits them (Emit: device buckets the engines' broadcasts read
// directly, with the events of core/transport/bucket.h and a host copy for pull receivers).
//
// A patch source (core/engine) asks the memory for a bucket patch between the retained version
// and the one staging (Patch): the GPU layer diffs the two device copies on the device and brings
// back only the patch, so a delta publication reads no bucket back to the host.
//
// Thread-safety: RetainedMemory::Reserve and held_bytes from any thread. A RetainedBytes is
// staged and sealed by one thread (the publication's) and emitted by one replay at a time (the
// engine's ledger serializes replays and publications); HostCopy from any thread once sealed;
// Patch from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/transport/bucket.h"
#include "core/transport/types.h"

namespace wpub::transport {

// A bucket patch made where a version's bytes live (RetainedBytes::Patch).
struct RetainedPatch {
  bool made = false;           // false: the bucket goes whole (why says why)
  std::string why;             // "" when made
  std::vector<uint8_t> bytes;  // the patch (core/delta/bucket_patch.h, format 2) when made
  uint64_t changed_words = 0;  // 8-byte words that differ (where the memory counts them)
  uint32_t runs = 0;           // runs of them
  uint64_t changed_units = 0;  // 16-bit units that differ (when made)
};

// A bucket patch made on the device for a broadcast (RetainedBytes::PatchOnDevice).
struct DevicePatch {
  bool made = false;  // false: the bucket goes whole (why says why)
  std::string why;    // "" when made
  // When made: the format 3 patch (core/delta/bucket_patch.h) as a device bucket -- the
  // bucket's version and index, manifest.nbytes the patch's size (no tensors: the whole
  // bucket's manifest is the caller's) -- readable after device.ready, its reader recording
  // device.done behind its last read (the memory's next use of that buffer waits for it on
  // the device).
  std::shared_ptr<const Bucket> patch;
  uint64_t changed_words = 0;  // 8-byte words that differ
  uint32_t runs = 0;           // runs of them
};

class RetainedBytes {
 public:
  virtual ~RetainedBytes() = default;
  // Enqueues the copy of `bucket` (index order; its manifest's index and size are those of the
  // reserved manifest) into this version's memory: a device bucket's bytes after its `ready`,
  // its `done` recorded behind the copy; a host bucket's bytes. No host synchronization.
  // INTERNAL naming the bucket for a bucket out of order or of the wrong size, or a CUDA error.
  virtual absl::Status Stage(const Bucket& bucket) = 0;
  // Waits for every staged copy and returns each bucket's checksum of the bytes as copied
  // (core/transport/checksum.h), index order. The bytes never change afterwards.
  // FAILED_PRECONDITION when not every bucket was staged; INTERNAL on a CUDA error.
  virtual absl::StatusOr<std::vector<uint64_t>> Seal() = 0;
  // Bucket `manifest.index` of the sealed version for a replay, as a producer emits it: where
  // the transports read it (bucket.h's DeviceBytes, with a host copy on request) and its
  // manifest (the checksum included). Called in index order by one replay at a time; a bucket
  // stays readable until its readers' `done` events, which the next Emit respects.
  virtual absl::StatusOr<std::shared_ptr<const Bucket>> Emit(uint64_t version,
                                                             const BucketManifest& manifest) = 0;
  // Bucket `manifest.index` of the sealed version in host memory (a copy), for work on the
  // host (a bucket patch's diff). Any thread, concurrently with each other and with Emit.
  virtual absl::StatusOr<std::shared_ptr<const Bucket>> HostCopy(
      uint64_t version, const BucketManifest& manifest) = 0;
  // The bucket patch that makes bucket `next.index` of `base` -- a sealed version of the same
  // memory, that bucket of the same size -- into that bucket of this version, made without a
  // host copy of either: byte for byte what delta::DiffBucket makes of the two buckets with
  // checksums `base.checksum` and `next_checksum` (format 2), or made = false exactly when
  // DiffBucket would send the bucket whole under `max_patch_fraction`. This version may still be
  // staging: the call waits up to `wait` for that bucket's copy (DEADLINE_EXCEEDED after it, or
  // when the staging stopped). Any thread, one patch at a time per memory (callers queue),
  // concurrently with Stage, Emit and HostCopy. UNIMPLEMENTED where the memory cannot (the caller
  // diffs host copies instead: the default).
  virtual absl::StatusOr<RetainedPatch> Patch(const RetainedBytes& base,
                                              const BucketManifest& base_bucket,
                                              const BucketManifest& next, uint64_t next_checksum,
                                              double max_patch_fraction, absl::Duration wait) {
    (void)base, (void)base_bucket, (void)next, (void)next_checksum, (void)max_patch_fraction,
        (void)wait;
    return absl::UnimplementedError("this retained memory makes no patches");
  }
  // Bucket `manifest.index` of this version while it stages (or once sealed) in host memory (a
  // copy, carrying `manifest`), once that bucket's copy is done: waits up to `wait` as Patch
  // does (DEADLINE_EXCEEDED after it, or when the staging stopped first). For a pull receiver
  // that takes whole a bucket the transport took without its bytes. Any thread, concurrently
  // with Stage, Patch and Emit. UNIMPLEMENTED where the memory cannot (the default).
  virtual absl::StatusOr<std::shared_ptr<const Bucket>> StagedHostCopy(
      uint64_t version, const BucketManifest& manifest, absl::Duration wait) {
    (void)version, (void)manifest, (void)wait;
    return absl::UnimplementedError("this retained memory reads no staging bucket back");
  }
  // The format 3 patch that makes bucket `base_bucket.index` of this sealed version into
  // `next`, a device bucket of the same size as the producer emits it (read after its `ready`;
  // its `done` recorded behind the diff), for the NCCL engines that take patches
  // (core/rollout/rollout_group.h): byte for byte what delta::DiffBucket makes with
  // .format = kIndexedUnits and checksums base_bucket.checksum / next_checksum, or made =
  // false exactly when DiffBucket would send the bucket whole under max_patch_fraction. The
  // diff runs on the device; the host waits once, for the patch's size (counted through
  // next.device.count_host_wait). Called by one thread (the publication's) in bucket order; the
  // patch buffers alternate, so the patch of bucket k + 2 waits on the device for bucket k's
  // reader. UNIMPLEMENTED where the memory cannot (pinned or host bytes: the default).
  virtual absl::StatusOr<DevicePatch> PatchOnDevice(const BucketManifest& base_bucket,
                                                    const Bucket& next, uint64_t next_checksum,
                                                    double max_patch_fraction) {
    (void)base_bucket, (void)next, (void)next_checksum, (void)max_patch_fraction;
    return absl::UnimplementedError("this retained memory makes no device patches");
  }
  // No further bucket will be staged (the staging stopped, or the publication aborted): a Patch
  // waiting for one returns DEADLINE_EXCEEDED now. Any thread.
  virtual void Abandon() {}
};

class RetainedMemory {
 public:
  virtual ~RetainedMemory() = default;
  // kDevice or kPinned.
  virtual RetainWhere where() const = 0;
  // What Stage takes (kHostOrDevice for the GPU layer's memory).
  virtual LocationSet accepts() const = 0;
  // Memory for one version of `manifest` (the sum of its buckets, each aligned). Errors, with
  // nothing reserved: RESOURCE_EXHAUSTED naming the bytes when they cannot be had (the
  // allocation failed, or every buffer is still held by the retained version and a replay of an
  // older one); INTERNAL on a CUDA error. The retained copy then keeps nothing of that version.
  virtual absl::StatusOr<std::shared_ptr<RetainedBytes>> Reserve(
      const PublicationManifest& manifest) = 0;
  // The bytes this memory holds now: the retained version's buffer, the one a publication
  // stages into (kept for the next one), the replay's bounce buffers.
  virtual uint64_t held_bytes() const = 0;
};

}  // namespace wpub::transport
