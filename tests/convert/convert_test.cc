// core/convert on synthetic HF checkpoints (DeepSeek-V3, Qwen3-MoE and Mixtral naming; shared
// experts singular/plural/nested; dense first layers; 1-3 shards with gate/up pairs split across
// shards): exactly the routed-expert GEMM weights are quantized, their bytes equal the CPU
// reference quantizer's, kept tensors are copied, the metadata is as specified, and every bad
// input is refused with nothing written.
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/convert/convert.h"
#include "core/convert/testing/synthetic_checkpoint.h"
#include "core/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference.h"
#include "tests/convert/convert_check.h"

namespace wpub::convert {
namespace {

namespace fs = std::filesystem;
using testing::CheckpointSpec;
using ::testing::HasSubstr;

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("wpub_convert_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string In() const { return (root_ / "in").string(); }
  std::string Out() const { return (root_ / "out").string(); }

  ConvertOptions Options() const {
    ConvertOptions o;
    o.model_dir = In();
    o.save_dir = Out();
    o.cpu_threads = 2;
    return o;
  }

  // Runs a conversion that must fail; checks that nothing was written next to or into save_dir.
  absl::Status ExpectRefused(const ConvertOptions& o, bool save_dir_was_empty = true) {
    absl::StatusOr<ConvertSummary> s = ConvertCheckpoint(o);
    EXPECT_FALSE(s.ok());
    if (save_dir_was_empty) {
      EXPECT_FALSE(fs::exists(o.save_dir) && !fs::is_empty(o.save_dir)) << o.save_dir;
    }
    for (const fs::directory_entry& e : fs::directory_iterator(root_)) {
      EXPECT_FALSE(absl::StrContains(e.path().filename().string(), "wpub-convert"))
          << "leftover " << e.path();
    }
    return s.ok() ? absl::OkStatus() : s.status();
  }

  fs::path root_;
};

// The tiny model with a fourth layer (the first/last-layer rules need layers 0 and 3) and 3
// experts (the counts below).
synthetic::ModelShape Small(synthetic::NamingStyle style) {
  synthetic::ModelShape s = synthetic::ModelShape::Tiny(style);
  s.num_layers = 4;
  s.num_experts = 3;
  return s;
}

CheckpointSpec SpecFor(synthetic::NamingStyle style, int shards) {
  auto model = synthetic::SyntheticModel::Create(Small(style));
  EXPECT_TRUE(model.ok()) << model.status();
  CheckpointSpec spec;
  spec.tensors = testing::HfTensors(*model);
  spec.num_hidden_layers = 4;
  spec.num_shards = shards;
  return spec;
}

// Independent statement of which names are routed-expert GEMM weights.
const std::regex kRouted(
    R"(^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$)");

std::set<std::string> ExpectedQuantized(const CheckpointSpec& spec, int first_bf16, int last_bf16,
                                        int num_layers, const std::string& extra = "") {
  std::set<std::string> out;
  for (const TensorDesc& t : spec.tensors) {
    std::smatch m;
    if (!std::regex_match(t.name, m, kRouted)) continue;
    const int layer = std::stoi(m[1]);
    if (layer < first_bf16 || (layer >= num_layers - last_bf16 && layer < num_layers)) continue;
    if (!extra.empty() && absl::StrContains(t.name, extra)) continue;
    out.insert(t.name);
  }
  return out;
}

TEST_F(ConvertTest, DeepSeekV3ThreeShardsWithSharedExpertVariants) {
  CheckpointSpec spec = SpecFor(synthetic::NamingStyle::kDeepSeekV3, 3);
  // Shared experts: singular (Qwen2-MoE style) and nested experts inside a shared block.
  spec.tensors.push_back(
      {"model.layers.2.mlp.shared_expert.gate_proj.weight", DType::kBFloat16, {32, 64}});
  spec.tensors.push_back(
      {"model.layers.2.mlp.shared_expert.up_proj.weight", DType::kBFloat16, {32, 64}});
  spec.tensors.push_back(
      {"model.layers.3.mlp.shared_experts.experts.0.up_proj.weight", DType::kBFloat16, {32, 64}});
  spec.tensors.push_back(
      {"model.layers.3.mlp.shared_expert_gate.weight", DType::kBFloat16, {1, 64}});
  // A bias beside a quantized expert weight is kept, and its module is not put in the ignore list.
  spec.tensors.push_back({"model.layers.1.mlp.experts.0.down_proj.bias", DType::kBFloat16, {64}});
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  auto summary = ConvertCheckpoint(Options());
  ASSERT_TRUE(summary.ok()) << summary.status();
  // Layers 1..3 and MTP layer 4 are MoE with 3 experts x 3 GEMMs.
  const std::set<std::string> expected = ExpectedQuantized(spec, 0, 0, 4);
  EXPECT_EQ(expected.size(), 4u * 3 * 3);
  EXPECT_EQ(summary->tensors_quantized, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(summary->shards, 3);
  CheckResult r = CheckConvertedCheckpoint(In(), Out(), expected, kernels::QuantMode::Standard());
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(r.pairs_across_shards, 1) << "the fixture must split a gate/up pair across shards";
  EXPECT_THAT(r.ignore, ::testing::Contains("lm_head"));
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.2.mlp.shared_expert.gate_proj"));
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.3.mlp.shared_experts.experts.0.up_proj"));
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.0.mlp.gate_proj"));
  EXPECT_THAT(r.ignore,
              ::testing::Not(::testing::Contains("model.layers.1.mlp.experts.0.down_proj")));
  // Copied files.
  EXPECT_TRUE(fs::exists(fs::path(Out()) / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(fs::path(Out()) / "extra" / "notes.txt"));
}

TEST_F(ConvertTest, Qwen3MoeTwoShardsBf16HeadTailAndTextConfig) {
  CheckpointSpec spec = SpecFor(synthetic::NamingStyle::kQwen3Moe, 2);
  spec.nest_in_text_config = true;
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  ConvertOptions o = Options();
  o.num_layers_at_start_in_bf16 = 1;
  o.num_layers_at_end_in_bf16 = 1;
  auto summary = ConvertCheckpoint(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  const std::set<std::string> expected = ExpectedQuantized(spec, 1, 1, 4);
  EXPECT_EQ(expected.size(), 2u * 3 * 3);
  CheckResult r = CheckConvertedCheckpoint(In(), Out(), expected, kernels::QuantMode::Standard());
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(r.pairs_across_shards, 1);
  // Compact: one entry per BF16 layer, nothing else from those layers.
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.0.*"));
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.3.*"));
  for (const std::string& e : r.ignore) {
    if (absl::StartsWith(e, "model.layers.0.")) {
      EXPECT_EQ(e, "model.layers.0.*");
    }
  }
}

TEST_F(ConvertTest, MixtralSingleFileExtraHighPrecisionAnd4over6) {
  CheckpointSpec spec = SpecFor(synthetic::NamingStyle::kMixtral, 1);
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  ConvertOptions o = Options();
  o.extra_high_precision_layers_hf = {"model.layers.2."};
  o.mode = kernels::QuantMode::FourOverSixDefault();
  auto summary = ConvertCheckpoint(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  const std::set<std::string> expected = ExpectedQuantized(spec, 0, 0, 4, "model.layers.2.");
  EXPECT_EQ(expected.size(), 3u * 3 * 3);
  CheckResult r = CheckConvertedCheckpoint(In(), Out(), expected, o.mode);
  ASSERT_TRUE(r.status.ok()) << r.status;
  // The excluded layer's experts are named by their container.
  EXPECT_THAT(r.ignore, ::testing::Contains("model.layers.2.block_sparse_moe.experts"));
  EXPECT_TRUE(fs::exists(fs::path(Out()) / "model.safetensors"));
}

TEST_F(ConvertTest, StackedExpertTensorsSplitIntoSliceUnits) {
  CheckpointSpec spec;
  spec.num_hidden_layers = 1;
  spec.num_shards = 2;
  // Slices of 2 MiB, above the 1 MiB floor of the unit size.
  spec.tensors = {
      {"model.layers.0.mlp.experts.gate_proj.weight", DType::kBFloat16, {3, 1024, 1024}},
      {"model.layers.0.mlp.experts.up_proj.weight", DType::kBFloat16, {3, 1024, 1024}},
      {"model.layers.0.mlp.experts.down_proj.weight", DType::kFloat32, {3, 1024, 512}},
      {"model.norm.weight", DType::kBFloat16, {64}}};
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  ConvertOptions o = Options();
  o.staging_bytes = 1;  // one slice per unit (units are at least 1 MiB of input)
  auto summary = ConvertCheckpoint(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  CheckResult r = CheckConvertedCheckpoint(
      In(), Out(),
      {"model.layers.0.mlp.experts.gate_proj.weight", "model.layers.0.mlp.experts.up_proj.weight",
       "model.layers.0.mlp.experts.down_proj.weight"},
      kernels::QuantMode::Standard());
  ASSERT_TRUE(r.status.ok()) << r.status;
}

TEST_F(ConvertTest, WeightOnlyOutputSaysW4A16AndHasNoInputScale) {
  CheckpointSpec spec = SpecFor(synthetic::NamingStyle::kQwen3Moe, 2);
  // Slices of 2 MiB: one unit each (units are at least 1 MiB of input), so input_scale's
  // first-slice write is skipped by more than one unit of the tensor.
  spec.tensors.push_back(
      {"model.layers.1.mlp.experts.gate_up_proj.weight", DType::kBFloat16, {3, 1024, 1024}});
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  ConvertOptions o = Options();
  o.weight_only = true;
  o.staging_bytes = 1;
  auto summary = ConvertCheckpoint(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->quant_algo, "W4A16_NVFP4");
  EXPECT_THAT(FormatSummary(*summary), HasSubstr("-> 3 tensors each"));
  std::set<std::string> expected = ExpectedQuantized(spec, 0, 0, 4);
  expected.insert("model.layers.1.mlp.experts.gate_up_proj.weight");
  CheckResult r = CheckConvertedCheckpoint(In(), Out(), expected, kernels::QuantMode::Standard(),
                                           /*weight_only=*/true);
  ASSERT_TRUE(r.status.ok()) << r.status;
  // The weights are the W4A4 output's, byte for byte; only input_scale and the algo differ.
  ConvertOptions w4a4 = Options();
  w4a4.save_dir = (root_ / "w4a4").string();
  ASSERT_TRUE(ConvertCheckpoint(w4a4).ok());
  auto a = safetensors::Checkpoint::Open(Out());
  auto b = safetensors::Checkpoint::Open(w4a4.save_dir);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*b)->num_tensors(), (*a)->num_tensors() + expected.size());
  for (const auto& reader : (*a)->readers()) {
    for (const safetensors::TensorInfo& t : reader->tensors()) {
      auto l = (*b)->Find(t.name);
      ASSERT_TRUE(l.has_value()) << t.name;
      auto x = reader->Data(t);
      auto y = (*b)->readers()[l->shard]->Data(*l->info);
      ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << t.name;
    }
  }
}

// ---- bad inputs: refused, naming the file and tensor, nothing written ----

// Replaces shard `index` (in sorted order) of the input with raw bytes.
void Clobber(const std::string& dir, int index, const std::string& header, size_t data,
             std::optional<uint64_t> len = std::nullopt) {
  std::vector<fs::path> shards;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") shards.push_back(e.path());
  }
  std::sort(shards.begin(), shards.end());
  std::ofstream out(shards.at(index), std::ios::binary | std::ios::trunc);
  const uint64_t n = len.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << std::string(data, '\0');
}

TEST_F(ConvertTest, RefusesBadInputsWritingNothing) {
  const CheckpointSpec spec = SpecFor(synthetic::NamingStyle::kQwen3Moe, 2);
  struct Case {
    const char* label;
    std::function<void()> damage;
    std::vector<std::string> expect;
  };
  const std::string shard2 = "model-00002-of-00002.safetensors";
  const std::vector<Case> cases = {
      {"truncated header",
       [&] { Clobber(In(), 1, R"({"model.norm.weight": {"dty)", 0); },
       {shard2, "truncated"}},
      {"header length beyond the file",
       [&] { Clobber(In(), 1, "{}", 0, 1 << 20); },
       {shard2, "beyond the file"}},
      {"overlapping offsets",
       [&] {
         Clobber(
             In(), 1,
             R"({"model.norm.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]},
                     "lm_head.weight": {"dtype": "BF16", "shape": [2, 64], "data_offsets": [64, 320]}})",
             320);
       },
       {shard2, "'lm_head.weight'", "overlap"}},
      {"out-of-bounds offsets",
       [&] {
         Clobber(
             In(), 1,
             R"({"model.norm.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]}})",
             100);
       },
       {shard2, "'model.norm.weight'", "out of bounds"}},
      {"unknown dtype",
       [&] {
         Clobber(
             In(), 1,
             R"({"model.norm.weight": {"dtype": "BF17", "shape": [64], "data_offsets": [0, 128]}})",
             128);
       },
       {shard2, "'model.norm.weight'", "unknown dtype 'BF17'"}},
      {"index naming a missing shard",
       [&] { fs::remove(fs::path(In()) / shard2); },
       {"model.safetensors.index.json", shard2, "missing"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    fs::remove_all(In());
    ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
    c.damage();
    absl::Status s = ExpectRefused(Options());
    for (const std::string& e : c.expect) EXPECT_THAT(s.message(), HasSubstr(e)) << s;
    EXPECT_FALSE(fs::exists(Out()));
  }
}

