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
#include "core/gpu/status_kernels.h"
#include "kernels/nvfp4.h"

namespace wpub::gpu::detail {

inline constexpr uint64_t kAlign = 256;
inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
inline bool Aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// False for dtypes that cannot hold non-finite values.
bool FloatKindOf(DType d, FloatKind* k);

absl::Status KernelError(kernels::KernelStatus st, const std::string& what, const std::string& msg);

// The CUDA driver function `name` (this toolkit's version of it) through the runtime's
// entry-point lookup, so that nothing links libcuda and binaries load on machines without a
// driver; nullptr when the driver has none.
void* DriverEntryPoint(const char* name);
template <typename Fn>
Fn DriverFunction(const char* name) {
  return reinterpret_cast<Fn>(DriverEntryPoint(name));
}

// A growable buffer whose (re)allocation is a counted host synchronization.
struct GrowBuffer {
  void* ptr = nullptr;
  uint64_t size = 0;
  bool pinned = false;

  absl::Status Ensure(uint64_t bytes, HostSyncs& syncs, const char* why);
  absl::Status Release(HostSyncs& syncs);
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};

}  // namespace wpub::gpu::detail
