// PlanBatch on the live path (Megatron name + HF tensors): every decision of specs/policy.md
// with DeepSeek-V3 / GLM / Qwen3-MoE / Mixtral names, gate/up pairing, errors, output descs.
#include <gtest/gtest.h>

#include "core/policy/policy.h"
#include "tests/policy/test_util.h"

namespace wpub::policy {
namespace {

using testing::Bf16;
using testing::HasSubstr;
using testing::MakePolicy;
using testing::Nvfp4Settings;

// GLM-4.5 routed expert 3 of layer 7: fc1 -> gate_proj + up_proj [1536, 5120].
std::vector<TensorDesc> GlmFc1(int layer, int expert, int64_t m = 1536, int64_t k = 5120) {
  const std::string base =
      "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + ".";
  return {Bf16(base + "gate_proj.weight", {m, k}), Bf16(base + "up_proj.weight", {m, k})};
}
std::string MgFc1(int layer, int expert) {
  return "decoder.layers." + std::to_string(layer) + ".mlp.experts.linear_fc1.weight" +
         std::to_string(expert);
}

void ExpectAllPass(const BatchPlan& plan, absl::Span<const TensorDesc> in, Reason reason) {
  ASSERT_EQ(plan.tensors.size(), in.size());
  ASSERT_EQ(plan.outputs.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(plan.tensors[i].action, Action::kPass) << in[i].name;
    EXPECT_EQ(plan.tensors[i].reason, reason)
        << in[i].name << ": " << ReasonName(plan.tensors[i].reason);
    EXPECT_EQ(plan.outputs[i], in[i]);
  }
  EXPECT_FALSE(plan.quantizes_anything());
  EXPECT_EQ(plan.output_bytes, plan.input_bytes);
}

TEST(PolicyPlan, RoutedExpertFc1IsAGateUpPairWithExactOutputs) {
  auto policy = MakePolicy(Nvfp4Settings());
  const auto in = GlmFc1(7, 3);
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->tensors.size(), 2u);
  const TensorPlan& gate = plan->tensors[0];
  const TensorPlan& up = plan->tensors[1];
  EXPECT_EQ(gate.action, Action::kQuantizeGate);
  EXPECT_EQ(up.action, Action::kQuantizeUp);
  EXPECT_EQ(gate.reason, Reason::kQuantized);
  EXPECT_EQ(gate.partner, 1);
  EXPECT_EQ(up.partner, 0);
  EXPECT_EQ(gate.amax_group, up.amax_group);
  ASSERT_EQ(plan->amax_groups.size(), 1u);
  EXPECT_EQ(plan->amax_groups[0].members, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan->amax_groups[0].slices, 1);
  EXPECT_FALSE(gate.stacked);

