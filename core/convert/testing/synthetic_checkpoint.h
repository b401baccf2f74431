// Synthetic HF safetensors checkpoints for the converter's tests and benchmark: the HF tensors of
// a core/synthetic model (DeepSeek-V3, GLM, Qwen3-MoE or Mixtral naming) plus any extra tensors,
// deterministic values, split into shards with a gate/up pair straddling each shard boundary,
// with config.json, an index, and a couple of non-safetensors files to be copied.
// Thread-safety: pure functions; WriteSyntheticCheckpoint uses its own worker threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/common/tensor.h"
#include "core/synthetic/synthetic.h"

namespace wpub::convert::testing {

// The HF tensors of every conversion batch of `model`, in model order.
std::vector<TensorDesc> HfTensors(const synthetic::SyntheticModel& model);

struct CheckpointSpec {
  std::vector<TensorDesc> tensors;   // in file order
  int num_hidden_layers = 0;         // written to config.json
  bool nest_in_text_config = false;  // config.json {"text_config": {"num_hidden_layers": N}}
  int num_shards = 2;                // 1 writes model.safetensors (no index)
  // When true, each shard boundary is moved to just after a gate tensor (".gate_proj.weight" or
  // ".w1.weight") so that its up partner starts the next shard.
  bool split_pairs = true;
  uint64_t seed = 1;
  int threads = 2;  // value generation and writing
};

// Writes the checkpoint into `dir` (created; must not hold a checkpoint already). Values come
// from synthetic::FillTensor(desc, seed) (bf16/fp16/fp32; other dtypes get a byte pattern).
absl::Status WriteSyntheticCheckpoint(const std::string& dir, const CheckpointSpec& spec);

}  // namespace wpub::convert::testing
