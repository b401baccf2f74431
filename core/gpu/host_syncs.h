// The one accounting point for synchronizing CUDA calls on the GPU publication path. Every call
// that can block the host on device work (stream/event synchronize, blocking copies,
// allocation and free, host registration) goes through HostSyncs, which makes the call and
// adds one to the publication's engine::SyncCounter (wpub_host_syncs_total and the report's
// host_syncs). A CUPTI-based test counts the same calls independently and compares.
//
// Thread-safety: as the SyncCounter it feeds (atomic); the CUDA calls are thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/engine/backend.h"

namespace wpub::gpu {

// Converts a CUDA error once, at the call site: the expression, file:line and CUDA's string.
absl::Status CudaError(cudaError_t err, const char* expr, const char* file, int line);

#define WPUB_CUDA_RETURN_IF_ERROR(expr)                                         \
  do {                                                                          \
    const cudaError_t wpub_cuda_err_ = (expr);                                  \
    if (wpub_cuda_err_ != cudaSuccess) {                                        \
      return ::wpub::gpu::CudaError(wpub_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

class HostSyncs {
 public:
  // `counter` may be null (nothing counted: construction-time allocations outside any
  // publication); otherwise it must outlive this object.
  explicit HostSyncs(engine::SyncCounter* counter) : counter_(counter) {}

  // Each of these is one synchronizing call, counted once.
  absl::Status EventSynchronize(cudaEvent_t event, const char* why);
  absl::Status StreamSynchronize(cudaStream_t stream, const char* why);
  absl::Status Malloc(void** ptr, size_t bytes, const char* why);
  absl::Status Free(void* ptr);
  absl::Status MallocHost(void** ptr, size_t bytes, const char* why);
  absl::Status FreeHost(void* ptr);

  // One synchronizing call made elsewhere on this publication's behalf (a reader of its
  // buckets on its thread: transport::DeviceBytes::count_host_wait).
  void CountExternal() { Count(); }

  uint64_t counted() const { return counted_; }

 private:
  void Count() {
    ++counted_;
    if (counter_ != nullptr) counter_->Add();
  }
  engine::SyncCounter* counter_;
  uint64_t counted_ = 0;
};

}  // namespace wpub::gpu