  const std::string g = "model.layers.7.mlp.experts.3.gate_proj.";
  const std::string u = "model.layers.7.mlp.experts.3.up_proj.";
  const std::vector<TensorDesc> expected = {
      {g + "weight", DType::kUInt8, {1536, 2560}},
      {g + "weight_scale", DType::kFloat8E4M3, {1536, 320}},
      {g + "weight_scale_2", DType::kFloat32, {}},
      {u + "weight", DType::kUInt8, {1536, 2560}},
      {u + "weight_scale", DType::kFloat8E4M3, {1536, 320}},
      {u + "weight_scale_2", DType::kFloat32, {}},
  };
  EXPECT_EQ(plan->outputs, expected);
  EXPECT_EQ(gate.first_output, 0u);
  EXPECT_EQ(gate.num_outputs, 3u);
  EXPECT_EQ(up.first_output, 3u);
  EXPECT_EQ(plan->input_bytes, 2 * 1536 * 5120 * 2);
  EXPECT_EQ(plan->output_bytes, 2 * (1536 * 2560 + 1536 * 320 + 4));
}

TEST(PolicyPlan, OutputOrderFollowsInputOrderEvenUpFirst) {
  auto policy = MakePolicy(Nvfp4Settings());
  auto in = GlmFc1(9, 0);
  std::swap(in[0], in[1]);
  auto plan = policy->PlanBatch(MgFc1(9, 0), in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeUp);
  EXPECT_EQ(plan->tensors[1].action, Action::kQuantizeGate);
  EXPECT_EQ(plan->outputs[0].name, "model.layers.9.mlp.experts.0.up_proj.weight");
  EXPECT_EQ(plan->outputs[3].name, "model.layers.9.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(plan->amax_groups[0].members, (std::vector<int>{0, 1}));
}

TEST(PolicyPlan, DownProjIsQuantizedAlone) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> in = {
      Bf16("model.layers.7.mlp.experts.3.down_proj.weight", {5120, 1536})};
  auto plan = policy->PlanBatch("decoder.layers.7.mlp.experts.linear_fc2.weight3", in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantize);
  EXPECT_EQ(plan->tensors[0].partner, -1);
  EXPECT_EQ(plan->tensors[0].amax_group, 0);
  ASSERT_EQ(plan->outputs.size(), 3u);
  EXPECT_EQ(plan->outputs[0], (TensorDesc{in[0].name, DType::kUInt8, {5120, 768}}));
  EXPECT_EQ(plan->outputs[1], (TensorDesc{in[0].name + "_scale", DType::kFloat8E4M3, {5120, 96}}));
  EXPECT_EQ(plan->outputs[2], (TensorDesc{in[0].name + "_scale_2", DType::kFloat32, {}}));
}

TEST(PolicyPlan, MixtralW1W3PairAndW2Alone) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::string e = "model.layers.31.block_sparse_moe.experts.7.";
  const std::vector<TensorDesc> fc1 = {Bf16(e + "w1.weight", {14336, 4096}),
                                       Bf16(e + "w3.weight", {14336, 4096})};
  auto plan = policy->PlanBatch("decoder.layers.31.mlp.experts.linear_fc1.weight7", fc1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeGate);
  EXPECT_EQ(plan->tensors[1].action, Action::kQuantizeUp);
  EXPECT_EQ(plan->tensors[0].amax_group, plan->tensors[1].amax_group);
  EXPECT_EQ(plan->outputs[2].name, e + "w1.weight_scale_2");

  const std::vector<TensorDesc> fc2 = {Bf16(e + "w2.weight", {4096, 14336})};
  plan = policy->PlanBatch("decoder.layers.31.mlp.experts.linear_fc2.weight7", fc2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantize);
  EXPECT_EQ(plan->outputs[1].shape, (Shape{4096, 896}));
}

TEST(PolicyPlan, Qwen3MoeExpertsQuantizedAttentionAndNormsPass) {
  auto policy = MakePolicy(Nvfp4Settings());
  auto plan =
      policy->PlanBatch("decoder.layers.93.mlp.experts.linear_fc1.weight127",
                        {Bf16("model.layers.93.mlp.experts.127.gate_proj.weight", {1536, 4096}),
                         Bf16("model.layers.93.mlp.experts.127.up_proj.weight", {1536, 4096})});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->quantizes_anything());

  const std::vector<TensorDesc> qkv = {Bf16("model.layers.5.self_attn.q_proj.weight", {8192, 4096}),
                                       Bf16("model.layers.5.self_attn.k_proj.weight", {512, 4096}),
                                       Bf16("model.layers.5.self_attn.v_proj.weight", {512, 4096})};
  plan = policy->PlanBatch("decoder.layers.5.self_attention.linear_qkv.weight", qkv);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, qkv, Reason::kNotRoutedExpert);

  for (const auto& [mg, hf] : std::vector<std::pair<std::string, std::string>>{
           {"decoder.layers.5.self_attention.q_layernorm.weight",
            "model.layers.5.self_attn.q_norm.weight"},
           {"decoder.layers.5.self_attention.linear_qkv.layer_norm_weight",
            "model.layers.5.input_layernorm.weight"},
           {"decoder.layers.5.pre_mlp_layernorm.weight",
            "model.layers.5.post_attention_layernorm.weight"}}) {
    const std::vector<TensorDesc> in = {Bf16(hf, {128})};
    plan = policy->PlanBatch(mg, in);
    ASSERT_TRUE(plan.ok());
    ExpectAllPass(*plan, in, Reason::kNotRoutedExpert);
  }
}

