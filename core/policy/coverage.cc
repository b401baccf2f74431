// The end-of-ingestion check that a quantizing recipe quantized something: the one mistake of
// a trainer integration that would otherwise be silent (names the policy does not recognize).
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/policy/policy.h"

namespace wpub::policy {
namespace {

constexpr size_t kSampleNames = 3;

struct Sample {
  const BatchPlan* batch;
  size_t tensor;
};

// Every tensor of a plan that quantizes nothing passed, so its output is its input desc.
std::string Describe(const Sample& s) {
  const BatchPlan& b = *s.batch;
  const TensorDesc& out = b.outputs[b.tensors[s.tensor].first_output];
  return absl::StrCat("'", out.name, "' in batch '", b.megatron_name,
                      "': ", ReasonName(b.tensors[s.tensor].reason));
}

}  // namespace

absl::Status CheckQuantizesAnything(const PolicySettings& settings,
                                    absl::Span<const BatchPlan> plans) {
  if (!IsNvfp4(settings.recipe) || settings.allow_nothing_quantized) return absl::OkStatus();
  size_t tensors = 0;
  // The names that mention experts tell most about the mismatch; others fill up the sample.
  std::vector<Sample> experts, others;
  for (const BatchPlan& b : plans) {
    if (b.quantizes_anything()) return absl::OkStatus();
    tensors += b.tensors.size();
    for (size_t i = 0; i < b.tensors.size(); ++i) {
      const TensorPlan& tp = b.tensors[i];
      if (tp.num_outputs == 0 || tp.first_output >= b.outputs.size()) continue;
      const bool expert = absl::StrContains(b.outputs[tp.first_output].name, "expert");
      std::vector<Sample>& into = expert ? experts : others;
      if (into.size() < kSampleNames) into.push_back(Sample{&b, i});
    }
  }
  std::vector<std::string> seen;
  for (const std::vector<Sample>* list : {&experts, &others}) {
    for (const Sample& s : *list) {
      if (seen.size() < kSampleNames) seen.push_back(Describe(s));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "recipe ", RecipeName(settings.recipe),
      " quantizes routed-expert weights, but the plan quantizes none of this publication's ",
      tensors, " tensors (e.g. ", absl::StrJoin(seen, "; "),
      "). Routed experts are recognized by Megatron batch names "
      "(decoder.layers.N.mlp.experts.linear_fc1.weightE) or by HF tensor names "
      "(model.layers.N.mlp.experts.E.gate_proj.weight); publish with recipe bf16, or set the "
      "policy flag allow_nothing_quantized, to publish it unquantized on purpose"));
}

}  // namespace wpub::policy
