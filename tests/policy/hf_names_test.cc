// The live planner on batches from trainers without Megatron names (FSDP/HF: the batch is named
// after the HF module or tensor), and the end-of-ingestion check that a quantizing recipe
// quantized something (CheckQuantizesAnything), with the settings flag that allows it.
#include <gtest/gtest.h>

#include "core/policy/policy.h"
#include "tests/policy/test_util.h"

namespace wpub::policy {
namespace {

using testing::Bf16;
using testing::HasSubstr;
using testing::MakePolicy;
using testing::Nvfp4Settings;

std::string Expert(int layer, int expert, const std::string& leaf) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + "." +
         leaf;
}

TEST(PolicyHfNames, RoutedExpertPairAndDownAreQuantizedUnderAnHfBatchName) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> fc1 = {Bf16(Expert(3, 7, "gate_proj.weight"), {32, 64}),
                                       Bf16(Expert(3, 7, "up_proj.weight"), {32, 64})};
  auto plan = policy->PlanBatch("model.layers.3.mlp.experts.7", fc1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->hf_names);
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeGate);
  EXPECT_EQ(plan->tensors[1].action, Action::kQuantizeUp);
  EXPECT_EQ(plan->tensors[0].amax_group, plan->tensors[1].amax_group);
  ASSERT_EQ(plan->outputs.size(), 6u);
  EXPECT_EQ(plan->outputs[1].name, Expert(3, 7, "gate_proj.weight_scale"));

  // The HF name itself as the batch name (an identity converter), down_proj alone.
  const std::vector<TensorDesc> down = {Bf16(Expert(3, 7, "down_proj.weight"), {64, 32})};
  plan = policy->PlanBatch(down[0].name, down);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantize);
  EXPECT_EQ(plan->tensors[0].reason, Reason::kQuantized);

  // Mixtral's w1/w3 pair, block_sparse_moe marker; a fused gate_up_proj alone.
  const std::vector<TensorDesc> mixtral = {
      Bf16("model.layers.1.block_sparse_moe.experts.2.w1.weight", {32, 64}),
      Bf16("model.layers.1.block_sparse_moe.experts.2.w3.weight", {32, 64})};
  plan = policy->PlanBatch("model.layers.1.block_sparse_moe.experts.2", mixtral);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeGate);
  EXPECT_EQ(plan->tensors[1].action, Action::kQuantizeUp);
  const std::vector<TensorDesc> fused = {Bf16(Expert(2, 0, "gate_up_proj.weight"), {64, 64})};
  plan = policy->PlanBatch(fused[0].name, fused);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantize);
}

TEST(PolicyHfNames, SharedExpertsAndNonExpertTensorsOfAnHfBatchPassWithOfflineReasons) {
  auto policy = MakePolicy(Nvfp4Settings());
  // One batch holding a routed pair, its bias and a shared-expert weight: the HF road is
  // taken (a routed name is present) and each tensor gets the offline classifier's reason.
  const std::vector<TensorDesc> in = {
      Bf16(Expert(4, 0, "gate_proj.weight"), {32, 64}),
      Bf16(Expert(4, 0, "up_proj.weight"), {32, 64}),
      Bf16(Expert(4, 0, "gate_proj.bias"), {32}),
      Bf16("model.layers.4.mlp.shared_experts.experts.0.up_proj.weight", {32, 64}),
      Bf16("model.layers.4.mlp.experts.0.router.weight", {32, 64}),
      TensorDesc{Expert(4, 1, "down_proj.weight"), DType::kInt32, {64, 32}},
      Bf16(Expert(4, 2, "down_proj.weight"), {64}),
  };
  auto plan = policy->PlanBatch("model.layers.4.mlp", in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<Reason> want = {
      Reason::kQuantized,     Reason::kQuantized,        Reason::kNotWeight, Reason::kSharedExpert,
      Reason::kNotExpertGemm, Reason::kUnsupportedDType, Reason::kRankBelow2};
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(plan->tensors[i].reason, want[i])
        << in[i].name << ": " << ReasonName(plan->tensors[i].reason);
  }
  EXPECT_EQ(plan->amax_groups.size(), 1u);

  // Without any routed HF name the batch keeps the Megatron road's reason (embeddings, head).
  const std::vector<TensorDesc> embed = {Bf16("model.embed_tokens.weight", {1024, 64})};
  plan = policy->PlanBatch("model.embed_tokens.weight", embed);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->hf_names);
  EXPECT_EQ(plan->tensors[0].reason, Reason::kNotInLayer);
  const std::vector<TensorDesc> shared = {
      Bf16("model.layers.4.mlp.shared_expert.gate_proj.weight", {32, 64}),
      Bf16("model.layers.4.mlp.shared_expert.up_proj.weight", {32, 64})};
  plan = policy->PlanBatch("model.layers.4.mlp.shared_expert", shared);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->quantizes_anything());
}