TEST(PolicyPlan, RouterEmbeddingsHeadAndFinalNormPass) {
  auto policy = MakePolicy(Nvfp4Settings());
  struct Case {
    std::string megatron;
    TensorDesc hf;
    Reason reason;
  };
  const std::vector<Case> cases = {
      {"decoder.layers.10.mlp.router.weight", Bf16("model.layers.10.mlp.gate.weight", {160, 5120}),
       Reason::kNotRoutedExpert},
      {"decoder.layers.10.mlp.router.expert_bias",
       {"model.layers.10.mlp.gate.e_score_correction_bias", DType::kFloat32, {160}},
       Reason::kNotRoutedExpert},
      {"embedding.word_embeddings.weight", Bf16("model.embed_tokens.weight", {151552, 5120}),
       Reason::kNotInLayer},
      {"output_layer.weight", Bf16("lm_head.weight", {151552, 5120}), Reason::kNotInLayer},
      {"decoder.final_layernorm.weight", Bf16("model.norm.weight", {5120}), Reason::kNotInLayer},
  };
  for (const Case& c : cases) {
    auto plan = policy->PlanBatch(c.megatron, {c.hf});
    ASSERT_TRUE(plan.ok()) << c.megatron;
    ExpectAllPass(*plan, {c.hf}, c.reason);
  }
}

TEST(PolicyPlan, SharedExpertsAndDenseLayersPass) {
  auto policy = MakePolicy(Nvfp4Settings());
  // DeepSeek-V3 shared expert (plural) and Qwen2-style singular naming on the HF side.
  const std::vector<TensorDesc> shared = {
      Bf16("model.layers.3.mlp.shared_experts.gate_proj.weight", {2048, 7168}),
      Bf16("model.layers.3.mlp.shared_experts.up_proj.weight", {2048, 7168})};
  auto plan = policy->PlanBatch("decoder.layers.3.mlp.shared_experts.linear_fc1.weight", shared);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, shared, Reason::kSharedExpert);
  const std::vector<TensorDesc> down = {
      Bf16("model.layers.3.mlp.shared_experts.down_proj.weight", {7168, 2048})};
  plan = policy->PlanBatch("decoder.layers.3.mlp.shared_experts.linear_fc2.weight", down);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, down, Reason::kSharedExpert);

  // Dense first layer (first_k_dense): mlp.linear_fc1 is not mlp.experts.
  const std::vector<TensorDesc> dense = {Bf16("model.layers.0.mlp.gate_proj.weight", {18432, 7168}),
                                         Bf16("model.layers.0.mlp.up_proj.weight", {18432, 7168})};
  plan = policy->PlanBatch("decoder.layers.0.mlp.linear_fc1.weight", dense);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, dense, Reason::kNotRoutedExpert);
}

TEST(PolicyPlan, ExpertPatternNeedsLinearFc1OrFc2AndAWeightIndex) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> t = {
      Bf16("model.layers.4.mlp.experts.0.gate_proj.weight", {32, 64}),
      Bf16("model.layers.4.mlp.experts.0.up_proj.weight", {32, 64})};
  for (const char* mg : {"decoder.layers.4.mlp.experts.linear_fc3.weight0",
                         "decoder.layers.4.mlp.experts.linear_fc1.weight",
                         "decoder.layers.4.mlp.experts.linear_fc1.bias0",
                         "decoder.layers.4.mlp.experts.local_experts.linear_fc1.weight0",
                         "decoder.layers.4.self_attention.mlp.experts.linear_fc1.weight0"}) {
    auto plan = policy->PlanBatch(mg, t);
    ASSERT_TRUE(plan.ok()) << mg;
    ExpectAllPass(*plan, t, Reason::kNotRoutedExpert);
  }
  // The Megatron name may carry wrapper prefixes (DDP/Float16Module): re.search finds the layer.
  auto plan = policy->PlanBatch("module.module.decoder.layers.4.mlp.experts.linear_fc1.weight0", t);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->quantizes_anything());
}

