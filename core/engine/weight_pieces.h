// How a quantized input becomes kernel weights: the one split both backends use, so the CPU
// reference and the GPU path quantize exactly the same slices with the same parts.
//
// A rank-3 expert stack whose parts split the expert dimension (concat_dim 0) becomes one stack
// per part (its slices numbered from the part's first expert); every other input is one weight of
// up to kernels::kMaxWeightParts parts read in place: rank 2 concatenated along rows (dim 0) or
// cols (dim 1), rank 3 along the rows of every slice (dim 1). Pure; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/inputs.h"
#include "kernels/nvfp4.h"

namespace wpub::engine {

// bf16 unless fp16 or fp32 (the quantizable input dtypes).
kernels::ElemType KernelElemType(DType dtype);

// A kernel-sized view of (part of) a quantized input: `slices` slices starting at slice
// `slice_offset` of the input.
struct WeightPiece {
  kernels::WeightDesc weight;
  int64_t slice_offset = 0;
  int64_t slices = 1;
};

// `part_data[i]` is where part i of `in` is read (host memory for the CPU backend, device
// memory for the GPU backend); one entry per part. INVALID_ARGUMENT naming the tensor for a rank
// other than 2 or 3, more parts than a weight may have, or a part_data of another length.
absl::StatusOr<std::vector<WeightPiece>> SplitIntoWeightPieces(
    const InputTensor& in, std::span<const uint8_t* const> part_data);

// The same pieces appended to *out (nothing appended on error): a caller splitting thousands of
// inputs per publication keeps one vector and its capacity instead of one allocation each.
// Fails exactly when CheckWeightPieces(in, part_data.size()) fails.
absl::Status AppendWeightPieces(const InputTensor& in, std::span<const uint8_t* const> part_data,
                                std::vector<WeightPiece>* out);

// The errors AppendWeightPieces would return for `in` with `num_part_data` part addresses,
// without building anything (reads only the shapes): a caller that builds pieces lazily, after
// device work has started, validates every input with this first.
absl::Status CheckWeightPieces(const InputTensor& in, size_t num_part_data);

}  // namespace wpub::engine
