// A publication's precision settings: the recipe, the quantization config exactly as engines
// read `quantization_config` from config.json, and the precision exceptions of the trainer
// (extra high-precision layers, first/last BF16 layers). Value types and pure functions only;
// everything here is thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wpub::policy {

// What a publication turns routed-expert weights into. kBf16 quantizes nothing.
enum class Recipe : uint8_t {
  kBf16,
  kNvfp4,            // standard NVFP4 (E4M3 scale max 448)
  kNvfp4FourOverSix  // NVFP4 with 4over6 adaptive block scaling; same tensor layout as kNvfp4
};

// "bf16", "nvfp4", "nvfp4_4over6".
absl::string_view RecipeName(Recipe recipe);
// Inverse of RecipeName (case-insensitive; "4over6" is accepted for kNvfp4FourOverSix).
absl::StatusOr<Recipe> ParseRecipe(absl::string_view name);
// True for every recipe that quantizes to NVFP4.
bool IsNvfp4(Recipe recipe);

// The engine-visible quantization config.
struct QuantizationConfig {
  std::string quant_algo;    // e.g. "NVFP4"; empty when the JSON has none
  std::string quant_method;  // e.g. "modelopt", "modelopt_fp4"; empty when the JSON has none
  // Ignore rules: `ignore` (a string counts as a one-element list) followed by the entries of
  // `exclude_modules` not already present, order kept. `re:`-prefixed entries are regexes.
  std::vector<std::string> ignore_rules;

  // NVFP4 as an engine decides it: `quant_algo` contains "NVFP4" (case-insensitive), or, when
  // `quant_algo` is absent, `quant_method` is "modelopt_fp4" or contains "nvfp4".
  bool IsNvfp4() const;
};

// Parses a quantization config from JSON text. Accepted documents, as SGLang/vLLM accept them:
//  - a `quantization_config` object itself: {"quant_algo": "NVFP4", "ignore": [...], ...};
//  - a whole config.json: {"quantization_config": {...}, ...};
//  - an hf_quant_config.json: {"quantization": {"quant_algo": ..., "exclude_modules": [...]}}.
// Errors name the field: non-string rule ("ignore[3] must be a string, got number"), a
// `quant_algo`/`quant_method` that is not a string, malformed JSON.
absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(absl::string_view json_text);

// Trainer-side exceptions to the recipe (Megatron/miles flags of the same names).
struct PrecisionExceptions {
  // Any of these substrings in the Megatron name: the whole batch passes through (live path).
  std::vector<std::string> extra_high_precision_layers_megatron;
  // Any of these substrings in an HF name: the tensor stays high precision (offline path).
  std::vector<std::string> extra_high_precision_layers_hf;
  // Layers [0, num_layers_at_start_in_bf16) and [num_layers - num_layers_at_end_in_bf16, ...)
  // stay in BF16. The MTP layer index is compared the same way (it counts from 0 within the
  // MTP block, so MTP layer 0 is a "first" layer); this mirrors the trainer's behaviour.
  bool first_last_layers_bf16 = false;
  int64_t num_layers = 0;
  int64_t num_layers_at_start_in_bf16 = 0;
  int64_t num_layers_at_end_in_bf16 = 0;
};

// Everything the policy needs for one publication.
struct PolicySettings {
  Recipe recipe = Recipe::kNvfp4;
  QuantizationConfig quantization;
  PrecisionExceptions exceptions;
  // A quantizing recipe whose plans quantize nothing is an error (CheckQuantizesAnything);
  // true publishes such a publication anyway (a model with no routed experts, on purpose).
  bool allow_nothing_quantized = false;
};

// Checks the cross-field invariants: an NVFP4 recipe needs an NVFP4 quantization config;
// first_last_layers_bf16 needs num_layers >= 1 and non-negative counts. Errors name the field.
absl::Status ValidatePolicySettings(const PolicySettings& settings);

// Parses and validates settings from JSON text:
//   {"recipe": "nvfp4",
//    "quantization_config": {...}            (any document ParseQuantizationConfig accepts),
//    "extra_high_precision_layers_megatron": ["..."], "extra_high_precision_layers_hf": [...],
//    "first_last_layers_bf16": true, "num_layers": 92,
//    "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1,
//    "allow_nothing_quantized": false}
// Every key is optional except that an NVFP4 recipe (the default) needs an NVFP4 config.
// Unknown keys are errors (a misspelt exception must not be silently ignored).
absl::StatusOr<PolicySettings> ParsePolicySettings(absl::string_view json_text);

// The settings of a publication header: `policy_json` (a ParsePolicySettings document or
// empty) merged with the header's `recipe` (policy_json's own "recipe", if any, must name the
// same one) and `quantization_config_json` (a ParseQuantizationConfig document or empty; it may
// not also be given inside policy_json). Without any config an NVFP4 recipe gets the plain
// NVFP4 one (no ignore rules). Errors name the header field. Every JSON text goes through
// CheckJsonBounds (core/common/json_bounds.h) before it is parsed.
absl::StatusOr<PolicySettings> ParseHeaderSettings(absl::string_view policy_json,
                                                   absl::string_view quantization_config_json,
                                                   Recipe recipe);

}  // namespace wpub::policy