TEST(PolicyPlan, MtpLayersStripWrappersAndQuantizeRoutedExperts) {
  auto policy = MakePolicy(Nvfp4Settings());
  // GLM-4.5: MTP layer 0 is HF layer 92.
  const auto fc1 = GlmFc1(92, 5);
  for (const char* mg : {"mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight5",
                         "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight5"}) {
    auto plan = policy->PlanBatch(mg, fc1);
    ASSERT_TRUE(plan.ok()) << mg << ": " << plan.status();
    EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeGate) << mg;
  }
  const std::vector<TensorDesc> eh = {Bf16("model.layers.92.eh_proj.weight", {5120, 10240})};
  auto plan = policy->PlanBatch("mtp.layers.0.eh_proj.weight", eh);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, eh, Reason::kNotRoutedExpert);
  const std::vector<TensorDesc> sh = {
      Bf16("model.layers.92.mlp.shared_experts.gate_proj.weight", {1536, 5120}),
      Bf16("model.layers.92.mlp.shared_experts.up_proj.weight", {1536, 5120})};
  plan =
      policy->PlanBatch("mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight", sh);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, sh, Reason::kSharedExpert);
}

TEST(PolicyPlan, FirstLastLayersBf16IncludingTheMtpIndexQuirk) {
  PolicySettings s = Nvfp4Settings();
  s.exceptions.first_last_layers_bf16 = true;
  s.exceptions.num_layers = 92;
  s.exceptions.num_layers_at_start_in_bf16 = 2;
  s.exceptions.num_layers_at_end_in_bf16 = 1;
  auto policy = MakePolicy(s);
  auto expect = [&](const std::string& mg, const std::vector<TensorDesc>& in, bool quantized) {
    auto plan = policy->PlanBatch(mg, in);
    ASSERT_TRUE(plan.ok()) << mg << ": " << plan.status();
    if (quantized) {
      EXPECT_TRUE(plan->quantizes_anything()) << mg;
    } else {
      ExpectAllPass(*plan, in, Reason::kBf16Layer);
    }
  };
  expect(MgFc1(0, 1), GlmFc1(0, 1), false);
  expect(MgFc1(1, 1), GlmFc1(1, 1), false);
  expect(MgFc1(2, 1), GlmFc1(2, 1), true);
  expect(MgFc1(90, 1), GlmFc1(90, 1), true);
  expect(MgFc1(91, 1), GlmFc1(91, 1), false);
  // The MTP index counts from 0 within the MTP block and is compared the same way, so MTP
  // layer 0 (HF layer 92) is a "first" layer here and stays in BF16 (trainer behaviour).
  expect("mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight1", GlmFc1(92, 1), false);
  // Even a non-expert batch in a BF16 layer reports the layer reason (it is checked first).
  const std::vector<TensorDesc> attn = {
      Bf16("model.layers.0.self_attn.o_proj.weight", {5120, 12288})};
  auto plan = policy->PlanBatch("decoder.layers.0.self_attention.linear_proj.weight", attn);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, attn, Reason::kBf16Layer);

  // Without a head count, MTP layer 0 is not a first layer: it is quantized.
  s.exceptions.num_layers_at_start_in_bf16 = 0;
  policy = MakePolicy(s);
  expect("mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight1", GlmFc1(92, 1), true);
  expect(MgFc1(0, 1), GlmFc1(0, 1), true);
  // And without the flag the counts do nothing.
  s.exceptions.first_last_layers_bf16 = false;
  s.exceptions.num_layers_at_start_in_bf16 = 50;
  policy = MakePolicy(s);
  expect(MgFc1(0, 1), GlmFc1(0, 1), true);
}

TEST(PolicyPlan, ExtraHighPrecisionMegatronSubstringPassesTheWholeBatch) {
  PolicySettings s = Nvfp4Settings();
  s.exceptions.extra_high_precision_layers_megatron = {"decoder.layers.7.", "linear_fc2"};
  auto policy = MakePolicy(s);
  auto in = GlmFc1(7, 3);
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, in, Reason::kExtraHighPrecision);
  // "decoder.layers.7." is not a substring of "decoder.layers.70.".
  in = GlmFc1(70, 3);
  plan = policy->PlanBatch(MgFc1(70, 3), in);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->quantizes_anything());
  const std::vector<TensorDesc> down = {
      Bf16("model.layers.70.mlp.experts.3.down_proj.weight", {5120, 1536})};
  plan = policy->PlanBatch("decoder.layers.70.mlp.experts.linear_fc2.weight3", down);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, down, Reason::kExtraHighPrecision);
  // The HF-side list does not apply to the live path.
  s.exceptions.extra_high_precision_layers_megatron.clear();
  s.exceptions.extra_high_precision_layers_hf = {"experts"};
  policy = MakePolicy(s);
  plan = policy->PlanBatch("decoder.layers.70.mlp.experts.linear_fc2.weight3", down);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->quantizes_anything());
}

