// The live-publication planner: batch-level decision (specs/policy.md, "Decision, in this
// order"), per-tensor candidate tests, gate/up pairing and the NVFP4 output descriptors.
#include "core/policy/policy.h"

#include <map>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/common/status.h"
#include "re2/re2.h"

namespace wpub::policy {
namespace {

// The trainer's patterns, verbatim (including the unescaped '.' after "mlp"): RE2 follows
// Perl/Python leftmost-first submatch rules, so the groups are the ones Python sees.
const LazyRE2 kDecoderLayerRe = {R"(decoder\.layers\.(\d+)\.(.+))"};
const LazyRE2 kMtpLayerRe = {R"(mtp\.layers\.(\d+)\.(.+))"};
const LazyRE2 kRoutedExpertRe = {R"(mlp.experts\.(.+)\.weight(\d+))"};

struct LayerMatch {
  std::string index_digits;
  std::string rest;
};

// re.search of the decoder pattern, else of the MTP pattern with the wrapper modules removed.
std::optional<LayerMatch> MatchLayer(absl::string_view megatron_name) {
  LayerMatch m;
  const re2::StringPiece text(megatron_name.data(), megatron_name.size());
  if (RE2::PartialMatch(text, *kDecoderLayerRe, &m.index_digits, &m.rest)) return m;
  if (RE2::PartialMatch(text, *kMtpLayerRe, &m.index_digits, &m.rest)) {
    // Two passes in this order, as Python's chained str.replace does.
    m.rest = absl::StrReplaceAll(m.rest, {{"transformer_layer.", ""}});
    m.rest = absl::StrReplaceAll(m.rest, {{"mtp_model_layer.", ""}});
    return m;
  }
  return std::nullopt;
}

// re.match of the routed-expert pattern (anchored at the start only) with group 1 in
// {linear_fc1, linear_fc2}.
bool IsRoutedExpertGemm(absl::string_view rest) {
  const re2::StringPiece text(rest.data(), rest.size());
  re2::StringPiece groups[2];
  if (!kRoutedExpertRe->Match(text, 0, text.size(), RE2::ANCHOR_START, groups, 2)) return false;
  return groups[1] == "linear_fc1" || groups[1] == "linear_fc2";
}

BatchPlan PassAll(BatchPlan plan, absl::Span<const TensorDesc> tensors, Reason reason) {
  plan.tensors.resize(tensors.size());
  plan.outputs.assign(tensors.begin(), tensors.end());
  for (size_t i = 0; i < tensors.size(); ++i) {
    plan.tensors[i] = TensorPlan{Action::kPass, reason, -1, -1, false, i, 1};
  }
  plan.output_bytes = plan.input_bytes;
  return plan;
}

// The candidate tests of one tensor in a routed-expert batch, in the trainer's order;
// nullopt = candidate.
std::optional<Reason> NotCandidateReason(const TensorDesc& t, const IgnoreMatcher& ignore) {
  if (ignore.IsIgnored(t.name)) return Reason::kIgnored;
  if (!absl::EndsWith(t.name, ".weight")) return Reason::kNotWeight;
  if (!IsQuantizableFloat(t.dtype)) return Reason::kUnsupportedDType;
  if (t.shape.size() < 2) return Reason::kRankBelow2;
  return std::nullopt;
}

absl::Status CheckPairCompatible(const TensorDesc& gate, const TensorDesc& up) {
  const bool same = gate.shape.size() == up.shape.size() && gate.shape.back() == up.shape.back() &&
                    (gate.shape.size() != 3 || gate.shape[0] == up.shape[0]);
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "gate/up pair must agree in rank, last dim and expert count to share one global amax: ",
      gate.name, " ", ShapeString(gate.shape), " vs ", up.name, " ", ShapeString(up.shape)));
}

}  // namespace

absl::string_view ActionName(Action action) {
  switch (action) {
    case Action::kPass:
      return "pass";
    case Action::kQuantize:
      return "quantize";
    case Action::kQuantizeGate:
      return "quantize_gate";
    case Action::kQuantizeUp:
      return "quantize_up";
  }
  return "unknown";
}

