// The hand-written Megatron-name parsers against the trainer's regexes themselves (run through
// RE2, whose leftmost-first submatch semantics are Python's for these patterns), on realistic
// and randomly mangled names.
#include "core/policy/names.h"

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "re2/re2.h"

namespace wpub::policy {
namespace {

std::optional<MegatronLayer> Reference(const std::string& name) {
  static const LazyRE2 kDecoder = {R"(decoder\.layers\.(\d+)\.(.+))"};
  static const LazyRE2 kMtp = {R"(mtp\.layers\.(\d+)\.(.+))"};
  MegatronLayer m;
  if (RE2::PartialMatch(name, *kDecoder, &m.index_digits, &m.rest)) return m;
  if (!RE2::PartialMatch(name, *kMtp, &m.index_digits, &m.rest)) return std::nullopt;
  m.mtp = true;
  std::string out;
  for (const char* wrapper : {"transformer_layer.", "mtp_model_layer."}) {
    std::string r = m.rest;
    size_t pos;
    while ((pos = r.find(wrapper)) != std::string::npos) r.erase(pos, std::string(wrapper).size());
    m.rest = r;
  }
  return m;
}

bool ReferenceExpert(const std::string& rest) {
  static const LazyRE2 kExpert = {R"(mlp.experts\.(.+)\.weight(\d+))"};
  re2::StringPiece groups[2];
  if (!kExpert->Match(rest, 0, rest.size(), RE2::ANCHOR_START, groups, 2)) return false;
  return groups[1] == "linear_fc1" || groups[1] == "linear_fc2";
}

// Returns {layer matched, routed-expert rest matched} per the reference.
std::pair<bool, bool> ExpectSame(const std::string& name) {
  const auto want = Reference(name);
  const auto got = ParseMegatronLayer(name);
  EXPECT_EQ(got.has_value(), want.has_value()) << "'" << name << "'";
  if (got.has_value() != want.has_value()) return {false, false};
  if (want) {
    EXPECT_EQ(got->index_digits, want->index_digits) << name;
    EXPECT_EQ(got->rest, want->rest) << name;
    EXPECT_EQ(got->mtp, want->mtp) << name;
    EXPECT_EQ(IsRoutedExpertGemmRest(got->rest), ReferenceExpert(want->rest)) << name;
  }
  EXPECT_EQ(IsRoutedExpertGemmRest(name), ReferenceExpert(name)) << "'" << name << "'";
  return {want.has_value(), want.has_value() && ReferenceExpert(want->rest)};
}

TEST(PolicyNames, RealisticMegatronNames) {
  for (const char* n : {
           "decoder.layers.7.mlp.experts.linear_fc1.weight3",
           "decoder.layers.7.mlp.experts.linear_fc2.weight255",
           "module.module.decoder.layers.12.mlp.experts.linear_fc1.weight0",
           "decoder.layers.0.mlp.linear_fc1.weight",
           "decoder.layers.3.mlp.shared_experts.linear_fc1.weight",
           "decoder.layers.3.mlp.router.expert_bias",
           "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
           "mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight5",
           "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc2.weight5",
           "mtp.layers.1.eh_proj.weight",
           "mtp.layers.0.mtp_model_layer.decoder.layers.0.mlp.experts.linear_fc1.weight1",
           "embedding.word_embeddings.weight",
           "output_layer.weight",
           "decoder.final_layernorm.weight",
           "decoder.layers.x.decoder.layers.4.mlp.experts.linear_fc1.weight2",
           "decoder.layers.4.",
           "decoder.layers.4.\nmlp",
           "decoder.layers.4.mlp\nexperts.linear_fc1.weight2",
           "decoder.layers.4.mlpXexperts.linear_fc1.weight2",
           "decoder.layers.4.mlp.experts.linear_fc1.weight2.weight3",
           "decoder.layers.4.mlp.experts.linear_fc1.weightX",
           "decoder.layers.4.mlp.experts..weight1",
           "decoder.layers.4.mlp.experts.linear_fc1.weight1extra",
           "decoder.layers.4.mlp.experts.linear_fc1.weight1\n.weight2",
       }) {
    ExpectSame(n);
  }
  EXPECT_TRUE(IsRoutedExpertGemmRest("mlp.experts.linear_fc1.weight3"));
  EXPECT_TRUE(IsRoutedExpertGemmRest("mlp_experts.linear_fc2.weight3"));  // the regex's wildcard
  EXPECT_FALSE(IsRoutedExpertGemmRest("mlp.experts.linear_fc1.weight"));
}

TEST(PolicyNames, RandomlyMangledNamesAgreeWithTheRegexes) {
  std::mt19937_64 rng(20261130);
  auto pick = [&rng](const std::vector<std::string>& v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  // A realistic skeleton with adversarial variants per component, then random byte edits.
  const std::vector<std::string> kPrefix = {"", "", "module.", "x.decoder.layers.", "mtp.layers."};
  const std::vector<std::string> kLayers = {"decoder.layers.", "mtp.layers.", "decoder.layer.",
                                            "decoder.layers.decoder.layers."};
  const std::vector<std::string> kIndex = {"7", "12", "0", "", "x", "3x"};
  const std::vector<std::string> kWrapper = {"", "", "transformer_layer.", "mtp_model_layer.",
                                             "transformer_layer.mtp_model_layer."};
  const std::vector<std::string> kMlp = {"mlp.experts.",    "mlp.experts.",        "mlp.experts.",
                                         "mlp_experts.",    "mlp.shared_experts.", "mlp\nexperts.",
                                         "self_attention.", "mlp.experts"};
  const std::vector<std::string> kFc = {"linear_fc1",         "linear_fc2",      "linear_fc1",
                                        "linear_fc2",         "linear_fc3",      "",
                                        "linear_fc1.weight1", "local.linear_fc2"};
  const std::vector<std::string> kTail = {
      ".weight3",  ".weight17",          ".weight0", ".weight255", ".weight", ".bias0",
      ".weight2x", ".weight1\n.weight2", ""};
  const std::string kEdits = ".\nx0w";
  int layers = 0;
  int experts = 0;
  for (int i = 0; i < 30000; ++i) {
    std::string name = pick(kPrefix) + pick(kLayers) + pick(kIndex) + "." + pick(kWrapper) +
                       pick(kMlp) + pick(kFc) + pick(kTail);
    for (int e = std::uniform_int_distribution<int>(0, 2)(rng); e > 0 && !name.empty(); --e) {
      const size_t pos = std::uniform_int_distribution<size_t>(0, name.size() - 1)(rng);
      if (rng() & 1) {
        name.erase(pos, 1);
      } else {
        name.insert(pos, 1, kEdits[rng() % kEdits.size()]);
      }
    }
    const auto [layer, expert] = ExpectSame(name);
    layers += layer;
    experts += expert;
    if (::testing::Test::HasFailure()) return;
  }
  // The generator must reach both parsers' accepting paths often enough to mean something.
  EXPECT_GT(layers, 8000);
  EXPECT_GT(experts, 300);
}

}  // namespace
}  // namespace wpub::policy
