// Internal to core/gpu: the GPU backend's helpers -- alignment, element kinds, buffers whose
// growth is a counted host synchronization, and CUDA driver functions looked up at run time. Not
// part of the public API. (Quantized inputs are split into kernel weights by
// engine::SplitIntoWeightPieces, as the CPU backend splits them.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/inputs.h"
#include "core/gpu/host_syncs.h"
#include "kernels/cuda/status_kernels.h"
#include "kernels/nvfp4.h"

namespace wpub::gpu::detail {

inline constexpr uint64_t kAlign = 256;
inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
inline bool Aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// False for dtypes that cannot hold non-finite values.
bool FloatKindOf(DType d, kernels::cuda::FloatKind* k);

absl::Status KernelError(kernels::KernelStatus st, const std::string& what, const std::string& msg);

// The CUDA driver function `name` (this toolkit's version of it) through the runtime's
// entry-point lookup, so that nothing links libcuda and binaries load on machines without a
// driver; nullptr when the driver has none.
void* DriverEntryPoint(const char* name);
template <typename Fn>
Fn DriverFunction(const char* name) {
  return reinterpret_cast<Fn>(DriverEntryPoint(name));
}

// A growable device or pinned host buffer whose (re)allocation is a counted host
// synchronization (HostSyncs). Owns its memory: move-only, released (uncounted) on destruction.
class GrowBuffer {
 public:
  explicit GrowBuffer(bool pinned = false) : pinned_(pinned) {}
  ~GrowBuffer();
  GrowBuffer(GrowBuffer&& other) noexcept;
  GrowBuffer& operator=(GrowBuffer&& other) noexcept;
  GrowBuffer(const GrowBuffer&) = delete;
  GrowBuffer& operator=(const GrowBuffer&) = delete;

  // At least `bytes` (rounded up to 1 MiB; device memory is allocated in whole 2 MiB pages,
  // kernels::cuda::DeviceAllocationBytes); the old contents are not kept.
  absl::Status Ensure(uint64_t bytes, HostSyncs& syncs, const char* why);
  absl::Status Release(HostSyncs& syncs);
  void* ptr() const { return ptr_; }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t size() const { return size_; }

 private:
  bool pinned_ = false;
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace wpub::gpu::detail
