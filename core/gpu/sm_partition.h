// A stream whose kernels may use only part of a device's SMs (a CUDA green context), so that
// the rest stay free for kernels of other streams. The GPU backend runs its compute stream in
// one when GpuBackendOptions::compute_sms is set, leaving SMs to the bucket broadcasts: on H200,
// 112-120 of 132 SMs for quantize/pack shortened a publication by about 5% (bench/RESULTS.md).
// The driver entry points are looked up at run time (nothing links libcuda).
//
// Thread-compatible. Destruction synchronizes the stream, then destroys it and the context.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"

namespace wpub::gpu {

class PartitionedStream {
 public:
  // A non-blocking stream of `priority` on `device` whose kernels use at most `sms` SMs (rounded
  // up to the device's partition granularity; sms() says how many). INVALID_ARGUMENT for sms < 1
  // or more than the device has; FAILED_PRECONDITION where the driver has no green contexts.
  static absl::StatusOr<std::unique_ptr<PartitionedStream>> Create(int device, int sms,
                                                                   int priority = 0);
  ~PartitionedStream();
  PartitionedStream(const PartitionedStream&) = delete;
  PartitionedStream& operator=(const PartitionedStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  int sms() const { return sms_; }

 private:
  struct Driver;
  PartitionedStream() = default;
  void* context_ = nullptr;  // CUgreenCtx
  cudaStream_t stream_ = nullptr;
  int sms_ = 0;
  std::unique_ptr<const Driver> driver_;
};

}  // namespace wpub::gpu