absl::string_view ReasonName(Reason reason) {
  switch (reason) {
    case Reason::kQuantized:
      return "quantized";
    case Reason::kRecipeBf16:
      return "recipe_bf16";
    case Reason::kExtraHighPrecision:
      return "extra_high_precision";
    case Reason::kNotInLayer:
      return "not_in_layer";
    case Reason::kBf16Layer:
      return "bf16_layer";
    case Reason::kNotRoutedExpert:
      return "not_routed_expert";
    case Reason::kSharedExpert:
      return "shared_expert";
    case Reason::kIgnored:
      return "ignored";
    case Reason::kNotWeight:
      return "not_weight";
    case Reason::kUnsupportedDType:
      return "unsupported_dtype";
    case Reason::kRankBelow2:
      return "rank_below_2";
    case Reason::kNotExpertGemm:
      return "not_expert_gemm";
  }
  return "unknown";
}

absl::StatusOr<std::vector<TensorDesc>> Nvfp4OutputDescs(const TensorDesc& input) {
  const size_t rank = input.shape.size();
  if (rank != 2 && rank != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantizes rank-2 [M, K] or stacked rank-3 [E, M, K] tensors; ",
                     input.name, " has shape ", ShapeString(input.shape)));
  }
  if (!IsQuantizableFloat(input.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 quantizes fp16/bf16/fp32; ", input.name,
                                                   " is ", DTypeName(input.dtype)));
  }
  if (!absl::EndsWith(input.name, ".weight")) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantizes \".weight\" tensors only; got ", input.name));
  }
  const int64_t k = input.shape.back();
  if (k % kNvfp4GroupSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Last dim K must be divisible by ",
                                                   kNvfp4GroupSize, " for NVFP4 (", input.name,
                                                   "): K = ", k));
  }
  Shape packed = input.shape;
  packed.back() = k / 2;
  Shape scale = input.shape;
  scale.back() = k / kNvfp4GroupSize;
  Shape scale_2 = rank == 3 ? Shape{input.shape[0]} : Shape{};
  return std::vector<TensorDesc>{
      {input.name, DType::kUInt8, std::move(packed)},
      {absl::StrCat(input.name, "_scale"), DType::kFloat8E4M3, std::move(scale)},
      {absl::StrCat(input.name, "_scale_2"), DType::kFloat32, std::move(scale_2)},
  };
}

absl::StatusOr<std::unique_ptr<Policy>> Policy::Create(PolicySettings settings,
                                                       IgnoreSnapshotCache* cache) {
  WPUB_RETURN_IF_ERROR(ValidatePolicySettings(settings));
  std::shared_ptr<const IgnoreMatcher> matcher;
  if (cache != nullptr) {
    WPUB_ASSIGN_OR_RETURN(matcher, cache->Get(settings.quantization.ignore_rules));
  } else {
    WPUB_ASSIGN_OR_RETURN(IgnoreMatcher built,
                          IgnoreMatcher::Create(settings.quantization.ignore_rules));
    matcher = std::make_shared<const IgnoreMatcher>(std::move(built));
  }
  return std::unique_ptr<Policy>(new Policy(std::move(settings), std::move(matcher)));
}

