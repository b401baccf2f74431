// Host-side helpers shared by the launchers of kernels/cuda: descriptor checks the CUDA path
// adds to ValidateWeight (alignment, block-aligned dim-1 parts), CUDA error conversion, and the
// per-part geometry of a weight. Private to kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/nvfp4.h"

namespace wpub::kernels::cuda::detail {

inline constexpr uint64_t kVectorAlign = 16;

inline bool Aligned(const void* p, uint64_t align) {
  return reinterpret_cast<uintptr_t>(p) % align == 0;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline KernelStatus Invalid(std::string* message, const std::string& what) {
  if (message != nullptr) *message = what;
  return KernelStatus::kInvalidArgument;
}

inline KernelStatus Unsupported(std::string* message, const std::string& what) {
  if (message != nullptr) *message = what;
  return KernelStatus::kUnsupported;
}

// Converts the last launch error (consuming it) into kCudaError with a message naming `what`.
inline KernelStatus CheckLaunch(const char* what, std::string* message) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return KernelStatus::kOk;
  if (message != nullptr) {
    *message =
        std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  }
  return KernelStatus::kCudaError;
}

inline KernelStatus CheckCuda(cudaError_t err, const char* what, std::string* message) {
  if (err == cudaSuccess) return KernelStatus::kOk;
  if (message != nullptr) {
    *message =
        std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  }
  return KernelStatus::kCudaError;
}

// ValidateWeight plus what the CUDA kernels need: 16-byte aligned parts and, along dim 1,
// parts whose columns are whole 16-element blocks. `allowed_types` is a bit mask over ElemType.
inline KernelStatus ValidateDeviceWeight(const WeightDesc& w, int index, unsigned allowed_types,
                                         std::string* message) {
  const KernelStatus st = ValidateWeight(w, index, message);
  if (st != KernelStatus::kOk) return st;
  const std::string who = "weight " + std::to_string(index);
  if ((allowed_types & (1u << static_cast<int>(w.type))) == 0) {
    return Unsupported(message, who + ": element type " + ElemTypeName(w.type) +
                                    " is not accepted by this kernel");
  }
  for (int p = 0; p < w.num_parts; ++p) {
    if (!Aligned(w.parts[p].data, kVectorAlign)) {
      return Unsupported(message, who + ": part " + std::to_string(p) +
                                      " is not 16-byte aligned (the CUDA kernels read 16-byte "
                                      "vectors)");
    }
    if (w.concat == ConcatDim::kCols && w.parts[p].cols % kBlockSize != 0) {
      return Unsupported(message, who + ": part " + std::to_string(p) + " has " +
                                      std::to_string(w.parts[p].cols) +
                                      " columns; concatenation along dim 1 needs every part's "
                                      "columns to be a multiple of 16 on CUDA");
    }
  }
  // Work items index blocks with 32-bit integers.
  const int64_t blocks = w.rows() * (w.cols() / kBlockSize);
  if (blocks >= (int64_t{1} << 31)) {
    return Unsupported(message, who + ": more than 2^31 blocks per slice");
  }
  return KernelStatus::kOk;
}

// Where part p of a weight sits inside one slice of the logical [rows, cols] tensor.
struct PartGeometry {
  int64_t row0 = 0;
  int64_t col0 = 0;
};

inline PartGeometry PartOrigin(const WeightDesc& w, int p) {
  PartGeometry g;
  for (int i = 0; i < p; ++i) {
    if (w.concat == ConcatDim::kRows) {
      g.row0 += w.parts[i].rows;
    } else {
      g.col0 += w.parts[i].cols;
    }
  }
  return g;
}

// Pointer to slice s of part p (each part holds its slices back to back).
inline const void* PartSlice(const WeightDesc& w, int p, int64_t s) {
  const WeightPart& part = w.parts[p];
  return static_cast<const uint8_t*>(part.data) +
         s * part.rows * part.cols * static_cast<int64_t>(ElemSize(w.type));
}

// Dynamic shared memory that holds a kernel with `static_smem` bytes of static shared memory to
// at most `max_ctas` CTAs per SM, on an SM of `sm_smem` bytes of shared memory that reserves
// `reserved` bytes per CTA: (max_ctas + 1) CTAs no longer fit, max_ctas still do. 0 when
// max_ctas <= 0 or when no padding is needed for the cap. Pure arithmetic (tested against
// cudaOccupancyMaxActiveBlocksPerMultiprocessor).
inline size_t OccupancyCapSharedMemory(int max_ctas, size_t sm_smem, size_t reserved,
                                       size_t static_smem) {
  if (max_ctas <= 0) return 0;
  const size_t per_cta = sm_smem / static_cast<size_t>(max_ctas + 1) + 1;
  const size_t fixed = reserved + static_smem;
  return per_cta > fixed ? per_cta - fixed : 0;
}

// Prepares `kernel` for a launch under `limits` on the current device: the dynamic shared memory
// to pass to the launch (0 without a cap), with the kernel's attributes set to allow it (the
// maximum dynamic shared memory, and the carveout preferring shared memory; both persist on the
// kernel function, and the carveout preference also applies to its later uncapped launches).
template <class Kernel>
KernelStatus PrepareOccupancyCap(Kernel kernel, const LaunchLimits& limits, size_t* smem,
                                 std::string* message) {
  *smem = 0;
  if (limits.max_ctas_per_sm <= 0) return KernelStatus::kOk;
  int device = 0, sm_smem = 0, reserved = 0, optin = 0;
  cudaFuncAttributes attr{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, fn);
  KernelStatus st = CheckCuda(err, "occupancy cap: device and kernel attributes", message);
  if (st != KernelStatus::kOk) return st;
  size_t pad = OccupancyCapSharedMemory(limits.max_ctas_per_sm, static_cast<size_t>(sm_smem),
                                        static_cast<size_t>(reserved), attr.sharedSizeBytes);
  if (pad + attr.sharedSizeBytes > static_cast<size_t>(optin)) {
    pad = static_cast<size_t>(optin) - attr.sharedSizeBytes;  // a cap of 1 on small SMs
  }
  if (pad == 0) return KernelStatus::kOk;
  // The attributes are the same for every capped launch of this kernel (the largest dynamic
  // shared memory allowed, not this cap's), so concurrent launches with other caps stay valid.
  err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             optin - static_cast<int>(attr.sharedSizeBytes));
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  st = CheckCuda(err, "occupancy cap: kernel shared-memory attributes", message);
  if (st == KernelStatus::kOk) *smem = pad;
  return st;
}

inline constexpr unsigned kAllInputTypes = 0b111;
inline constexpr unsigned k16BitTypes = 0b011;

}  // namespace wpub::kernels::cuda::detail