TEST(PolicyPlan, IgnoredPairMembersPassTogetherOrFailAlone) {
  // The whole expert container ignored: both halves pass as ignored, no amax group.
  auto policy = MakePolicy(Nvfp4Settings({"lm_head", "model.layers.7.mlp.experts.3"}));
  auto in = GlmFc1(7, 3);
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectAllPass(*plan, in, Reason::kIgnored);
  // Expert 30 is not covered by "...experts.3" (segment, not string, prefix).
  plan = policy->PlanBatch(MgFc1(7, 30), GlmFc1(7, 30));
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->quantizes_anything());

  // Only the up half ignored: the gate has no partner to share its amax with -> error.
  policy = MakePolicy(Nvfp4Settings({"model.layers.7.mlp.experts.3.up_proj"}));
  plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(plan.status(), "model.layers.7.mlp.experts.3.gate_proj.weight has no up"))
      << plan.status();
  // Regex rule ignoring every down_proj of layer 7: down passes as ignored.
  policy = MakePolicy(Nvfp4Settings({R"(re:model\.layers\.7\..*down_proj)"}));
  const std::vector<TensorDesc> down = {
      Bf16("model.layers.7.mlp.experts.3.down_proj.weight", {5120, 1536})};
  plan = policy->PlanBatch("decoder.layers.7.mlp.experts.linear_fc2.weight3", down);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, down, Reason::kIgnored);
  EXPECT_FALSE(policy->ignore_matcher().uses_snapshot());
}

TEST(PolicyPlan, DuplicateAndIncompletePairsAreErrorsNamingTheTensors) {
  auto policy = MakePolicy(Nvfp4Settings());
  auto in = GlmFc1(7, 3);
  in.push_back(in[0]);  // a second gate for the same base
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), "single complete gate/up pair")) << plan.status();
  EXPECT_TRUE(HasSubstr(plan.status(), "duplicate gate tensor for model.layers.7.mlp.experts.3"))
      << plan.status();

  // Two ups (w3 and up_proj share the base).
  const std::string e = "model.layers.1.block_sparse_moe.experts.2.";
  plan = policy->PlanBatch("decoder.layers.1.mlp.experts.linear_fc1.weight2",
                           {Bf16(e + "w1.weight", {64, 64}), Bf16(e + "w3.weight", {64, 64}),
                            Bf16(e + "up_proj.weight", {64, 64})});
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), "duplicate up tensor")) << plan.status();

  // Up without gate.
  plan = policy->PlanBatch(MgFc1(7, 3), {in[1]});
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), "model.layers.7.mlp.experts.3.up_proj.weight has no gate"))
      << plan.status();

  // Gate and up of different experts in one batch: two incomplete pairs.
  plan = policy->PlanBatch(MgFc1(7, 3), {GlmFc1(7, 3)[0], GlmFc1(7, 4)[1]});
  ASSERT_FALSE(plan.ok());

  // Pair members that cannot share an amax.
  plan = policy->PlanBatch(MgFc1(7, 3), {GlmFc1(7, 3)[0], GlmFc1(7, 3, 1536, 2048)[1]});
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), "up_proj.weight [1536, 2048]")) << plan.status();
}

