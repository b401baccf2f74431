// Public host API types of the NVFP4 kernels, shared by the CPU reference (reference.h) and the
// CUDA launchers (cuda/): element types, weight descriptors (dense, rank-3 stacks, tensors
// assembled from parts), quantized-output descriptors and input validation.
//
// Descriptors are plain values holding raw pointers they do not own (host pointers for the CPU
// reference, device pointers for CUDA launchers); they are trivially copyable so launchers can
// copy them into a workspace or kernel parameters. Everything here is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/nvfp4_math.h"

namespace wpub::kernels {

const char* KernelStatusString(KernelStatus status);

// Element type of a weight (input) or of a dequantized output.
enum class ElemType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

constexpr size_t ElemSize(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }
const char* ElemTypeName(ElemType t);  // "bfloat16", "float16", "float32"

// Widen one element of type t at p[i] to fp32 (exact).
WPUB_HD float LoadAsFloat(const void* p, int64_t i, ElemType t) {
  if (t == ElemType::kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == ElemType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// Along which logical dimension the parts of a weight are concatenated.
enum class ConcatDim : int { kRows = 0, kCols = 1 };

// One contiguous row-major piece of a weight: [num_slices, rows, cols] elements at data.
struct WeightPart {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

inline constexpr int kMaxWeightParts = 16;

// A logical weight of shape [num_slices, rows, cols] (num_slices == 1: a rank-2 [rows, cols]
// weight; > 1: a rank-3 expert stack [E, M, K] quantized slice by slice with one amax, one
// global scale and one weight_scale_2 per slice). The weight may be assembled from up to
// kMaxWeightParts parts (e.g. TP shards read in place) concatenated along rows (dim 0, every
// part has the same cols) or along cols (dim 1, every part has the same rows); each part holds
// all num_slices slices contiguously. A plain tensor is one part.
struct WeightDesc {
  ElemType type = ElemType::kBF16;
  int64_t num_slices = 1;
  ConcatDim concat = ConcatDim::kRows;
  int32_t num_parts = 0;
  WeightPart parts[kMaxWeightParts] = {};

  // A contiguous rank-2 tensor [rows, cols].
  static WeightDesc Dense(const void* data, int64_t rows, int64_t cols, ElemType type);
  // A contiguous rank-3 stack [slices, rows, cols].
  static WeightDesc Stack(const void* data, int64_t slices, int64_t rows, int64_t cols,
                          ElemType type);
  // Appends a part; returns false when kMaxWeightParts are already present.
  bool AddPart(const void* data, int64_t rows, int64_t cols);

  // Logical per-slice shape (assumes a valid descriptor, see ValidateWeight).
  int64_t rows() const;
  int64_t cols() const;
  int64_t elements_per_slice() const { return rows() * cols(); }
};

// Checks one weight: 1 <= num_parts <= kMaxWeightParts, non-null data, positive extents,
// consistent part shapes for the concat dim, num_slices >= 1, and cols % 16 == 0 (the NVFP4 block
// size). On failure returns kInvalidArgument and, if message is non-null, a sentence naming
// `index` ("weight 3: last dimension 40 is not a multiple of 16"). index < 0 omits the index.
KernelStatus ValidateWeight(const WeightDesc& w, int index, std::string* message);

// Where quantize writes one weight (all pointers non-owning, device pointers for CUDA):
//   packed        uint8 [num_slices, rows, cols/2], element 2i in the low nibble
//   scales        float8_e4m3fn bytes [num_slices, rows, cols/16], row-major, linear
//   swizzled      optional (nullptr: skipped) 128x4 swizzled scales, SwizzledScaleSize(rows,
//                 cols/16) bytes per slice (zero padded), slices back to back
//   decode_scale  fp32 [num_slices]: weight_scale_2 = 1 / S_enc
struct QuantOutput {
  uint8_t* packed = nullptr;
  uint8_t* scales = nullptr;
  uint8_t* swizzled = nullptr;
  float* decode_scale = nullptr;
};

// A quantized weight to decode (dequantize input): the same layout as QuantOutput plus the
// amax per slice that produced it (decoding uses amax directly, not weight_scale_2).
struct QuantizedView {
  const uint8_t* packed = nullptr;
  const uint8_t* scales = nullptr;
  const float* amax = nullptr;  // [num_slices]
  int64_t num_slices = 1;
  int64_t rows = 0;
  int64_t cols = 0;  // logical (unpacked) columns, a multiple of 16
};

}  // namespace wpub::kernels
