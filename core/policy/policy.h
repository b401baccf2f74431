// wpub's publication policy (specs/policy.md): for every tensor of a conversion batch, pass it
// through in source precision, quantize it to NVFP4 alone, or quantize it as the gate or up half
// of a pair sharing one global amax; and the exact output tensors that result. Also the offline
// (HF-name) classifier used by checkpoint conversion. Names and metadata only, no tensor bytes.
//
// Public header of the module: includes the settings and the ignore-rule types.
// Thread-safety: Policy is immutable after Create; PlanBatch and the classifiers may be called
// concurrently from any thread. Nothing here blocks except IgnoreSnapshotCache's short lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"
#include "core/policy/ignore_rules.h"
#include "core/policy/settings.h"

namespace wpub::policy {

// NVFP4 block size: one E4M3 scale per 16 elements along the last dim.
inline constexpr int64_t kNvfp4GroupSize = 16;

// What happens to one input tensor.
enum class Action : uint8_t {
  kPass,          // published unchanged (its output is its input desc)
  kQuantize,      // NVFP4, own global amax
  kQuantizeGate,  // NVFP4, gate half of a gate/up pair (shares the pair's global amax)
  kQuantizeUp,    // NVFP4, up half of a gate/up pair
};

// Why. Batch-level reasons apply to every tensor of the batch; the rest are per tensor.
enum class Reason : uint8_t {
  kQuantized,           // routed-expert GEMM weight, candidate: quantized
  kRecipeBf16,          // batch: the recipe quantizes nothing
  kExtraHighPrecision,  // batch: extra_high_precision_layers_* substring in the name
  kNotInLayer,          // batch: no decoder/MTP layer in the Megatron name (embeddings, head...)
  kBf16Layer,           // batch: first/last BF16 layer
  kNotRoutedExpert,     // batch: not mlp.experts.linear_fc{1,2} (attention, dense MLP, router...)
  kSharedExpert,        // shared expert (reported apart from kNotRoutedExpert for clarity)
  kIgnored,             // an ignore rule matches the HF name
  kNotWeight,           // HF name does not end in ".weight" (bias, expert_bias, ...)
  kUnsupportedDType,    // not fp16/bf16/fp32
  kRankBelow2,          // rank < 2
  kNotExpertGemm,       // offline only: routed-expert path but not a GEMM weight suffix
};

// "pass", "quantize", "quantize_gate", "quantize_up".
absl::string_view ActionName(Action action);
// "quantized", "recipe_bf16", "extra_high_precision", "not_in_layer", "bf16_layer",
// "not_routed_expert", "shared_expert", "ignored", "not_weight", "unsupported_dtype",
// "rank_below_2", "not_expert_gemm".
absl::string_view ReasonName(Reason reason);

// The plan for one input tensor.
struct TensorPlan {
  Action action = Action::kPass;
  Reason reason = Reason::kQuantized;
  // Input index of the other member of the gate/up pair; -1 unless kQuantizeGate/kQuantizeUp.
  int partner = -1;
  // Global-amax group (index into BatchPlan::amax_groups); -1 when passed. Pair members share
  // one group and therefore one weight_scale_2.
  int amax_group = -1;
  // Rank-3 [E, M, K] stacked experts: quantized slice by slice, weight_scale_2 has shape [E].
  bool stacked = false;
  // This tensor's outputs are BatchPlan::outputs[first_output, first_output + num_outputs):
  // 1 for a passed tensor, 3 for a quantized one (weight, weight_scale, weight_scale_2).
  size_t first_output = 0;
  size_t num_outputs = 0;
};

// One global scale computation: the amax over all members (over [gate; up] for a pair), per
// slice when stacked (then `slices` = E, else 1).
struct AmaxGroup {
  std::vector<int> members;  // input indices, in input order
  int64_t slices = 1;
};

struct BatchPlan {
  std::string megatron_name;
  Recipe recipe = Recipe::kNvfp4;
  std::vector<TensorPlan> tensors;  // one per input tensor, input order
  std::vector<AmaxGroup> amax_groups;
  // Output order = input order; a quantized X.weight expands to
  //   X.weight          uint8          [M, K/2]   ([E, M, K/2] stacked)   packed e2m1 pairs
  //   X.weight_scale    float8_e4m3fn  [M, K/16]  ([E, M, K/16] stacked)
  //   X.weight_scale_2  float32        []         ([E] stacked)
  // and a passed tensor is its input desc unchanged. No input_scale on the live path.
  std::vector<TensorDesc> outputs;

  // Planned from the HF names (the batch's name holds no Megatron layer, its tensors routed-
  // expert HF names: a trainer without Megatron names) rather than from the Megatron name.
  bool hf_names = false;

  int64_t input_bytes = 0;   // sum of the inputs' nbytes
  int64_t output_bytes = 0;  // sum of the outputs' nbytes
  bool quantizes_anything() const { return !amax_groups.empty(); }
};

// The three output descs of quantizing `input` (a candidate with K % 16 == 0, rank 2 or 3).
// INVALID_ARGUMENT naming the tensor otherwise.
absl::StatusOr<std::vector<TensorDesc>> Nvfp4OutputDescs(const TensorDesc& input);

class Policy {
 public:
  // Validates `settings` (ValidatePolicySettings) and resolves the ignore matcher once for the
  // whole publication: from `cache` when given (borrowed, used only during this call; the
  // matcher is shared-owned, so eviction never invalidates a Policy), else built directly.
  // Errors: invalid settings, a bad `re:` rule (quoted).
  static absl::StatusOr<std::unique_ptr<Policy>> Create(PolicySettings settings,
                                                        IgnoreSnapshotCache* cache = nullptr);