TEST(PolicyPlan, LastDimNotMultipleOf16IsAnErrorNamingTheTensor) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> down = {
      Bf16("model.layers.7.mlp.experts.3.down_proj.weight", {5120, 1544})};
  auto plan = policy->PlanBatch("decoder.layers.7.mlp.experts.linear_fc2.weight3", down);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(plan.status(),
                        "Last dim K must be divisible by 16 for NVFP4 "
                        "(model.layers.7.mlp.experts.3.down_proj.weight)"))
      << plan.status();
  EXPECT_TRUE(HasSubstr(plan.status(), "1544"));
  // Not an error when the tensor is not a candidate (ignored) or the batch is not quantized.
  policy = MakePolicy(Nvfp4Settings({"model.layers.7.mlp.experts.3.down_proj.weight"}));
  plan = policy->PlanBatch("decoder.layers.7.mlp.experts.linear_fc2.weight3", down);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, down, Reason::kIgnored);
  plan = policy->PlanBatch("decoder.layers.7.mlp.shared_experts.linear_fc2.weight", down);
  EXPECT_TRUE(plan.ok());
}

TEST(PolicyPlan, NonCandidatesInAnExpertBatchPassWithTheirReason) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::string b = "model.layers.7.mlp.experts.3.";
  const std::vector<TensorDesc> in = {
      Bf16(b + "gate_proj.weight", {64, 32}),
      Bf16(b + "gate_proj.bias", {64}),
      {b + "up_proj.weight", DType::kFloat8E4M3, {64, 32}},
      Bf16(b + "down_proj.weight", {48}),
      {b + "extra.weight", DType::kFloat32, {16, 32}},
      {b + "half.weight", DType::kFloat16, {16, 32}},
  };
  // The fp8 up is not a candidate, so the gate is left alone -> incomplete pair.
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_FALSE(plan.ok());
  std::vector<TensorDesc> ok_in(in.begin() + 1, in.end());
  plan = policy->PlanBatch(MgFc1(7, 3), ok_in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].reason, Reason::kNotWeight);
  EXPECT_EQ(plan->tensors[1].reason, Reason::kUnsupportedDType);
  EXPECT_EQ(plan->tensors[2].reason, Reason::kRankBelow2);
  EXPECT_EQ(plan->tensors[3].action, Action::kQuantize);  // fp32 is quantizable
  EXPECT_EQ(plan->tensors[4].action, Action::kQuantize);  // fp16 too
  EXPECT_NE(plan->tensors[3].amax_group, plan->tensors[4].amax_group);
  ASSERT_EQ(plan->outputs.size(), 3u + 3u + 3u);
  EXPECT_EQ(plan->outputs[0], ok_in[0]);
  EXPECT_EQ(plan->outputs[3].name, b + "extra.weight");
  EXPECT_EQ(plan->tensors[3].first_output, 3u);
  EXPECT_EQ(plan->tensors[4].first_output, 6u);
}

TEST(PolicyPlan, StackedRank3ExpertsGetPerExpertScale2) {
  auto policy = MakePolicy(Nvfp4Settings());
  const std::vector<TensorDesc> in = {
      Bf16("model.layers.5.mlp.experts.gate_proj.weight", {8, 256, 512}),
      Bf16("model.layers.5.mlp.experts.up_proj.weight", {8, 256, 512})};
  auto plan = policy->PlanBatch("decoder.layers.5.mlp.experts.linear_fc1.weight0", in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->tensors[0].stacked);
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantizeGate);
  ASSERT_EQ(plan->amax_groups.size(), 1u);
  EXPECT_EQ(plan->amax_groups[0].slices, 8);
  EXPECT_EQ(plan->outputs[0].shape, (Shape{8, 256, 256}));
  EXPECT_EQ(plan->outputs[1].shape, (Shape{8, 256, 32}));
  EXPECT_EQ(plan->outputs[2].shape, (Shape{8}));
  EXPECT_EQ(plan->outputs[2].dtype, DType::kFloat32);

  // gate_up_proj is one tensor with one amax (quantized alone).
  const std::vector<TensorDesc> fused = {
      Bf16("model.layers.5.mlp.experts.gate_up_proj.weight", {8, 512, 512})};
  plan = policy->PlanBatch("decoder.layers.5.mlp.experts.linear_fc1.weight0", fused);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].action, Action::kQuantize);

  // Different expert counts cannot share per-expert amaxes; rank 4 is refused.
  plan = policy->PlanBatch("decoder.layers.5.mlp.experts.linear_fc1.weight0",
                           {in[0], Bf16(in[1].name, {4, 256, 512})});
  EXPECT_FALSE(plan.ok());
  plan = policy->PlanBatch("decoder.layers.5.mlp.experts.linear_fc2.weight0",
                           {Bf16("model.layers.5.mlp.experts.down_proj.weight", {2, 2, 16, 16})});
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status(), "model.layers.5.mlp.experts.down_proj.weight"));
}

