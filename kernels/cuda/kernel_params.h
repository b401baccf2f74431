// Kernel parameter blocks of the quantize, fused-QDQ and dequantize kernels, and the typed
// launch functions (one explicit instantiation per mode, in quantize_modes_*.cu). A parameter
// block carries a whole list of work items by value, so a launch needs no device-side
// descriptor buffer, no host-to-device copy and stays capturable in a CUDA graph. Private to
// kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::kernels::cuda::detail {

// One (weight, slice, part) of a quantize launch.
struct QuantItem {
  const void* in;       // this part's slice, [part_rows, part_colblks * 16] contiguous
  uint8_t* packed;      // the weight's slice base, [rows, kv * 8] bytes
  uint8_t* scales;      // the weight's slice base, linear [rows, kv]
  uint8_t* swizzled;    // the weight's slice base in the 128x4 layout, or nullptr
  const float* amax;    // this slice's amax
  float* decode_scale;  // this slice's weight_scale_2, or nullptr (written by one item only)
  uint32_t part_rows;
  uint32_t part_colblks;
  uint32_t row0;     // the part's first row in the slice
  uint32_t colblk0;  // the part's first block column in the slice
  uint32_t rows;     // the slice's rows (swizzled layout)
  uint32_t kv;       // the slice's block columns (cols / 16)
};

struct QuantParams {
  QuantItem items[kMaxItemsPerLaunch];
  uint32_t cta_begin[kMaxItemsPerLaunch + 1];
  int num_items;
};
static_assert(sizeof(QuantParams) < 32764, "kernel parameters are limited to 32764 bytes");

// One slice of a fused-QDQ launch (dense, in and out share the layout).
struct QdqItem {
  const void* in;
  void* out;
  const float* amax;
  uint32_t num_blocks;
};

struct QdqParams {
  QdqItem items[kMaxItemsPerLaunch];
  uint32_t cta_begin[kMaxItemsPerLaunch + 1];
  int num_items;
};
static_assert(sizeof(QdqParams) < 32764, "kernel parameters are limited to 32764 bytes");

// One slice of a resident fused-QDQ launch (qdq_resident.cuh): dense, in and out share the
// layout; its amax and non-finite count go to slot `slot` of the launch's arrays.
struct QdqResidentItem {
  const void* in;
  void* out;
  uint32_t num_blocks;
  uint32_t slot;
};

struct QdqResidentParams {
  QdqResidentItem items[kMaxItemsPerLaunch];
  uint32_t round_begin[kMaxItemsPerLaunch + 1];  // rounds of items (PlanRounds)
  int num_rounds;
  uint32_t stash_blocks;          // blocks each CTA keeps in shared memory
  float* amax;                    // zeroed before the launch
  unsigned long long* nonfinite;  // zeroed before the launch
  unsigned int* barrier;          // grid barrier counter, zeroed before the call's first launch
  uint32_t barrier_base;          // its value when this launch starts
};
static_assert(sizeof(QdqResidentParams) < 32764, "kernel parameters are limited to 32764 bytes");

// One slice of a dequantize launch.
struct DequantItem {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* amax;
  void* out;
  uint32_t num_blocks;
};

struct DequantParams {
  DequantItem items[kMaxItemsPerLaunch];
  uint32_t cta_begin[kMaxItemsPerLaunch + 1];
  int num_items;
};
static_assert(sizeof(DequantParams) < 32764, "kernel parameters are limited to 32764 bytes");

// 16-element blocks one thread handles per kernel (all loads issued before any arithmetic).
// The 4over6 modes do ~3x the arithmetic per block, so fewer blocks keep registers in check.
template <class Traits>
inline constexpr int kQuantBlocksPerThread = Traits::kFourOverSix ? 2 : 4;
inline constexpr int kDequantBlocksPerThread = 4;

template <class Traits>
inline constexpr uint32_t kQuantBlocksPerCta = kQuantBlocksPerThread<Traits> * 256;
inline constexpr uint32_t kDequantBlocksPerCta = kDequantBlocksPerThread * 256;

// Enqueue one kernel for a prepared parameter block (grid = cta_begin[num_items]); quantize under
// an occupancy cap (LaunchLimits).
template <class Traits>
KernelStatus LaunchQuantizeKernel(ElemType in_type, const QuantParams& params,
                                  const LaunchLimits& limits, cudaStream_t stream,
                                  std::string* message);
template <class Traits>
KernelStatus LaunchQdqKernel(ElemType type, const QdqParams& params, cudaStream_t stream,
                             std::string* message);
// The resident fused QDQ's launch shape on the current device for one mode and type: grid of
// `ctas` cooperative CTAs, each keeping `stash_blocks` blocks (dynamic shared memory `smem`).
struct ResidentLaunch {
  uint32_t ctas = 0;
  uint32_t stash_blocks = 0;
  size_t smem = 0;
};

// Fills `out` for CTAs that keep at most `cta_bytes` of input each (<= 0: as much as fits);
// kUnsupported when the device has no cooperative launch or the kernel cannot be resident.
// Sets the kernel's largest dynamic shared memory (always to the same value).
template <class Traits>
KernelStatus PrepareQdqResident(ElemType type, int64_t cta_bytes, ResidentLaunch* out,
                                std::string* message);
// Enqueues one cooperative launch of `launch`'s shape.
template <class Traits>
KernelStatus LaunchQdqResidentKernel(ElemType type, const QdqResidentParams& params,
                                     const ResidentLaunch& launch, cudaStream_t stream,
                                     std::string* message);
KernelStatus LaunchDequantizeKernel(ElemType out_type, int e4m3_max, const DequantParams& params,
                                    cudaStream_t stream, std::string* message);

}  // namespace wpub::kernels::cuda::detail
