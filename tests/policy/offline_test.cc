// The offline (HF-name) classifier: shared-expert veto before the routed match, routed markers
// of each layout, GEMM suffixes, BF16 head/tail layers, extra high-precision substrings.
#include <gtest/gtest.h>

#include "core/policy/policy.h"
#include "tests/policy/test_util.h"

namespace wpub::policy {
namespace {

using testing::Bf16;
using testing::HasSubstr;

OfflineDecision Classify(const TensorDesc& t, const PrecisionExceptions& e = {}) {
  auto d = ClassifyOfflineTensor(t, e);
  EXPECT_TRUE(d.ok()) << t.name << ": " << d.status();
  return d.ok() ? *d : OfflineDecision{};
}

TEST(PolicyOffline, RoutedExpertsOfEveryLayoutAreQuantized) {
  struct Case {
    const char* name;
    PairRole role;
    const char* base;
  };
  const Case cases[] = {
      {"model.layers.3.mlp.experts.255.gate_proj.weight", PairRole::kGate,
       "model.layers.3.mlp.experts.255"},  // DeepSeek-V3
      {"model.layers.3.mlp.experts.255.up_proj.weight", PairRole::kUp,
       "model.layers.3.mlp.experts.255"},
      {"model.layers.3.mlp.experts.255.down_proj.weight", PairRole::kNone, ""},
      {"model.layers.40.mlp.experts.0.down_proj.weight", PairRole::kNone, ""},  // GLM/Qwen3
      {"model.layers.31.block_sparse_moe.experts.7.w1.weight", PairRole::kGate,
       "model.layers.31.block_sparse_moe.experts.7"},  // Mixtral
      {"model.layers.31.block_sparse_moe.experts.7.w3.weight", PairRole::kUp,
       "model.layers.31.block_sparse_moe.experts.7"},
      {"model.layers.31.block_sparse_moe.experts.7.w2.weight", PairRole::kNone, ""},
      {"model.layers.2.moe.experts.1.gate_up_proj.weight", PairRole::kGateUp, ""},
      {"model.layers.92.mlp.experts.5.up_proj.weight", PairRole::kUp,
       "model.layers.92.mlp.experts.5"},  // GLM MTP layer
  };
  for (const Case& c : cases) {
    const OfflineDecision d = Classify(Bf16(c.name, {1536, 5120}));
    EXPECT_TRUE(d.quantize) << c.name << ": " << ReasonName(d.reason);
    EXPECT_EQ(d.role, c.role) << c.name;
    EXPECT_EQ(d.pair_base, c.base) << c.name;
    EXPECT_TRUE(IsRoutedExpertHfName(c.name)) << c.name;
  }
}

TEST(PolicyOffline, SharedExpertVetoComesBeforeTheRoutedMatch) {
  for (const char* name : {
           "model.layers.3.mlp.shared_experts.gate_proj.weight",          // plural (DeepSeek/GLM)
           "model.layers.3.mlp.shared_expert.up_proj.weight",             // singular (Qwen2-MoE)
           "model.layers.3.mlp.shared_experts.experts.0.up_proj.weight",  // nested: NOT routed
           "model.layers.3.mlp.shared_expert.experts.1.down_proj.weight",
           "model.layers.3.moe.shared_experts.moe.experts.1.w1.weight",
       }) {
    const OfflineDecision d = Classify(Bf16(name, {1536, 5120}));
    EXPECT_FALSE(d.quantize) << name;
    EXPECT_EQ(d.reason, Reason::kSharedExpert) << name;
    EXPECT_FALSE(IsRoutedExpertHfName(name)) << name;
  }
  // "shared_expert_gate" is neither a shared-expert path marker nor routed.
  EXPECT_EQ(Classify(Bf16("model.layers.3.mlp.shared_expert_gate.weight", {1, 4096})).reason,
            Reason::kNotRoutedExpert);
}

TEST(PolicyOffline, EverythingElseStaysHighPrecision) {
  struct Case {
    TensorDesc t;
    Reason reason;
  };
  const Case cases[] = {
      {Bf16("model.embed_tokens.weight", {151552, 5120}), Reason::kNotRoutedExpert},
      {Bf16("lm_head.weight", {151552, 5120}), Reason::kNotRoutedExpert},
      {Bf16("model.norm.weight", {5120}), Reason::kNotRoutedExpert},
      {Bf16("model.layers.5.self_attn.q_proj.weight", {12288, 5120}), Reason::kNotRoutedExpert},
      {Bf16("model.layers.5.self_attn.kv_a_proj_with_mqa.weight", {576, 7168}),
       Reason::kNotRoutedExpert},
      {Bf16("model.layers.5.input_layernorm.weight", {5120}), Reason::kNotRoutedExpert},
      {Bf16("model.layers.0.mlp.gate_proj.weight", {12288, 5120}), Reason::kNotRoutedExpert},
      {Bf16("model.layers.5.mlp.gate.weight", {160, 5120}), Reason::kNotRoutedExpert},
      {Bf16("model.layers.31.block_sparse_moe.gate.weight", {8, 4096}), Reason::kNotRoutedExpert},
      {{"model.layers.5.mlp.gate.e_score_correction_bias", DType::kFloat32, {160}},
       Reason::kNotWeight},
      {Bf16("model.layers.5.mlp.experts.0.gate_proj.bias", {1536}), Reason::kNotWeight},
      {Bf16("model.layers.5.mlp.experts.0.gate_proj.weight_scale", {1536, 320}),
       Reason::kNotWeight},
      {Bf16("model.layers.5.mlp.experts.0.linear.weight", {1536, 5120}), Reason::kNotExpertGemm},
      {{"model.layers.5.mlp.experts.0.down_proj.weight", DType::kFloat8E4M3, {5120, 1536}},
       Reason::kUnsupportedDType},
      {Bf16("model.layers.5.mlp.experts.0.down_proj.weight", {1536}), Reason::kRankBelow2},
  };
  for (const Case& c : cases) {
    const OfflineDecision d = Classify(c.t);
    EXPECT_FALSE(d.quantize) << c.t.name;
    EXPECT_EQ(d.reason, c.reason) << c.t.name << ": " << ReasonName(d.reason);
  }
}

TEST(PolicyOffline, Bf16HeadAndTailLayersAndExtraSubstrings) {
  PrecisionExceptions e;
  e.first_last_layers_bf16 = true;
  e.num_layers = 61;
  e.num_layers_at_start_in_bf16 = 4;
  e.num_layers_at_end_in_bf16 = 2;
  auto reason = [&](const std::string& name) {
    return Classify(Bf16(name, {2048, 7168}), e).reason;
  };
  EXPECT_EQ(reason("model.layers.3.mlp.experts.1.gate_proj.weight"), Reason::kBf16Layer);
  EXPECT_EQ(reason("model.layers.4.mlp.experts.1.gate_proj.weight"), Reason::kQuantized);
  EXPECT_EQ(reason("model.layers.58.mlp.experts.1.gate_proj.weight"), Reason::kQuantized);
  EXPECT_EQ(reason("model.layers.59.mlp.experts.1.gate_proj.weight"), Reason::kBf16Layer);
  EXPECT_EQ(reason("model.layers.60.mlp.experts.1.gate_proj.weight"), Reason::kBf16Layer);
  // HF MTP layer 61 is past the last decoder layer: not a tail layer offline.
  EXPECT_EQ(reason("model.layers.61.mlp.experts.1.gate_proj.weight"), Reason::kQuantized);
  // `model.layers.3.` must appear literally: 30 and 03 are other layers.
  EXPECT_EQ(reason("model.layers.30.mlp.experts.1.gate_proj.weight"), Reason::kQuantized);
  EXPECT_EQ(reason("model.layers.03.mlp.experts.1.gate_proj.weight"), Reason::kQuantized);
  // Applies to non-expert tensors too (reason order: the layer test is second).
  EXPECT_EQ(reason("model.layers.0.self_attn.q_a_proj.weight"), Reason::kBf16Layer);

  e.extra_high_precision_layers_hf = {"mlp.experts.7.", "layers.10."};
  EXPECT_EQ(reason("model.layers.20.mlp.experts.7.down_proj.weight"), Reason::kExtraHighPrecision);
  EXPECT_EQ(reason("model.layers.20.mlp.experts.70.down_proj.weight"), Reason::kQuantized);
  EXPECT_EQ(reason("model.layers.10.mlp.experts.1.down_proj.weight"), Reason::kExtraHighPrecision);
  // The Megatron list does not apply offline.
  e.extra_high_precision_layers_hf.clear();
  e.extra_high_precision_layers_megatron = {"experts"};
  EXPECT_EQ(reason("model.layers.20.mlp.experts.7.down_proj.weight"), Reason::kQuantized);
}

TEST(PolicyOffline, LastDimNotMultipleOf16IsAnError) {
  auto d =
      ClassifyOfflineTensor(Bf16("model.layers.5.mlp.experts.0.down_proj.weight", {5120, 100}), {});
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(HasSubstr(d.status(),
                        "Last dim K must be divisible by 16 for NVFP4 "
                        "(model.layers.5.mlp.experts.0.down_proj.weight)"))
      << d.status();
  // Only for candidates: a shared expert with an odd K is simply kept.
  EXPECT_TRUE(ClassifyOfflineTensor(
                  Bf16("model.layers.5.mlp.shared_experts.down_proj.weight", {5120, 100}), {})
                  .ok());
}

TEST(PolicyOffline, SplitPairNameSuffixes) {
  EXPECT_EQ(SplitPairName("a.b.gate_proj.weight").role, PairRole::kGate);
  EXPECT_EQ(SplitPairName("a.b.gate_proj.weight").base, "a.b");
  EXPECT_EQ(SplitPairName("a.b.w3.weight").role, PairRole::kUp);
  EXPECT_EQ(SplitPairName("a.b.gate_up_proj.weight").role, PairRole::kGateUp);
  EXPECT_EQ(SplitPairName("a.b.w2.weight").role, PairRole::kNone);
  EXPECT_EQ(SplitPairName("a.b.gate_proj.bias").role, PairRole::kNone);
  EXPECT_EQ(SplitPairName("a.bw1.weight").role, PairRole::kNone);
}

}  // namespace
}  // namespace wpub::policy