TEST_F(ConvertTest, RefusesAStackWithoutExperts) {
  CheckpointSpec spec;
  spec.num_hidden_layers = 1;
  spec.num_shards = 1;
  spec.tensors = {{"model.layers.0.mlp.experts.down_proj.weight", DType::kBFloat16, {0, 32, 64}},
                  {"model.norm.weight", DType::kBFloat16, {64}}};
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  for (bool weight_only : {false, true}) {
    ConvertOptions o = Options();
    o.weight_only = weight_only;
    absl::Status s = ExpectRefused(o);
    EXPECT_THAT(s.message(),
                ::testing::AllOf(HasSubstr("model.layers.0.mlp.experts.down_proj.weight"),
                                 HasSubstr("[0, 32, 64] holds no expert")));
    EXPECT_FALSE(fs::exists(Out()));
  }
}

TEST_F(ConvertTest, RefusesOutputEqualToInputOrNotEmpty) {
  ASSERT_TRUE(
      testing::WriteSyntheticCheckpoint(In(), SpecFor(synthetic::NamingStyle::kMixtral, 2)).ok());
  ConvertOptions o = Options();
  o.save_dir = In() + "/.";
  EXPECT_THAT(ExpectRefused(o, false).message(), HasSubstr("is the input directory"));
  fs::create_directories(fs::path(Out()) / "old");
  EXPECT_THAT(ExpectRefused(Options(), false).message(), HasSubstr("not empty"));
  EXPECT_TRUE(fs::exists(fs::path(Out()) / "old"));
  // An empty output directory is fine and replaced.
  fs::remove(fs::path(Out()) / "old");
  EXPECT_TRUE(ConvertCheckpoint(Options()).ok());
}

