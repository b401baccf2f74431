// Quantization config and policy settings parsing: the three document shapes engines read,
// ignore/exclude_modules merging, and errors that name the offending field.
#include "core/policy/settings.h"

#include <gtest/gtest.h>

#include "tests/policy/test_util.h"

namespace wpub::policy {
namespace {

using testing::HasSubstr;
using Rules = std::vector<std::string>;

TEST(PolicySettings, FlatQuantizationConfigWithStringIgnore) {
  auto c = ParseQuantizationConfig(
      R"({"quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 16, "ignore": "lm_head"})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_algo, "NVFP4");
  EXPECT_EQ(c->quant_method, "modelopt");
  EXPECT_EQ(c->ignore_rules, Rules{"lm_head"});
  EXPECT_TRUE(c->IsNvfp4());
}

TEST(PolicySettings, IgnoreThenNewExcludeModulesInOrder) {
  auto c = ParseQuantizationConfig(R"({"quant_algo": "NVFP4",
      "ignore": ["a", "b", "re:c.*"], "exclude_modules": ["b", "d", "a", "re:c.*", "e", "d"]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ignore_rules, (Rules{"a", "b", "re:c.*", "d", "e"}));
  // exclude_modules alone, null ignore.
  c = ParseQuantizationConfig(R"({"quant_algo": "NVFP4", "ignore": null, "exclude_modules": "x"})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ignore_rules, Rules{"x"});
}

TEST(PolicySettings, WholeConfigJsonAndHfQuantConfig) {
  auto c = ParseQuantizationConfig(R"({"architectures": ["Glm4MoeForCausalLM"],
      "num_hidden_layers": 92,
      "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt",
                              "ignore": ["lm_head", "model.layers.0."]}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ignore_rules, (Rules{"lm_head", "model.layers.0."}));
  c = ParseQuantizationConfig(R"({"producer": {"name": "modelopt", "version": "0.37"},
      "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                       "exclude_modules": ["lm_head", "model.layers.3.mlp.shared_experts"]}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_algo, "NVFP4");
  EXPECT_EQ(c->ignore_rules, (Rules{"lm_head", "model.layers.3.mlp.shared_experts"}));
  EXPECT_TRUE(c->IsNvfp4());
}

TEST(PolicySettings, Nvfp4Detection) {
  QuantizationConfig q;
  q.quant_method = "modelopt_fp4";
  EXPECT_TRUE(q.IsNvfp4());
  q.quant_method = "modelopt";  // ModelOpt alone may be FP8
  EXPECT_FALSE(q.IsNvfp4());
  q.quant_algo = "nvfp4";
  EXPECT_TRUE(q.IsNvfp4());
  q.quant_algo = "FP8";
  q.quant_method = "modelopt_fp4";  // quant_algo decides when present
  EXPECT_FALSE(q.IsNvfp4());
}

TEST(PolicySettings, NonStringRuleIsAnErrorNamingItsPosition) {
  auto c = ParseQuantizationConfig(R"({"quant_algo": "NVFP4", "ignore": ["lm_head", 3]})");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(c.status(), "ignore[1] must be a string, got number")) << c.status();
  c = ParseQuantizationConfig(
      R"({"quantization_config": {"quant_algo": "NVFP4", "exclude_modules": ["x", {"re": "y"}]}})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "quantization_config.exclude_modules[1] must be a string"))
      << c.status();
  c = ParseQuantizationConfig(R"({"quant_algo": "NVFP4", "ignore": {"a": 1}})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "ignore must be a string or a list of strings, got object"))
      << c.status();
}

TEST(PolicySettings, BadTypesAndMalformedJson) {
  auto c = ParseQuantizationConfig(R"({"quant_algo": 4})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "quant_algo must be a string, got number")) << c.status();
  c = ParseQuantizationConfig(R"({"quantization": ["NVFP4"]})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "quantization must be a JSON object")) << c.status();
  c = ParseQuantizationConfig(R"({"quant_algo": "NVFP4", )");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "not valid JSON")) << c.status();
  c = ParseQuantizationConfig("[1, 2]");
  EXPECT_FALSE(c.ok());
  c = ParseQuantizationConfig(R"({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(HasSubstr(c.status(), "quantization.group_size must be 16 for NVFP4, got 32"))
      << c.status();
  // Other algorithms keep their own group sizes.
  EXPECT_TRUE(ParseQuantizationConfig(R"({"quant_algo": "W4A16_AWQ", "group_size": 128})").ok());
}

TEST(PolicySettings, FullSettingsDocument) {
  auto s = ParsePolicySettings(R"({
      "recipe": "nvfp4_4over6",
      "quantization_config": {"quant_algo": "NVFP4", "ignore": ["lm_head"]},
      "extra_high_precision_layers_megatron": ["self_attention.linear_q_up_proj"],
      "extra_high_precision_layers_hf": ["self_attn.q_b_proj"],
      "first_last_layers_bf16": true, "num_layers": 92,
      "num_layers_at_start_in_bf16": 3, "num_layers_at_end_in_bf16": 2})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->recipe, Recipe::kNvfp4FourOverSix);
  EXPECT_EQ(s->quantization.ignore_rules, Rules{"lm_head"});
  EXPECT_EQ(s->exceptions.extra_high_precision_layers_megatron,
            Rules{"self_attention.linear_q_up_proj"});
  EXPECT_EQ(s->exceptions.extra_high_precision_layers_hf, Rules{"self_attn.q_b_proj"});
  EXPECT_TRUE(s->exceptions.first_last_layers_bf16);
  EXPECT_EQ(s->exceptions.num_layers, 92);
  EXPECT_EQ(s->exceptions.num_layers_at_start_in_bf16, 3);
  EXPECT_EQ(s->exceptions.num_layers_at_end_in_bf16, 2);
  // bf16 needs no quantization config.
  s = ParsePolicySettings(R"({"recipe": "bf16"})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->recipe, Recipe::kBf16);
}

TEST(PolicySettings, SettingsErrorsNameTheField) {
  struct Case {
    const char* json;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"recipe": "nvfp4", "quantization_config": {"quant_algo": "FP8"}})",
       "needs an NVFP4 quantization_config, but quant_algo is \"FP8\""},
      {R"({"recipe": "nvfp4"})", "needs an NVFP4 quantization_config"},
      {R"({"recipe": "int4"})", "recipe \"int4\" is not one of"},
      {R"({"recipe": 4})", "recipe must be a string"},
      {R"({"recipe": "bf16", "num_layers": "92"})", "num_layers must be an integer, got string"},
      {R"({"recipe": "bf16", "first_last_layers_bf16": 1})",
       "first_last_layers_bf16 must be a boolean"},
      {R"({"recipe": "bf16", "first_last_layers_bf16": true})",
       "first_last_layers_bf16 needs num_layers >= 1"},
      {R"({"recipe": "bf16", "first_last_layers_bf16": true, "num_layers": 4,
           "num_layers_at_end_in_bf16": -1})",
       "must be >= 0"},
      {R"({"recipe": "bf16", "extra_high_precision_layers_megatron": "x"})",
       "extra_high_precision_layers_megatron must be a list of strings, got string"},
      {R"({"recipe": "bf16", "extra_high_precision_layers_hf": ["x", null]})",
       "extra_high_precision_layers_hf[1] must be a string, got null"},
      {R"({"recipe": "bf16", "first_last_layer_bf16": true})",
       "unknown key \"first_last_layer_bf16\""},
      {R"({"recipe": "nvfp4", "quantization_config": {"quant_algo": "NVFP4", "ignore": [1]}})",
       "quantization_config.ignore[0] must be a string"},
  };
  for (const Case& c : cases) {
    auto s = ParsePolicySettings(c.json);
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasSubstr(s.status(), c.needle)) << s.status() << "\n  wanted: " << c.needle;
  }
}

TEST(PolicySettings, RecipeNames) {
  for (Recipe r : {Recipe::kBf16, Recipe::kNvfp4, Recipe::kNvfp4FourOverSix}) {
    auto parsed = ParseRecipe(RecipeName(r));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, r);
  }
  EXPECT_EQ(*ParseRecipe("NVFP4"), Recipe::kNvfp4);
  EXPECT_FALSE(IsNvfp4(Recipe::kBf16));
  EXPECT_TRUE(IsNvfp4(Recipe::kNvfp4FourOverSix));
}

}  // namespace
}  // namespace wpub::policy
