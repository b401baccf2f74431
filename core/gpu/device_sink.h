// Where the GPU backend hands device-resident buckets: a push transport (the NCCL
// weight-update group, core/nccl) implements this next to engine::Transport, so a bucket goes
// from the backend's staging buffer to the engines without visiting the host.
//
// Contract: called by the backend's (single) publication thread, buckets in index order, after
// Transport::Begin. SendDevice only ENQUEUES: the transfer must start after `ready` (recorded
// on the backend's compute stream when the bucket is packed) and `done` must be recorded on
// the sink's stream after the transfer, so the backend can reuse the staging buffer (it makes
// its compute stream wait on `done`, on the device) and await completion once at the end.
// SendDevice may block only while the group is forming (bounded by its deadline) and never
// synchronizes the device. A non-OK status stops the backend's Execute. The sink only reads
// `data`: the backend's compute stream may still read the bucket after `ready` (its checksum
// runs beside the transfer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/engine/types.h"

namespace wpub::gpu {

class DeviceBucketSink {
 public:
  virtual ~DeviceBucketSink() = default;
  virtual absl::Status SendDevice(const engine::BucketManifest& manifest, const void* data,
                                  uint64_t nbytes, cudaEvent_t ready, cudaEvent_t done) = 0;
};

}  // namespace wpub::gpu
