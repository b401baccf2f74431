// Checks a converted checkpoint against its input, independently of the converter's planning:
// the given set of quantized names, bytes of every quantized tensor equal to the CPU reference
// quantizer run here on the input (pairs by name: gate_proj/up_proj, w1/w3, one amax), kept
// tensors byte-identical, shard layout, `format: pt` metadata, the index, config.json's
// quantization_config and hf_quant_config.json, and that the ignore list covers every kept
// module and no quantized one.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/nvfp4_math.h"

namespace wpub::convert {

struct CheckResult {
  absl::Status status;              // the first mismatch, naming the tensor or file
  std::vector<std::string> ignore;  // config.json quantization_config.ignore
  int pairs_across_shards = 0;      // gate/up pairs whose halves sit in different shards
};

// weight_only: the output must say quant_algo W4A16_NVFP4 and hold no input_scale; otherwise
// NVFP4 with input_scale 1.0 per module.
CheckResult CheckConvertedCheckpoint(const std::string& in_dir, const std::string& out_dir,
                                     const std::set<std::string>& quantized,
                                     kernels::QuantMode mode, bool weight_only = false);

// OK iff both directories hold the same regular files (recursively) with identical bytes.
absl::Status CompareDirectories(const std::string& a, const std::string& b);

}  // namespace wpub::convert
