// Internal to core/convert: the conversion plan (which input tensors are quantized, how gate/up
// pairs across shards are grouped, the output shards' tensor lists and the ignore list) and the
// executor interface the CPU and CUDA paths implement. Names and offsets only, no tensor bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/convert/convert.h"
#include "core/safetensors/safetensors.h"
#include "kernels/nvfp4.h"

namespace wpub::convert {

// One input tensor taking part in a unit, and where its outputs go.
struct UnitMember {
  int shard = -1;                                 // input shard (= output shard)
  const safetensors::TensorInfo* info = nullptr;  // input
  // Output tensor index in that shard's writer: the tensor itself for a kept tensor; for a
  // quantized one X.weight, then X.weight_scale (+1), X.weight_scale_2 (+2), X.input_scale (+3,
  // W4A4 output only).
  size_t out_index = 0;
  kernels::ElemType type = kernels::ElemType::kBF16;
  int64_t rows = 0;  // per slice
  int64_t cols = 0;
};

// A unit of work: a kept tensor (copied), or one quantized tensor or gate/up pair (sharing one
// amax per slice) restricted to slices [slice_begin, slice_end) of its [E, M, K] stack (E = 1
// for rank-2). Units of one stacked tensor are independent: amax is per slice.
struct Unit {
  bool quantize = false;
  std::vector<UnitMember> members;  // 1, or {gate, up}
  int64_t slice_begin = 0;
  int64_t slice_end = 1;
  bool stacked = false;     // rank-3 input: weight_scale_2 has shape [E]
  bool input_scale = true;  // quantized: X.input_scale is written (ConvertPlan::input_scale)
  // Input bytes of the members over this unit's slices.
  uint64_t input_bytes() const;
  // This unit's piece of member m's input.
  const uint8_t* input(const safetensors::Checkpoint& ckpt, size_t m) const;
  uint64_t member_input_bytes(size_t m) const;
};

struct ConvertPlan {
  // Output tensors per shard (shard i of the input becomes shard i of the output, same name).
  std::vector<std::vector<safetensors::OutputTensor>> outputs;
  std::vector<Unit> units;          // processing order: input shard order, data-offset order
  std::vector<std::string> ignore;  // compact ignore list for the quantization config
  bool input_scale = true;          // W4A4 (quant_algo NVFP4): each NVFP4 module gets X.input_scale
  int64_t tensors_quantized = 0;
  int64_t tensors_kept = 0;
  uint64_t bytes_out = 0;
};

// Classifies every tensor of `ckpt` with policy::ClassifyOfflineTensor and builds the plan.
// `num_hidden_layers` < 0 means unknown (an error if BF16 head/tail layers are asked for).
// `max_unit_bytes` splits stacked tensors into slice ranges of about that much input.
absl::StatusOr<ConvertPlan> BuildPlan(const safetensors::Checkpoint& ckpt,
                                      const ConvertOptions& options, int64_t num_hidden_layers,
                                      uint64_t max_unit_bytes);

// Output byte sizes of one member over `slices` slices.
struct QuantSizes {
  uint64_t packed = 0;  // rows * cols / 2 per slice
  uint64_t scales = 0;  // rows * cols / 16 per slice
  uint64_t scale2 = 0;  // 4 per slice
};
QuantSizes QuantizedSizes(const UnitMember& m, int64_t slices);

// Writes a unit's results for member m: packed, scales, weight_scale_2 for the unit's slices,
// and, when unit.input_scale, input_scale (fp32 1.0) once with the first slice.
absl::Status WriteQuantized(const Unit& unit, size_t m, const uint8_t* packed,
                            const uint8_t* scales, const float* scale2,
                            const std::vector<safetensors::Writer*>& writers);

// Runs the plan's units, writing every output through `writers` (one per shard). Implemented by
// the CPU path (reference kernels) and the CUDA path.
class Executor {
 public:
  virtual ~Executor() = default;
  // Blocks until every unit is written or one failed. `on_unit_done(unit_index)` is called on
  // the calling thread after each unit's outputs were written.
  virtual absl::Status Run(const safetensors::Checkpoint& ckpt, const ConvertPlan& plan,
                           const std::vector<safetensors::Writer*>& writers,
                           const std::function<void(size_t)>& on_unit_done, int64_t* nonfinite) = 0;
};

std::unique_ptr<Executor> CreateCpuExecutor(const ConvertOptions& options);
// UNIMPLEMENTED in a build without CUDA; FAILED_PRECONDITION without a usable GPU.
absl::StatusOr<std::unique_ptr<Executor>> CreateCudaExecutor(const ConvertOptions& options);

}  // namespace wpub::convert
