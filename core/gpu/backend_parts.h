// Internal to core/gpu: the GPU backend's helpers -- alignment, element kinds, the split of a
// quantized input into kernel weights (as the CPU backend splits it, over device pointers), and
// buffers whose growth is a counted host synchronization. Not part of the public API.
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

kernels::ElemType ToElemType(DType d);
// False for dtypes that cannot hold non-finite values.
bool FloatKindOf(DType d, FloatKind* k);

// A kernel-sized view of (part of) a quantized input: `slices` slices from `slice_offset`.
struct Piece {
  kernels::WeightDesc weight;
  int64_t slice_offset = 0;
  int64_t slices = 1;
};

// Splits a quantized input as the CPU backend does, over device part pointers `data`.
absl::StatusOr<std::vector<Piece>> MakePieces(const engine::InputTensor& in,
                                              const std::vector<const uint8_t*>& data);

absl::Status KernelError(kernels::KernelStatus st, const std::string& what, const std::string& msg);

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