TEST(PolicyHfNames, PrecisionExceptionsAndIgnoreRulesApplyToHfBatches) {
  PolicySettings s = Nvfp4Settings({"model.layers.5.mlp.experts.1", "re:.*experts\\.2\\."});
  s.exceptions.first_last_layers_bf16 = true;
  s.exceptions.num_layers = 8;
  s.exceptions.num_layers_at_start_in_bf16 = 1;
  s.exceptions.num_layers_at_end_in_bf16 = 1;
  s.exceptions.extra_high_precision_layers_hf = {"experts.3.down_proj"};
  s.exceptions.extra_high_precision_layers_megatron = {"keep_this_batch"};
  auto policy = MakePolicy(s);
  struct Case {
    std::string batch;
    std::string tensor;
    Reason reason;
  };
  const std::vector<Case> cases = {
      {"b", Expert(0, 0, "down_proj.weight"), Reason::kBf16Layer},
      {"b", Expert(7, 0, "down_proj.weight"), Reason::kBf16Layer},
      {"b", Expert(5, 3, "down_proj.weight"), Reason::kExtraHighPrecision},
      {"b", Expert(5, 1, "down_proj.weight"), Reason::kIgnored},
      {"b", Expert(5, 2, "down_proj.weight"), Reason::kIgnored},
      {"keep_this_batch", Expert(5, 0, "down_proj.weight"), Reason::kExtraHighPrecision},
      {"b", Expert(5, 0, "down_proj.weight"), Reason::kQuantized},
  };
  for (const Case& c : cases) {
    const std::vector<TensorDesc> in = {Bf16(c.tensor, {64, 32})};
    auto plan = policy->PlanBatch(c.batch, in);
    ASSERT_TRUE(plan.ok()) << c.tensor << ": " << plan.status();
    EXPECT_EQ(plan->tensors[0].reason, c.reason)
        << c.tensor << ": " << ReasonName(plan->tensors[0].reason);
  }
  // An ignored tensor is not shape-checked, as on the Megatron road.
  const std::vector<TensorDesc> odd = {Bf16(Expert(5, 1, "down_proj.weight"), {64, 40})};
  EXPECT_TRUE(policy->PlanBatch("b", odd).ok());
}

TEST(PolicyHfNames, HfBatchErrorsNameTheTensor) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> k40 = {Bf16(Expert(2, 0, "down_proj.weight"), {64, 40})};
  auto plan = policy->PlanBatch("x", k40);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(plan.status(), "Last dim K must be divisible by 16 for NVFP4"));
  EXPECT_TRUE(HasSubstr(plan.status(), k40[0].name));

  // The gate and the up of one expert in two batches: one amax cannot be shared.
  const std::vector<TensorDesc> gate = {Bf16(Expert(2, 0, "gate_proj.weight"), {32, 64})};
  plan = policy->PlanBatch(gate[0].name, gate);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), gate[0].name));
  EXPECT_TRUE(HasSubstr(plan.status(), "has no up partner"));
}

