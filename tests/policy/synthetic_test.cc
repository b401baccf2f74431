// Synthetic models: names and shapes per naming style, whole-model plans (live and offline
// paths agree on every tensor), and the seeded value generator.
#include "core/synthetic/synthetic.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>

#include <gtest/gtest.h>

#include "core/policy/policy.h"
#include "tests/policy/test_util.h"

namespace wpub::synthetic {
namespace {

using policy::testing::HasSubstr;

const ConversionBatch* Find(const SyntheticModel& m, const std::string& megatron) {
  for (const ConversionBatch& b : m.batches()) {
    if (b.megatron_name == megatron) return &b;
  }
  return nullptr;
}

TEST(PolicySynthetic, GlmLikeBatchesCarryConverterNamesAndShapes) {
  auto m = SyntheticModel::Create(ModelShape::GlmLike());
  ASSERT_TRUE(m.ok()) << m.status();
  const ConversionBatch* fc1 = Find(*m, "decoder.layers.7.mlp.experts.linear_fc1.weight3");
  ASSERT_NE(fc1, nullptr);
  ASSERT_EQ(fc1->tensors.size(), 2u);
  EXPECT_EQ(fc1->tensors[0],
            (TensorDesc{
                "model.layers.7.mlp.experts.3.gate_proj.weight", DType::kBFloat16, {1536, 5120}}));
  EXPECT_EQ(fc1->tensors[1].name, "model.layers.7.mlp.experts.3.up_proj.weight");
  const ConversionBatch* qkv = Find(*m, "decoder.layers.7.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  ASSERT_EQ(qkv->tensors.size(), 3u);
  EXPECT_EQ(qkv->tensors[1],
            (TensorDesc{"model.layers.7.self_attn.k_proj.weight", DType::kBFloat16, {1024, 5120}}));
  EXPECT_NE(Find(*m, "decoder.layers.2.mlp.linear_fc1.weight"), nullptr);  // dense
  EXPECT_EQ(Find(*m, "decoder.layers.3.mlp.linear_fc1.weight"), nullptr);  // MoE from layer 3
  EXPECT_NE(Find(*m, "decoder.layers.3.mlp.shared_experts.linear_fc2.weight"), nullptr);
  const ConversionBatch* mtp =
      Find(*m, "mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight159");
  ASSERT_NE(mtp, nullptr);
  EXPECT_EQ(mtp->tensors[0].name, "model.layers.92.mlp.experts.159.down_proj.weight");
  EXPECT_NE(Find(*m, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_NE(Find(*m, "output_layer.weight"), nullptr);
  const ConversionBatch* bias = Find(*m, "decoder.layers.9.mlp.router.expert_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->tensors[0].dtype, DType::kFloat32);
}

TEST(PolicySynthetic, StyleSpecificNames) {
  auto ds = SyntheticModel::Create(ModelShape::DeepSeekV3Like());
  ASSERT_TRUE(ds.ok()) << ds.status();
  const ConversionBatch* kv =
      Find(*ds, "decoder.layers.10.self_attention.linear_kv_down_proj.weight");
  ASSERT_NE(kv, nullptr);
  EXPECT_EQ(kv->tensors[0], (TensorDesc{"model.layers.10.self_attn.kv_a_proj_with_mqa.weight",
                                        DType::kBFloat16,
                                        {576, 7168}}));
  auto mx = SyntheticModel::Create(ModelShape::MixtralLike());
  ASSERT_TRUE(mx.ok());
  const ConversionBatch* w = Find(*mx, "decoder.layers.31.mlp.experts.linear_fc1.weight7");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->tensors[0].name, "model.layers.31.block_sparse_moe.experts.7.w1.weight");
  EXPECT_EQ(w->tensors[1].name, "model.layers.31.block_sparse_moe.experts.7.w3.weight");
  EXPECT_NE(Find(*mx, "decoder.layers.0.mlp.router.weight"), nullptr);
  auto qw = SyntheticModel::Create(ModelShape::Qwen3MoeLike());
  ASSERT_TRUE(qw.ok());
  EXPECT_EQ(Find(*qw, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"), nullptr);
  EXPECT_NE(Find(*qw, "decoder.layers.0.self_attention.q_layernorm.weight"), nullptr);
}

TEST(PolicySynthetic, HighPrecisionModulesCoverEverythingButRoutedExperts) {
  ModelShape shape = ModelShape::GlmLike();
  shape.num_layers = 5;
  shape.num_experts = 4;
  auto m = SyntheticModel::Create(shape);
  ASSERT_TRUE(m.ok());
  const std::vector<std::string> modules = HighPrecisionModules(*m);
  auto has = [&](const std::string& x) {
    return std::find(modules.begin(), modules.end(), x) != modules.end();
  };
  EXPECT_EQ(modules.front(), "model.embed_tokens");
  EXPECT_TRUE(has("lm_head"));
  EXPECT_TRUE(has("model.layers.0.mlp.gate_proj"));  // dense layer
  EXPECT_TRUE(has("model.layers.4.self_attn.q_proj"));
  EXPECT_TRUE(has("model.layers.4.mlp.shared_experts.down_proj"));
  EXPECT_TRUE(has("model.layers.4.mlp.gate"));
  EXPECT_TRUE(has("model.layers.5.eh_proj"));  // MTP
  EXPECT_FALSE(has("model.layers.4.mlp.experts.0.gate_proj"));
  // As ignore rules they never touch a routed expert, so every expert is still quantized.
  auto ignore = policy::IgnoreMatcher::Create(modules);
  ASSERT_TRUE(ignore.ok());
  for (const ConversionBatch& b : m->batches()) {
    for (const TensorDesc& t : b.tensors) {
      EXPECT_NE(ignore->IsIgnored(t.name), policy::IsRoutedExpertHfName(t.name)) << t.name;
    }
  }
}

TEST(PolicySynthetic, InvalidShapesNameTheField) {
  ModelShape s = ModelShape::Qwen3MoeLike();
  s.num_mtp_layers = 1;
  auto m = SyntheticModel::Create(s);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(HasSubstr(m.status(), "num_mtp_layers")) << m.status();
  s = ModelShape::GlmLike();
  s.first_k_dense = 100;
  m = SyntheticModel::Create(s);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(HasSubstr(m.status(), "first_k_dense")) << m.status();
  s = ModelShape::GlmLike();
  s.hidden_size = 0;
  EXPECT_TRUE(HasSubstr(SyntheticModel::Create(s).status(), "hidden_size"));
  EXPECT_FALSE(ParseNamingStyle("llama").ok());
  EXPECT_EQ(*ParseNamingStyle("DeepSeek_V3"), NamingStyle::kDeepSeekV3);
}

// Every style, planned end to end: routed-expert GEMMs (and only they) are quantized, gate/up
// pairs share an amax, and the offline classifier agrees with the live plan on every tensor.
TEST(PolicySynthetic, WholeModelPlansAgreeWithTheOfflineClassifier) {
  for (NamingStyle style : {NamingStyle::kGlm, NamingStyle::kDeepSeekV3, NamingStyle::kQwen3Moe,
                            NamingStyle::kMixtral}) {
    ModelShape shape = *ModelShape::Preset(style);
    shape.num_layers = 6;  // keep the test fast; structure is per layer anyway
    shape.first_k_dense = std::min(shape.first_k_dense, 2);
    shape.num_experts = 4;
    auto model = SyntheticModel::Create(shape);
    ASSERT_TRUE(model.ok()) << model.status();
    auto pol = policy::Policy::Create(policy::testing::Nvfp4Settings({"lm_head"}));
    ASSERT_TRUE(pol.ok());
    int64_t quantized = 0;
    int64_t pairs = 0;
    for (const ConversionBatch& b : model->batches()) {
      auto plan = (*pol)->PlanBatch(b.megatron_name, b.tensors);
      ASSERT_TRUE(plan.ok()) << b.megatron_name << ": " << plan.status();
      for (size_t i = 0; i < b.tensors.size(); ++i) {
        const policy::TensorPlan& tp = plan->tensors[i];
        const bool q = tp.action != policy::Action::kPass;
        quantized += q;
        pairs += tp.action == policy::Action::kQuantizeGate;
        auto offline = policy::ClassifyOfflineTensor(b.tensors[i], {});
        ASSERT_TRUE(offline.ok());
        EXPECT_EQ(offline->quantize, q) << NamingStyleName(style) << " " << b.tensors[i].name;
      }
    }
    const int64_t moe_layers = shape.num_layers - shape.first_k_dense + shape.num_mtp_layers;
    EXPECT_EQ(quantized, moe_layers * shape.num_experts * 3) << NamingStyleName(style);
    EXPECT_EQ(pairs, moe_layers * shape.num_experts) << NamingStyleName(style);
  }
}

TEST(PolicySynthetic, CountsMatchTheGlmFormula) {
  const ModelShape s = ModelShape::GlmLike();
  auto m = SyntheticModel::Create(s);
  ASSERT_TRUE(m.ok());
  // Per layer: norm, qkv (3), qkv bias (3), o_proj; dense: norm + 3; MoE: norm, router, bias,
  // 3 per expert, 3 shared. MTP: enorm, hnorm, eh_proj, a MoE layer, shared_head.norm.
  const int64_t attn = 1 + 3 + 3 + 1;
  const int64_t dense = attn + 1 + 3;
  const int64_t moe = attn + 3 + 3 * s.num_experts + 3;
  const int64_t expected = 1 + s.first_k_dense * dense + (s.num_layers - s.first_k_dense) * moe +
                           1 + 1 + s.num_mtp_layers * (3 + moe + 1);
  EXPECT_EQ(m->num_tensors(), expected);
  EXPECT_GT(m->num_bytes(), int64_t{600} * 1000 * 1000 * 1000);  // GLM-4.5 is ~355B params
}

float HalfToFloat(uint16_t h) {
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -24)
                     : std::ldexp(static_cast<float>(mant + 1024), exp - 25);
  return (h & 0x8000) ? -v : v;
}

TEST(PolicySynthetic, FillTensorIsDeterministicNormalIshAndDTypeConsistent) {
  const int64_t n = 1 << 16;
  const TensorDesc f32{"model.layers.3.mlp.experts.0.up_proj.weight", DType::kFloat32, {256, 256}};
  std::vector<uint8_t> a(f32.nbytes()), b(f32.nbytes()), c(f32.nbytes());
  ASSERT_TRUE(FillTensor(f32, 7, absl::MakeSpan(a)).ok());
  ASSERT_TRUE(FillTensor(f32, 7, absl::MakeSpan(b)).ok());
  ASSERT_TRUE(FillTensor(f32, 8, absl::MakeSpan(c)).ok());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::vector<float> v(n);
  std::memcpy(v.data(), a.data(), a.size());
  double sum = 0, sq = 0, maxabs = 0;
  for (float x : v) {
    sum += x;
    sq += double{x} * x;
    maxabs = std::max(maxabs, double{std::fabs(x)});
  }
  const double mean = sum / n;
  const double sd = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(sd, 0.02, 0.001);
  EXPECT_LE(maxabs, 2 * std::sqrt(3.0) * 0.02 + 1e-6);

  // bf16 and fp16 fills are the fp32 values rounded to nearest.
  TensorDesc bf = f32;
  bf.dtype = DType::kBFloat16;
  TensorDesc fp = f32;
  fp.dtype = DType::kFloat16;
  std::vector<uint8_t> bb(bf.nbytes()), hb(fp.nbytes());
  ASSERT_TRUE(FillTensor(bf, 7, absl::MakeSpan(bb)).ok());
  ASSERT_TRUE(FillTensor(fp, 7, absl::MakeSpan(hb)).ok());
  for (int64_t i = 0; i < n; ++i) {
    uint16_t hbits, bbits;
    std::memcpy(&bbits, bb.data() + 2 * i, 2);
    std::memcpy(&hbits, hb.data() + 2 * i, 2);
    const float bv = std::bit_cast<float>(uint32_t{bbits} << 16);
    ASSERT_LE(std::fabs(bv - v[i]), std::fabs(v[i]) * (1.0f / 256) + 1e-30f) << i;
    const float hv = HalfToFloat(hbits);
    ASSERT_LE(std::fabs(hv - v[i]), std::max(std::fabs(v[i]) / 2048, std::ldexp(1.0f, -25))) << i;
  }
  // Wrong size or dtype: errors naming the tensor.
  std::vector<uint8_t> small(10);
  EXPECT_TRUE(HasSubstr(FillTensor(f32, 7, absl::MakeSpan(small)), f32.name));
  const TensorDesc u8{"x.weight", DType::kUInt8, {4}};
  std::vector<uint8_t> four(4);
  EXPECT_TRUE(HasSubstr(FillTensor(u8, 7, absl::MakeSpan(four)), "x.weight"));
  EXPECT_NE(StableHash("a"), StableHash("b"));
  EXPECT_EQ(StableHash(""), 0xCBF29CE484222325ull);
}

}  // namespace
}  // namespace wpub::synthetic