TEST(PolicyPlan, Bf16RecipePassesEverythingWithoutAConfig) {
  PolicySettings s;
  s.recipe = Recipe::kBf16;
  auto policy = MakePolicy(s);
  const auto in = GlmFc1(7, 3);
  auto plan = policy->PlanBatch(MgFc1(7, 3), in);
  ASSERT_TRUE(plan.ok());
  ExpectAllPass(*plan, in, Reason::kRecipeBf16);
}

TEST(PolicyPlan, FourOverSixRecipeHasTheSameLayout) {
  PolicySettings s = Nvfp4Settings();
  s.recipe = Recipe::kNvfp4FourOverSix;
  auto policy = MakePolicy(s);
  auto plan = policy->PlanBatch(MgFc1(7, 3), GlmFc1(7, 3));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->recipe, Recipe::kNvfp4FourOverSix);
  EXPECT_EQ(plan->outputs.size(), 6u);
}

TEST(PolicyPlan, CreateRejectsANonNvfp4ConfigAndBadRegex) {
  PolicySettings s = Nvfp4Settings();
  s.quantization.quant_algo = "FP8";
  auto policy = Policy::Create(s);
  ASSERT_FALSE(policy.ok());
  EXPECT_TRUE(HasSubstr(policy.status(), "NVFP4")) << policy.status();
  EXPECT_TRUE(HasSubstr(policy.status(), "FP8")) << policy.status();

  s = Nvfp4Settings({"lm_head", "re:model\\.layers\\.(\\d+", "re:(?<=x)y"});
  policy = Policy::Create(s);
  ASSERT_FALSE(policy.ok());
  EXPECT_TRUE(HasSubstr(policy.status(), "re:model\\.layers\\.(\\d+")) << policy.status();
}

TEST(PolicyPlan, PublicationsWithTheSameRulesShareOneCachedSnapshot) {
  auto cache = IgnoreSnapshotCache::Create({});
  ASSERT_TRUE(cache.ok());
  const std::vector<std::string> rules = {"lm_head", "model.layers.0.self_attn"};
  auto first = Policy::Create(Nvfp4Settings(rules), cache->get());
  auto second = Policy::Create(Nvfp4Settings(rules), cache->get());
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(&(*first)->ignore_matcher(), &(*second)->ignore_matcher());
  EXPECT_EQ((*cache)->misses(), 1u);
  EXPECT_EQ((*cache)->hits(), 1u);
  EXPECT_TRUE((*first)->ignore_matcher().uses_snapshot());
  // A bad regex fails Create through the cache too, quoting the rule.
  auto bad = Policy::Create(Nvfp4Settings({"re:experts.(1"}), cache->get());
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(HasSubstr(bad.status(), "re:experts.(1")) << bad.status();
}

TEST(PolicyPlan, Nvfp4OutputDescsValidates) {
  EXPECT_FALSE(Nvfp4OutputDescs(Bf16("x.weight", {16})).ok());
  EXPECT_FALSE(Nvfp4OutputDescs(Bf16("x.bias", {16, 16})).ok());
  EXPECT_FALSE(Nvfp4OutputDescs({"x.weight", DType::kInt8, {16, 16}}).ok());
  auto outs = Nvfp4OutputDescs({"x.weight", DType::kFloat32, {3, 48}});
  ASSERT_TRUE(outs.ok());
  EXPECT_EQ((*outs)[0], (TensorDesc{"x.weight", DType::kUInt8, {3, 24}}));
  EXPECT_EQ((*outs)[1], (TensorDesc{"x.weight_scale", DType::kFloat8E4M3, {3, 3}}));
  EXPECT_EQ((*outs)[2], (TensorDesc{"x.weight_scale_2", DType::kFloat32, {}}));
  EXPECT_EQ(ActionName(Action::kQuantizeGate), "quantize_gate");
  EXPECT_EQ(ReasonName(Reason::kBf16Layer), "bf16_layer");
}

}  // namespace
}  // namespace wpub::policy