  // Live publication: plans one conversion batch (a Megatron parameter name and the HF tensors
  // the trainer's converter produced for it, in order). Decision order as in specs/policy.md:
  // recipe, extra_high_precision_layers_megatron, layer, first/last BF16 layer, routed-expert
  // match, then per tensor the candidate tests (ignore rules, ".weight", dtype, rank).
  // A batch whose name holds no Megatron layer but whose tensors include a routed-expert HF
  // name (IsRoutedExpertHfName: FSDP/HF trainers, e.g. a batch named after the module) is
  // planned from its HF names instead: each tensor by ClassifyOfflineTensor (the same
  // classifier and precision exceptions as offline conversion), then the ignore rules; the
  // plan's `hf_names` is set. Gate/up pairing and outputs are the same on both roads.
  // INVALID_ARGUMENT naming the tensor for: a candidate with K % 16 != 0 ("Last dim K must be
  // divisible by 16 for NVFP4 (<name>)"), two gates or two ups for one base, a gate without its
  // up (or the reverse) among the candidates, pair members of different K/rank/E, rank > 3.
  absl::StatusOr<BatchPlan> PlanBatch(absl::string_view megatron_name,
                                      absl::Span<const TensorDesc> tensors) const;

  const PolicySettings& settings() const { return settings_; }
  const IgnoreMatcher& ignore_matcher() const { return *matcher_; }

 private:
  Policy(PolicySettings settings, std::shared_ptr<const IgnoreMatcher> matcher)
      : settings_(std::move(settings)), matcher_(std::move(matcher)) {}

  // PlanBatch's road for HF-named batches (see PlanBatch).
  absl::StatusOr<BatchPlan> PlanHfBatch(BatchPlan plan, absl::Span<const TensorDesc> tensors) const;
  // Gate/up pairing, amax groups and outputs of a batch whose per-tensor decisions are made:
  // `candidate[i]` is quantized, every other tensor was given its pass reason.
  static absl::StatusOr<BatchPlan> PlanCandidates(BatchPlan plan,
                                                  absl::Span<const TensorDesc> tensors,
                                                  const std::vector<bool>& candidate);

  PolicySettings settings_;
  std::shared_ptr<const IgnoreMatcher> matcher_;
};

// End-of-ingestion check of a whole publication: a recipe that quantizes (NVFP4) whose plans
// quantize no tensor at all is almost always a naming mismatch (the trainer's names are neither
// Megatron nor HF routed-expert names), and the engines would get source precision where they
// expect NVFP4. INVALID_ARGUMENT naming the recipe, the tensor count and up to three tensors it
// saw (names that mention experts first) with their reasons, unless
// `settings.allow_nothing_quantized` or the recipe is bf16; OK when any plan quantizes. Pure.
absl::Status CheckQuantizesAnything(const PolicySettings& settings,
                                    absl::Span<const BatchPlan> plans);

// ---- Offline conversion (HF checkpoint -> NVFP4 checkpoint; HF names only) ----

// Gate/up role of an HF expert weight name.
enum class PairRole : uint8_t {
  kNone,    // quantized alone (down_proj, w2)
  kGate,    // .gate_proj.weight / .w1.weight
  kUp,      // .up_proj.weight / .w3.weight
  kGateUp,  // .gate_up_proj.weight: gate and up fused in one tensor, one amax
};

// Splits an HF name into (base, role) for the gate/up suffixes; role kNone and an empty base
// when the name has none of them. Live and offline paths use the same suffixes.
struct PairName {
  std::string base;
  PairRole role = PairRole::kNone;
};
PairName SplitPairName(absl::string_view hf_name);

// True iff `hf_name` is a routed-expert GEMM weight by name alone: ends in ".weight", holds no
// shared-expert marker (".shared_expert.", ".shared_experts."; this veto comes first, so
// `experts` nested in a shared-expert path never counts), holds a routed marker (".experts.",
// "block_sparse_moe.experts.", ".moe.experts.") and ends in an expert GEMM suffix (.w1/.w2/.w3,
// .gate_proj/.up_proj/.down_proj/.gate_up_proj + ".weight").
bool IsRoutedExpertHfName(absl::string_view hf_name);

struct OfflineDecision {
  bool quantize = false;
  Reason reason = Reason::kQuantized;
  PairRole role = PairRole::kNone;  // meaningful when quantize
  std::string pair_base;            // gate/up base when role is kGate/kUp
};

// Offline classifier. Order: extra_high_precision_layers_hf substrings; BF16 head/tail layer
// (`model.layers.{i}.` for i < start or i >= num_layers - end); ".weight"; shared-expert veto;
// routed marker and GEMM suffix; dtype; rank; K % 16 (INVALID_ARGUMENT naming the tensor).
// Ignore rules are not consulted: offline conversion writes the ignore list, it does not read
// one. Pairing across shards is the converter's job (match pair_base over the whole checkpoint).
absl::StatusOr<OfflineDecision> ClassifyOfflineTensor(const TensorDesc& tensor,
                                                      const PrecisionExceptions& exceptions);

}  // namespace wpub::policy
