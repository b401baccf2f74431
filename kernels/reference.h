// The CPU reference of the NVFP4 kernels: the oracle the CUDA kernels are compared with byte for
// byte, and the daemon's quantization path when no GPU is present. Implements
// docs/specs/nvfp4.md with the scalar arithmetic of nvfp4_math.h.
//
// Contract of every function here:
//  - Synchronous and blocking: results are complete on return. All pointers are host pointers,
//    borrowed for the duration of the call, never retained.
//  - Thread-safe (no shared state). With CpuOptions::num_threads > 1 the call itself runs
//    std::threads over rows; results are bit-identical for every thread count.
//  - Returns KernelStatus::kOk, or kInvalidArgument / kUnsupported without writing outputs; if
//    `error` is non-null it receives a sentence naming the offending weight index and rule.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/nvfp4.h"

namespace wpub::kernels {

struct CpuOptions {
  // Worker threads for one call: 1 runs on the calling thread, 0 uses
  // std::thread::hardware_concurrency(). Small inputs run on the calling thread regardless.
  int num_threads = 1;
};

// ---------------------------------------------------------------------------------------------
// Amax: max |x| in fp32 with NaN skipped (spec "Global scale" step 1), plus the number of
// non-finite elements (NaN, +-inf) alongside.

// One amax group: the union of `members` (one weight; {gate, up} for a pair sharing one amax;
// any number of weights). Members must have the same num_slices; the result has one entry per
// slice, each over that slice of every member.
struct AmaxTask {
  const WeightDesc* members = nullptr;
  int num_members = 0;
  float* amax = nullptr;         // out [num_slices]
  int64_t* nonfinite = nullptr;  // out [num_slices]; optional (nullptr)
};

// Computes every task (a list of tensors/pairs/stacks in one call).
KernelStatus ComputeAmax(std::span<const AmaxTask> tasks, const CpuOptions& options = {},
                         std::string* error = nullptr);
// One weight (per slice for a stack).
KernelStatus ComputeAmax(const WeightDesc& weight, float* amax, int64_t* nonfinite = nullptr,
                         const CpuOptions& options = {}, std::string* error = nullptr);
// A gate/up pair: one amax (per slice) over both tensors.
KernelStatus ComputePairAmax(const WeightDesc& gate, const WeightDesc& up, float* amax,
                             int64_t* nonfinite = nullptr, const CpuOptions& options = {},
                             std::string* error = nullptr);

// ---------------------------------------------------------------------------------------------
// Global scales (spec "Global scale" steps 2-4): elementwise over an array of amax values.

// A host fp32 array with a shape ({} is 0-d, one element).
struct F32Array {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// S_enc = where(min(6E/amax, FLT_MAX) == 0, 1, min(6E/amax, FLT_MAX)), NaN propagating, and
// S_dec = 1/S_enc, elementwise; the result has the input's shape. e4m3_max must be 448 or 256
// (kInvalidArgument otherwise), and amax.values.size() must equal the shape's product.
KernelStatus GlobalEncodeScales(const F32Array& amax, int e4m3_max, F32Array* s_enc,
                                std::string* error = nullptr);
KernelStatus GlobalDecodeScales(const F32Array& amax, int e4m3_max, F32Array* s_dec,
                                std::string* error = nullptr);

// ---------------------------------------------------------------------------------------------
// Quantize (9 modes; bf16/fp16/fp32 inputs; any rows; cols % 16 == 0).

struct QuantizeTask {
  const WeightDesc* weight = nullptr;
  // Per-slice amax [num_slices], e.g. a pair's shared amax; nullptr computes it from `weight`.
  const float* amax = nullptr;
  QuantOutput out;  // packed, scales and decode_scale required; swizzled optional
};

KernelStatus Quantize(std::span<const QuantizeTask> tasks, QuantMode mode,
                      const CpuOptions& options = {}, std::string* error = nullptr);
KernelStatus Quantize(const WeightDesc& weight, const float* amax, QuantMode mode,
                      const QuantOutput& out, const CpuOptions& options = {},
                      std::string* error = nullptr);

// ---------------------------------------------------------------------------------------------
// Dequantize: y = E2M1val(q) * (float(sf) * amax * fl32(1/(6E))) rounded to bf16/fp16
// (out_type kBF16 or kF16; kF32 is kUnsupported). `mode` supplies E. out is
// [num_slices, rows, cols] contiguous.
KernelStatus Dequantize(const QuantizedView& in, QuantMode mode, ElemType out_type, void* out,
                        const CpuOptions& options = {}, std::string* error = nullptr);

// ---------------------------------------------------------------------------------------------
// Fused QDQ (fake quantization): out = dequantize(quantize(x)) bit for bit, computed block by
// block without materializing codes or scales. Weights are bf16 or fp16 (rank-2, or rank-3
// stacks with per-slice amax); out has the weight's type and logical shape, contiguous.
struct QdqTask {
  const WeightDesc* weight = nullptr;
  const float* amax = nullptr;  // [num_slices]; nullptr computes it from `weight`
  void* out = nullptr;
};

KernelStatus FakeQuantize(std::span<const QdqTask> tasks, QuantMode mode,
                          const CpuOptions& options = {}, std::string* error = nullptr);

// ---------------------------------------------------------------------------------------------
// 128x4 swizzled scale layout (spec "Optional engine layout") of one slice: linear scales
// [rows, kv] to SwizzledScaleSize(rows, kv) bytes, zero padded.
void SwizzleScales(const uint8_t* linear, int64_t rows, int64_t kv, uint8_t* swizzled);

}  // namespace wpub::kernels
