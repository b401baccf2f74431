// Name parsing shared by the planner and the offline classifier. Megatron parameter names as the
// trainer's NVFP4 policy parses them: the trainer uses Python regexes (specs/policy.md); these
// are exact hand-written equivalents (layer indices are ASCII digits, as in RE2 and Python bytes
// patterns), because the planner runs them once per batch on the publication's hot path. And the
// HF gate/up suffixes. Pure functions; thread-safe.
#pragma once

#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "core/policy/policy.h"

namespace wpub::policy {

struct MegatronLayer {
  std::string index_digits;  // group 1: the layer index as written
  std::string rest;          // group 2, with MTP wrapper modules removed
  bool mtp = false;          // matched the MTP pattern
};

// re.search(r"decoder\.layers\.(\d+)\.(.+)", name), else re.search(r"mtp\.layers\.(\d+)\.(.+)",
// name) with "transformer_layer." then "mtp_model_layer." removed from the rest (all
// occurrences, in that order). nullopt when neither matches.
std::optional<MegatronLayer> ParseMegatronLayer(absl::string_view megatron_name);

// re.match(r"mlp.experts\.(.+)\.weight(\d+)", rest) (anchored at the start only; the '.' after
// "mlp" is the regex wildcard, as in the trainer) and group 1 in {"linear_fc1", "linear_fc2"}.
bool IsRoutedExpertGemmRest(absl::string_view rest);

// SplitPairName without allocating: the role, and `*base` a view into `hf_name` (empty for
// PairRole::kNone).
PairRole PairRoleOf(absl::string_view hf_name, absl::string_view* base);

}  // namespace wpub::policy
