// A packed bucket and where its bytes live. Every backend emits every bucket through one call
// (ExecutionHooks::emit); the bucket says whether its bytes are in host memory (the CPU backend)
// or in device memory (the GPU backend's staging buffers), each transport says which locations
// it takes (TransportCapabilities::accepts), and the transport group (transport_group.h) hands
// each transport the bucket as it is -- a device bucket to each of up to kMaxDeviceReaders
// device readers, each with a `done` event of its own -- or, for a transport that takes host
// bytes only, the one host copy the bucket's producer makes on request. No CUDA here: device
// handles are the CUDA runtime's opaque pointers, declared, never dereferenced.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/transport/types.h"

// The CUDA runtime's event type (cudaEvent_t is `CUevent_st*`).
struct CUevent_st;

namespace wpub::transport {

enum class BucketLocation : uint8_t {
  kHost = 1,    // Bucket::bytes
  kDevice = 2,  // Bucket::device
};

// A set of locations (TransportCapabilities::accepts): bitwise or of BucketLocation values.
using LocationSet = uint8_t;
inline constexpr LocationSet kHostOnly = static_cast<LocationSet>(BucketLocation::kHost);
inline constexpr LocationSet kHostOrDevice = static_cast<LocationSet>(BucketLocation::kHost) |
                                             static_cast<LocationSet>(BucketLocation::kDevice);
inline bool Contains(LocationSet set, BucketLocation l) {
  return (set & static_cast<LocationSet>(l)) != 0;
}

struct Bucket;

// How many transports of one publication may read a bucket's device bytes (one per engine
// family's rollout group, with room to spare); a further device reader takes the host copy.
inline constexpr size_t kMaxDeviceReaders = 4;

// Device-resident bucket bytes, lent by the producer (the GPU backend) for one emit call.
// Contract for a transport that reads them: it enqueues its reads after `ready` (recorded on the
// producer's stream once the bytes are final) and records `done` after its last read, on its own
// stream, without synchronizing the host; the producer reuses the memory only after every
// reader's `done` (on the device). Never freed by the reader. Several readers read concurrently,
// each on its own stream: the transport group gives reader k a copy of the bucket whose `done`
// is `reader_done[k]`.
struct DeviceBytes {
  const uint8_t* data = nullptr;
  int device = 0;
  CUevent_st* ready = nullptr;
  CUevent_st* done = nullptr;  // what this reader records (as emitted: reader_done[0])
  // The producer's events, one per device reader it waits for (null from the first it does not
  // provide: at most that many readers get device bytes). A wait on an event that was never
  // recorded, or recorded for an earlier bucket and long complete, is free.
  std::array<CUevent_st*, kMaxDeviceReaders> reader_done{};
  // The bucket in host memory (bytes and the manifest's checksum filled in): one device-to-host
  // copy and one counted host synchronization by the producer. Valid only during the emit call
  // that carries this bucket; the transport group calls it at most once per bucket, and only
  // when a transport that takes host bytes only has participants.
  std::function<absl::StatusOr<std::shared_ptr<const Bucket>>()> copy_to_host;
  // The bucket's checksum (core/transport/checksum.h), without its bytes: one 8-byte
  // device-to-host copy and one counted host synchronization. Valid as copy_to_host is; null
  // where the manifest already carries the checksum (a sealed version's replay).
  std::function<absl::StatusOr<uint64_t>()> checksum_to_host;
  // Counts one host synchronization a reader made on the publication's thread for this bucket
  // (a device patch's size read back, RetainedBytes::PatchOnDevice) in the producer's
  // publication (wpub_host_syncs_total). Valid as copy_to_host is; may be null (nothing to count
  // into).
  std::function<void()> count_host_wait;
};

// The bytes of `manifest` for publication `version`, in one location. Immutable once emitted;
// host buckets are shared between the engine and readers (the pull transport hands the same
// object to every receiver) and live as long as their last shared_ptr. A device bucket's
// manifest carries checksum 0 (the checksum is computed on the device and read once at the
// end); its host copy carries the checksum.
struct Bucket {
  uint64_t version = 0;
  BucketManifest manifest;
  BucketLocation location = BucketLocation::kHost;
  std::vector<uint8_t> bytes;  // kHost: manifest.nbytes bytes (a patch: the patch's bytes)
  DeviceBytes device;          // kDevice
  // Non-zero: `bytes` are a patch (core/delta/bucket_patch.h) that makes this bucket of a
  // receiver's copy of version `patch_base`; the manifest (nbytes, checksum) is the whole
  // bucket's. Only the pull transport hands such buckets out (Subscription::ReadBucket).
  uint64_t patch_base = 0;
  // kHost without bytes (`bytes` empty, the manifest's checksum set): what the transport group
  // hands a transport that defers a device bucket's bytes (Transport::DefersBytes) instead of
  // its host copy -- the pull transport, when every participant takes patches, reads the bytes
  // later, only if a receiver needs them whole, from where the engine keeps the version.
  bool bytes_deferred = false;
  absl::Span<const uint8_t> span() const { return absl::MakeConstSpan(bytes); }
};

}  // namespace wpub::transport
