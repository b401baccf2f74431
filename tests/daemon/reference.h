// The expected output of a publication, computed independently of the daemon: the policy plans
// each conversion batch and the kernels' CPU reference quantizes the routed-expert weights.
// What every receiver holds after a commit must equal this byte for byte.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/tensor.h"
#include "core/policy/settings.h"
#include "core/synthetic/synthetic.h"
#include "kernels/nvfp4.h"

namespace wpub::testing {

struct ExpectedTensor {
  TensorDesc desc;
  std::vector<uint8_t> bytes;
};

struct ExpectedPublication {
  std::map<std::string, ExpectedTensor> tensors;
  uint64_t quantized = 0;    // input tensors quantized
  uint64_t passthrough = 0;  // input tensors passed through, ignored ones not included
  uint64_t ignored = 0;      // passed through because an ignore rule matched
  uint64_t input_bytes = 0;
  uint64_t output_bytes = 0;
};

// Every output tensor of publishing `model` with data seed `seed` under `settings`, quantized
// with `mode`.
absl::StatusOr<ExpectedPublication> ComputeExpected(const synthetic::SyntheticModel& model,
                                                    const policy::PolicySettings& settings,
                                                    kernels::QuantMode mode, uint64_t seed);

}  // namespace wpub::testing
