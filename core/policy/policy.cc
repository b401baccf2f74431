// The live-publication planner: batch-level decision (specs/policy.md, "Decision, in this
// order"), per-tensor candidate tests, gate/up pairing and the NVFP4 output descriptors.
#include "core/policy/policy.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/policy/names.h"

namespace wpub::policy {
namespace {

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

// A candidate's shape: K % 16 == 0 and rank 2 or 3 (INVALID_ARGUMENT naming the tensor).
absl::Status CheckQuantizableShape(const TensorDesc& t) {
  if (t.shape.back() % kNvfp4GroupSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Last dim K must be divisible by ",
                                                   kNvfp4GroupSize, " for NVFP4 (", t.name,
                                                   "): K = ", t.shape.back()));
  }
  if (t.shape.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantizes rank-2 [M, K] or stacked rank-3 [E, M, K] tensors; ", t.name,
                     " has shape ", ShapeString(t.shape)));
  }
  return absl::OkStatus();
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
  // 2. The ignore rules were merged and compiled once, in Create.
  // 3. Layer (decoder, else MTP). A batch named otherwise that holds routed-expert HF names
  // comes from a trainer without Megatron names (FSDP, HF): its HF names decide.
  std::optional<MegatronLayer> layer = ParseMegatronLayer(megatron_name);
  if (!layer) {
    const bool hf_experts = std::any_of(tensors.begin(), tensors.end(), [](const TensorDesc& t) {
      return IsRoutedExpertHfName(t.name);
    });
    if (!hf_experts) return PassAll(std::move(plan), tensors, Reason::kNotInLayer);
    return PlanHfBatch(std::move(plan), tensors);
  }
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
  if (!IsRoutedExpertGemmRest(layer->rest)) {
    const bool shared = absl::StartsWith(layer->rest, "mlp.shared_experts.");
    return PassAll(std::move(plan), tensors,
                   shared ? Reason::kSharedExpert : Reason::kNotRoutedExpert);
  }

  // Quantize the batch: the candidate tests per tensor, then gate/up pairing.
  const size_t n = tensors.size();
  plan.tensors.resize(n);
  std::vector<bool> candidate(n, false);
  for (size_t i = 0; i < n; ++i) {
    const TensorDesc& t = tensors[i];
    if (std::optional<Reason> why = NotCandidateReason(t, *matcher_)) {
      plan.tensors[i].action = Action::kPass;
      plan.tensors[i].reason = *why;
      continue;
    }
    WPUB_RETURN_IF_ERROR(CheckQuantizableShape(t));
    candidate[i] = true;
  }
  return PlanCandidates(std::move(plan), tensors, candidate);
}

absl::StatusOr<BatchPlan> Policy::PlanHfBatch(BatchPlan plan,
                                              absl::Span<const TensorDesc> tensors) const {
  plan.hf_names = true;
  const size_t n = tensors.size();
  plan.tensors.resize(n);
  std::vector<bool> candidate(n, false);
  for (size_t i = 0; i < n; ++i) {
    const TensorDesc& t = tensors[i];
    // The offline classifier decides (one classifier for HF names on both paths); the ignore
    // rules, which offline conversion writes rather than reads, veto its candidates, before
    // their shape is checked as on the Megatron path.
    absl::StatusOr<OfflineDecision> d = ClassifyOfflineTensor(t, settings_.exceptions);
    if (d.ok() && !d->quantize) {
      plan.tensors[i].action = Action::kPass;
      plan.tensors[i].reason = d->reason;
      continue;
    }
    if (matcher_->IsIgnored(t.name)) {
      plan.tensors[i].action = Action::kPass;
      plan.tensors[i].reason = Reason::kIgnored;
      continue;
    }
    if (!d.ok()) return d.status();
    candidate[i] = true;
  }
  return PlanCandidates(std::move(plan), tensors, candidate);
}

absl::StatusOr<BatchPlan> Policy::PlanCandidates(BatchPlan plan,
                                                 absl::Span<const TensorDesc> tensors,
                                                 const std::vector<bool>& candidate) {
  const size_t n = tensors.size();
  struct PairSlots {
    absl::string_view base;
    int gate = -1;
    int up = -1;
  };
  // A batch holds a handful of tensors: a linear search beats a map and allocates nothing.
  std::vector<PairSlots> pairs;
  for (size_t i = 0; i < n; ++i) {
    if (!candidate[i]) continue;
    const TensorDesc& t = tensors[i];
    plan.tensors[i].stacked = t.shape.size() == 3;
    absl::string_view base;
    const PairRole role = PairRoleOf(t.name, &base);
    if (role != PairRole::kGate && role != PairRole::kUp) {
      plan.tensors[i].action = Action::kQuantize;
      continue;
    }
    const bool gate = role == PairRole::kGate;
    auto it = std::find_if(pairs.begin(), pairs.end(),
                           [base](const PairSlots& p) { return p.base == base; });
    PairSlots& slots = it != pairs.end() ? *it : pairs.emplace_back(PairSlots{base});
    int& slot = gate ? slots.gate : slots.up;
    if (slot >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NVFP4 requires a single complete gate/up pair per conversion batch; found duplicate ",
          gate ? "gate" : "up", " tensor for ", base, ": ", tensors[slot].name, " and ", t.name,
          " (Megatron ", plan.megatron_name, ")"));
    }
    slot = static_cast<int>(i);
    plan.tensors[i].action = gate ? Action::kQuantizeGate : Action::kQuantizeUp;
  }
  for (const PairSlots& slots : pairs) {
    if (slots.gate < 0 || slots.up < 0) {
      const int have = slots.gate >= 0 ? slots.gate : slots.up;
      return absl::InvalidArgumentError(absl::StrCat(
          "NVFP4 requires a single complete gate/up pair per conversion batch: ",
          tensors[have].name, " has no ", slots.gate >= 0 ? "up" : "gate",
          " partner among the quantized tensors of ", plan.megatron_name,
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