// Plans of a publication through `policy`, one batch per (name, tensors).
std::vector<BatchPlan> PlanAll(
    const Policy& policy,
    const std::vector<std::pair<std::string, std::vector<TensorDesc>>>& batches) {
  std::vector<BatchPlan> plans;
  for (const auto& [name, tensors] : batches) {
    auto plan = policy.PlanBatch(name, tensors);
    EXPECT_TRUE(plan.ok()) << name << ": " << plan.status();
    if (plan.ok()) plans.push_back(*std::move(plan));
  }
  return plans;
}

TEST(PolicyCoverage, AQuantizingRecipeThatQuantizesNothingNamesTheRecipeAndTensors) {
  auto policy = MakePolicy(Nvfp4Settings());
  // A converter that left its own names on the experts: nothing matches either road.
  const auto plans = PlanAll(
      *policy, {{"model.embed_tokens.weight", {Bf16("model.embed_tokens.weight", {64, 64})}},
                {"layers.0.moe.w_in.3", {Bf16("layers.0.moe.expert3.w_in", {32, 64})}},
                {"layers.0.moe.w_out.3", {Bf16("layers.0.moe.expert3.w_out", {64, 32})}},
                {"layers.0.norm", {Bf16("layers.0.norm.weight", {64})}}});
  ASSERT_EQ(plans.size(), 4u);
  const absl::Status s = CheckQuantizesAnything(policy->settings(), plans);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(s, "recipe nvfp4")) << s;
  EXPECT_TRUE(HasSubstr(s, "4 tensors")) << s;
  // Names that mention experts come first; three at most.
  EXPECT_TRUE(HasSubstr(s,
                        "'layers.0.moe.expert3.w_in' in batch 'layers.0.moe.w_in.3': "
                        "not_in_layer"))
      << s;
  EXPECT_TRUE(HasSubstr(s, "layers.0.moe.expert3.w_out")) << s;
  EXPECT_TRUE(HasSubstr(s, "model.embed_tokens.weight")) << s;
  EXPECT_FALSE(HasSubstr(s, "layers.0.norm.weight")) << s;
  EXPECT_TRUE(HasSubstr(s, "allow_nothing_quantized")) << s;
}

TEST(PolicyCoverage, OkWhenAnythingIsQuantizedAllowedOrBf16) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<std::pair<std::string, std::vector<TensorDesc>>> batches = {
      {"model.norm.weight", {Bf16("model.norm.weight", {64})}},
      {"model.layers.1.mlp.experts.0.down_proj.weight",
       {Bf16("model.layers.1.mlp.experts.0.down_proj.weight", {64, 32})}}};
  EXPECT_TRUE(CheckQuantizesAnything(policy->settings(), PlanAll(*policy, batches)).ok());

  const std::vector<std::pair<std::string, std::vector<TensorDesc>>> norms = {
      {"model.norm.weight", {Bf16("model.norm.weight", {64})}}};
  const auto plans = PlanAll(*policy, norms);
  EXPECT_FALSE(CheckQuantizesAnything(policy->settings(), plans).ok());
  PolicySettings allowed = Nvfp4Settings();
  allowed.allow_nothing_quantized = true;
  EXPECT_TRUE(CheckQuantizesAnything(allowed, plans).ok());
  PolicySettings bf16;
  bf16.recipe = Recipe::kBf16;
  EXPECT_TRUE(CheckQuantizesAnything(bf16, plans).ok());
  // An empty publication is refused elsewhere (it has no tensors); nothing to name here.
  EXPECT_FALSE(CheckQuantizesAnything(policy->settings(), {}).ok());
}

TEST(PolicyCoverage, TheFlagIsReadFromTheSettingsDocument) {
  auto s = ParsePolicySettings(
      R"({"quantization_config": {"quant_algo": "NVFP4"}, "allow_nothing_quantized": true})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->allow_nothing_quantized);
  s = ParsePolicySettings(R"({"quantization_config": {"quant_algo": "NVFP4"}})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->allow_nothing_quantized);
  s = ParsePolicySettings(
      R"({"quantization_config": {"quant_algo": "NVFP4"}, "allow_nothing_quantized": 1})");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(HasSubstr(s.status(), "allow_nothing_quantized must be a boolean"));
}

}  // namespace
}  // namespace wpub::policy