TEST_F(ConvertTest, RefusesExpertWeightWithKNotMultipleOf16) {
  CheckpointSpec spec;
  spec.num_hidden_layers = 1;
  spec.num_shards = 2;
  spec.tensors = {{"model.embed_tokens.weight", DType::kBFloat16, {8, 40}},
                  {"model.layers.0.mlp.experts.0.down_proj.weight", DType::kBFloat16, {8, 40}}};
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(In(), spec).ok());
  ConvertOptions o = Options();
  o.save_dir = (root_ / "new_parent" / "deeper" / "out").string();
  absl::Status s = ExpectRefused(o);
  EXPECT_FALSE(fs::exists(root_ / "new_parent")) << "created parents must be removed on failure";
  EXPECT_THAT(s.message(), HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_THAT(s.message(), HasSubstr("divisible by 16"));
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.mlp.experts.0.down_proj.weight"));
  EXPECT_FALSE(fs::exists(Out()));
}

TEST_F(ConvertTest, RefusesGateWithoutUpAndMissingLayerCount) {
  ASSERT_TRUE(
      testing::WriteSyntheticCheckpoint(In(), SpecFor(synthetic::NamingStyle::kQwen3Moe, 2)).ok());
  ConvertOptions o = Options();
  o.extra_high_precision_layers_hf = {"layers.1.mlp.experts.2.up_proj"};
  EXPECT_THAT(ExpectRefused(o).message(),
              HasSubstr("'model.layers.1.mlp.experts.2.gate_proj.weight' is the gate"));
  // No num_hidden_layers in config.json but BF16 head layers asked for.
  std::ofstream(fs::path(In()) / "config.json") << R"({"model_type": "x"})";
  o = Options();
  o.num_layers_at_start_in_bf16 = 1;
  EXPECT_THAT(ExpectRefused(o).message(), HasSubstr("num_hidden_layers"));
  fs::remove(fs::path(In()) / "config.json");
  EXPECT_THAT(ExpectRefused(Options()).message(), HasSubstr("config.json"));
}

TEST_F(ConvertTest, SummaryTableNamesTheFigures) {
  ConvertSummary s;
  s.tensors_quantized = 7;
  s.tensors_kept = 3;
  s.bytes_in = 2'000'000'000;
  s.seconds = 4;
  const std::string t = FormatSummary(s);
  EXPECT_THAT(t, HasSubstr("tensors quantized (NVFP4)    7"));
  EXPECT_THAT(t, HasSubstr("tensors kept                 3"));
  EXPECT_THAT(t, HasSubstr("0.500 GB/s of input"));
}

}  // namespace
}  // namespace wpub::convert
