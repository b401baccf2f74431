// Fuzz target `policy`: the policy's untrusted text (core/policy): the settings JSON, the
// quantization config JSON (a header's quantization_config_json, a checkpoint's config.json)
// and ignore-rule lists. The first input byte picks the parser, the rest is its text:
//   0: ParsePolicySettings, then Policy::Create and PlanBatch over a small MoE's batches and
//      the offline classifier over their names;
//   1: ParseQuantizationConfig, then the ignore matcher over the config's rules;
//   2: a rule list and names (lines; a NUL byte separates rules from names) for the matcher.
// Properties: nothing crashes; the matcher chosen for a list (the literal snapshot or the
// ordered scan), the scan itself and the snapshot cache agree on every name, and for a list
// without `re:` rules so does the literal rule's definition; a batch plan is self-consistent.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/policy/policy.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

namespace policy = ::wpub::policy;
using wpub::DType;
using wpub::TensorDesc;

// The literal rule definition: n == r or n starts with r + ".".
bool LiteralMatch(const std::vector<std::string>& rules, absl::string_view name) {
  for (const std::string& r : rules) {
    if (name == r || absl::StartsWith(name, absl::StrCat(r, "."))) return true;
  }
  return false;
}

std::vector<std::string> NamesFor(const std::vector<std::string>& rules) {
  std::vector<std::string> names = {"lm_head.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
                                    "model.layers.0.self_attn.q_proj.weight", "", "."};
  for (const std::string& r : rules) {
    names.push_back(r);
    names.push_back(absl::StrCat(r, ".weight"));
    names.push_back(r.substr(0, r.size() / 2));
  }
  return names;
}

void CheckMatchers(std::vector<std::string> rules, const std::vector<std::string>& names) {
  if (rules.size() > 2000) rules.resize(2000);
  absl::StatusOr<policy::IgnoreMatcher> matcher = policy::IgnoreMatcher::Create(rules);
  absl::StatusOr<policy::RegexIgnoreRules> scan = policy::RegexIgnoreRules::Create(rules);
  FUZZ_CHECK(matcher.ok() == scan.ok(), "the matcher and the scan disagree on the rules");
  if (!matcher.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(matcher.status()), matcher.status().ToString());
    return;
  }
  absl::StatusOr<std::unique_ptr<policy::IgnoreSnapshotCache>> cache =
      policy::IgnoreSnapshotCache::Create({});
  FUZZ_CHECK(cache.ok(), cache.status().ToString());
  absl::StatusOr<std::shared_ptr<const policy::IgnoreMatcher>> cached = (*cache)->Get(rules);
  FUZZ_CHECK(cached.ok(), cached.status().ToString());
  const bool literal = policy::LiteralRuleList::Create(rules).ok();
  FUZZ_CHECK(matcher->uses_snapshot() == literal, "snapshot chosen for a list with re: rules");
  for (const std::string& n : names) {
    const bool ignored = matcher->IsIgnored(n);
    FUZZ_CHECK(ignored == scan->Matches(n), absl::StrCat("snapshot vs scan on '", n, "'"));
    FUZZ_CHECK(ignored == (*cached)->IsIgnored(n), absl::StrCat("cache on '", n, "'"));
    if (literal) {
      FUZZ_CHECK(ignored == LiteralMatch(rules, n), absl::StrCat("definition on '", n, "'"));
    }
  }
}

struct Batch {
  std::string megatron;
  std::vector<TensorDesc> tensors;
};

std::vector<Batch> MoeBatches() {
  const std::string e = "decoder.layers.1.mlp.experts.";
  const std::string h = "model.layers.1.mlp.experts.0.";
  return {
      {e + "linear_fc1.weight0",
       {{h + "gate_proj.weight", DType::kBFloat16, {32, 64}},
        {h + "up_proj.weight", DType::kBFloat16, {32, 64}}}},
      {e + "linear_fc2.weight0", {{h + "down_proj.weight", DType::kBFloat16, {64, 32}}}},
      {e + "linear_fc1.weight",
       {{"model.layers.1.mlp.experts.gate_up_proj", DType::kBFloat16, {4, 64, 64}}}},
      {"decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
       {{"model.layers.1.mlp.shared_experts.gate_proj.weight", DType::kBFloat16, {32, 64}}}},
      {"decoder.layers.0.self_attention.linear_qkv.weight",
       {{"model.layers.0.self_attn.q_proj.weight", DType::kFloat32, {64, 64}}}},
      {"mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight1",
       {{"model.layers.3.mlp.experts.1.down_proj.weight", DType::kFloat16, {64, 32}}}},
      {"embedding.word_embeddings.weight",
       {{"model.embed_tokens.weight", DType::kBFloat16, {128, 64}}}},
  };
}

void CheckPlans(const policy::PolicySettings& settings) {
  absl::StatusOr<std::unique_ptr<policy::Policy>> p = policy::Policy::Create(settings);
  if (!p.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(p.status()), p.status().ToString());
    return;
  }
  for (const Batch& b : MoeBatches()) {
    absl::StatusOr<policy::BatchPlan> plan = (*p)->PlanBatch(b.megatron, b.tensors);
    if (plan.ok()) {
      FUZZ_CHECK(plan->tensors.size() == b.tensors.size(), b.megatron);
      for (size_t i = 0; i < plan->tensors.size(); ++i) {
        const policy::TensorPlan& t = plan->tensors[i];
        FUZZ_CHECK(t.first_output + t.num_outputs <= plan->outputs.size(), b.megatron);
        if (t.partner >= 0) {
          FUZZ_CHECK(static_cast<size_t>(t.partner) < plan->tensors.size() &&
                         plan->tensors[t.partner].partner == static_cast<int>(i),
                     b.megatron);
        }
        FUZZ_CHECK(t.amax_group < static_cast<int>(plan->amax_groups.size()), b.megatron);
      }
    }
    for (const TensorDesc& t : b.tensors) {
      (void)policy::ClassifyOfflineTensor(t, settings.exceptions);
    }
  }
  CheckMatchers(settings.quantization.ignore_rules, NamesFor(settings.quantization.ignore_rules));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {
      absl::StatusOr<policy::PolicySettings> s = policy::ParsePolicySettings(text);
      if (s.ok()) CheckPlans(*s);
      break;
    }
    case 1: {
      absl::StatusOr<policy::QuantizationConfig> q = policy::ParseQuantizationConfig(text);
      if (q.ok()) CheckMatchers(q->ignore_rules, NamesFor(q->ignore_rules));
      break;
    }
    default: {
      const std::vector<absl::string_view> halves = absl::StrSplit(text, absl::MaxSplits('\0', 1));
      std::vector<std::string> rules = absl::StrSplit(halves[0], '\n');
      std::vector<std::string> names = NamesFor(rules);
      if (halves.size() > 1) {
        for (absl::string_view n : absl::StrSplit(halves[1], '\n')) names.emplace_back(n);
      }
      CheckMatchers(std::move(rules), names);
      break;
    }
  }
  return 0;
}