absl::StatusOr<BatchPlan> Policy::PlanBatch(absl::string_view megatron_name,
                                            absl::Span<const TensorDesc> tensors) const {
  BatchPlan plan;
  plan.megatron_name = std::string(megatron_name);
  plan.recipe = settings_.recipe;
  for (const TensorDesc& t : tensors) plan.input_bytes += t.nbytes();

  if (!IsNvfp4(settings_.recipe)) return PassAll(std::move(plan), tensors, Reason::kRecipeBf16);
  // 1. Extra high-precision layers (substring of the Megatron name): the whole batch passes.
  for (const std::string& s : settings_.exceptions.extra_high_precision_layers_megatron) {
    if (absl::StrContains(megatron_name, s)) {
      return PassAll(std::move(plan), tensors, Reason::kExtraHighPrecision);
    }
  }
  // 3. Layer (decoder, else MTP).
  std::optional<LayerMatch> layer = MatchLayer(megatron_name);
  if (!layer) return PassAll(std::move(plan), tensors, Reason::kNotInLayer);
  // 4. First/last BF16 layers; the MTP index is compared the same way (see settings.h).
  const PrecisionExceptions& e = settings_.exceptions;
  if (e.first_last_layers_bf16) {
    int64_t index = 0;
    if (!absl::SimpleAtoi(layer->index_digits, &index)) {
      return absl::InvalidArgumentError(absl::StrCat("layer index ", layer->index_digits, " in ",
                                                     megatron_name, " is out of range"));
    }
    if (index < e.num_layers_at_start_in_bf16 ||
        index >= e.num_layers - e.num_layers_at_end_in_bf16) {
      return PassAll(std::move(plan), tensors, Reason::kBf16Layer);
    }
  }
  // 5. Routed-expert GEMMs only.
  if (!IsRoutedExpertGemm(layer->rest)) {
    const bool shared = absl::StartsWith(layer->rest, "mlp.shared_experts.");
    return PassAll(std::move(plan), tensors,
                   shared ? Reason::kSharedExpert : Reason::kNotRoutedExpert);
  }

  // Quantize the batch: candidates, then gate/up pairing among the candidates.
  const size_t n = tensors.size();
  plan.tensors.resize(n);
  std::vector<bool> candidate(n, false);
  struct PairSlots {
    int gate = -1;
    int up = -1;
  };
  std::map<std::string, PairSlots> pairs;  // ordered: deterministic error reporting
  for (size_t i = 0; i < n; ++i) {
    const TensorDesc& t = tensors[i];
    if (std::optional<Reason> why = NotCandidateReason(t, *matcher_)) {
      plan.tensors[i].action = Action::kPass;
      plan.tensors[i].reason = *why;
      continue;
    }
    if (t.shape.back() % kNvfp4GroupSize != 0) {
      return absl::InvalidArgumentError(absl::StrCat("Last dim K must be divisible by ",
                                                     kNvfp4GroupSize, " for NVFP4 (", t.name,
                                                     "): K = ", t.shape.back()));
    }
    if (t.shape.size() > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("NVFP4 quantizes rank-2 [M, K] or stacked rank-3 [E, M, K] tensors; ",
                       t.name, " has shape ", ShapeString(t.shape)));
    }
    candidate[i] = true;
    plan.tensors[i].stacked = t.shape.size() == 3;
    PairName pn = SplitPairName(t.name);
    if (pn.role != PairRole::kGate && pn.role != PairRole::kUp) {
      plan.tensors[i].action = Action::kQuantize;
      continue;
    }
    const bool gate = pn.role == PairRole::kGate;
    PairSlots& slots = pairs[pn.base];
    int& slot = gate ? slots.gate : slots.up;
    if (slot >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NVFP4 requires a single complete gate/up pair per conversion batch; found duplicate ",
          gate ? "gate" : "up", " tensor for ", pn.base, ": ", tensors[slot].name, " and ", t.name,
          " (Megatron ", megatron_name, ")"));
    }
    slot = static_cast<int>(i);
    plan.tensors[i].action = gate ? Action::kQuantizeGate : Action::kQuantizeUp;
  }
  for (const auto& [base, slots] : pairs) {
    if (slots.gate < 0 || slots.up < 0) {
      const int have = slots.gate >= 0 ? slots.gate : slots.up;
      return absl::InvalidArgumentError(absl::StrCat(
          "NVFP4 requires a single complete gate/up pair per conversion batch: ",
          tensors[have].name, " has no ", slots.gate >= 0 ? "up" : "gate",
          " partner among the quantized tensors of ", megatron_name,
          " (both halves must share one global amax; an ignored or non-candidate partner "
          "counts as missing)"));
    }
    WPUB_RETURN_IF_ERROR(CheckPairCompatible(tensors[slots.gate], tensors[slots.up]));
    plan.tensors[slots.gate].partner = slots.up;
    plan.tensors[slots.up].partner = slots.gate;
  }

  // Amax groups in input order of their first member, then outputs in input order.
  for (size_t i = 0; i < n; ++i) {
    TensorPlan& tp = plan.tensors[i];
    tp.first_output = plan.outputs.size();
    if (!candidate[i]) {
      plan.outputs.push_back(tensors[i]);
      tp.num_outputs = 1;
      continue;
    }
    tp.reason = Reason::kQuantized;
    if (tp.partner >= 0 && tp.partner < static_cast<int>(i)) {
      tp.amax_group = plan.tensors[tp.partner].amax_group;
      plan.amax_groups[tp.amax_group].members.push_back(static_cast<int>(i));
    } else {
      tp.amax_group = static_cast<int>(plan.amax_groups.size());
      plan.amax_groups.push_back(
          AmaxGroup{{static_cast<int>(i)}, tp.stacked ? tensors[i].shape[0] : 1});
    }
    WPUB_ASSIGN_OR_RETURN(std::vector<TensorDesc> outs, Nvfp4OutputDescs(tensors[i]));
    tp.num_outputs = outs.size();
    for (TensorDesc& o : outs) plan.outputs.push_back(std::move(o));
  }
  for (const TensorDesc& o : plan.outputs) plan.output_bytes += o.nbytes();
  return plan;
}

}  // namespace wpub::policy
