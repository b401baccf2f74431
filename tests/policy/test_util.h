// Helpers shared by the policy tests: settings builders and small TensorDesc factories.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/common/tensor.h"
#include "core/policy/policy.h"

namespace wpub::policy::testing {

inline TensorDesc Bf16(std::string name, Shape shape) {
  return TensorDesc{std::move(name), DType::kBFloat16, std::move(shape)};
}

// NVFP4 settings with the given ignore rules and no exceptions.
inline PolicySettings Nvfp4Settings(std::vector<std::string> ignore = {}) {
  PolicySettings s;
  s.recipe = Recipe::kNvfp4;
  s.quantization.quant_algo = "NVFP4";
  s.quantization.quant_method = "modelopt";
  s.quantization.ignore_rules = std::move(ignore);
  return s;
}

inline std::unique_ptr<Policy> MakePolicy(PolicySettings settings) {
  auto policy = Policy::Create(std::move(settings));
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? std::move(*policy) : nullptr;
}

inline bool HasSubstr(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

}  // namespace wpub::policy::testing
