// core/inspect: converter outputs classified module by module (NVFP4 parts, the reason every
// other tensor is high precision), digests independent of sharding, diffs that find exactly the
// changed elements (dequantized for NVFP4), the engines' checks naming the tensor, and hostile
// snapshots refused with errors naming the file.
#include "core/inspect/inspect.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/convert/convert.h"
#include "core/convert/testing/synthetic_checkpoint.h"
#include "core/safetensors/safetensors.h"
#include "core/transport/checksum.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/nvfp4_math.h"

namespace wpub::inspect {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;

struct Raw {
  std::string name;
  std::string dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> F32Bytes(std::vector<float> v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<uint8_t> Bf16Bytes(std::vector<float> v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = kernels::FloatToBf16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return b;
}

void WriteFile(const std::string& path, const std::vector<Raw>& tensors,
               const std::map<std::string, std::string>& metadata = {}) {
  std::vector<safetensors::OutputTensor> outs;
  for (const Raw& t : tensors) outs.push_back({t.name, t.dtype, t.shape});
  auto w = safetensors::Writer::Create(path, outs, metadata);
  ASSERT_TRUE(w.ok()) << w.status();
  for (size_t i = 0; i < tensors.size(); ++i) {
    ASSERT_EQ((*w)->nbytes(i), tensors[i].bytes.size()) << tensors[i].name;
    ASSERT_TRUE((*w)->Write(i, 0, tensors[i].bytes).ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
}

void WriteText(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

// An NVFP4 module [rows, cols] with every code `code`, every block scale 2.0 and global scale
// `global`, plus an input_scale when asked.
void AddNvfp4(std::vector<Raw>* out, const std::string& module, int64_t rows, int64_t cols,
              uint8_t code, float global, bool input_scale = true) {
  const uint8_t two = kernels::FloatToE4M3(2.0f);
  out->push_back({module + ".weight",
                  "U8",
                  {rows, cols / 2},
                  std::vector<uint8_t>(rows * cols / 2, kernels::PackE2M1(code, code))});
  out->push_back({module + ".weight_scale",
                  "F8_E4M3",
                  {rows, cols / 16},
                  std::vector<uint8_t>(rows * cols / 16, two)});
  out->push_back({module + ".weight_scale_2", "F32", {}, F32Bytes({global})});
  if (input_scale) out->push_back({module + ".input_scale", "F32", {}, F32Bytes({1.0f})});
}

class InspectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("wpub_inspect_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Path(const std::string& name) const { return (root_ / name).string(); }

  static convert::testing::CheckpointSpec Spec(int shards) {
    synthetic::ModelShape s = synthetic::ModelShape::Tiny(synthetic::NamingStyle::kQwen3Moe);
    s.num_experts = 3;  // the counts below
    auto model = synthetic::SyntheticModel::Create(s);
    EXPECT_TRUE(model.ok()) << model.status();
    convert::testing::CheckpointSpec spec;
    spec.tensors = convert::testing::HfTensors(*model);
    spec.num_hidden_layers = 3;
    spec.num_shards = shards;
    return spec;
  }

  // Writes Spec(shards) as `in` and converts it into `out`.
  convert::ConvertSummary Convert(const std::string& in, const std::string& out, int shards,
                                  kernels::QuantMode mode = kernels::QuantMode::Standard()) {
    if (!fs::exists(in)) {
      EXPECT_TRUE(convert::testing::WriteSyntheticCheckpoint(in, Spec(shards)).ok());
    }
    convert::ConvertOptions o;
    o.model_dir = in;
    o.save_dir = out;
    o.cpu_threads = 2;
    o.num_layers_at_start_in_bf16 = 1;
    o.extra_high_precision_layers_hf = {"experts.2."};
    o.mode = mode;
    absl::StatusOr<convert::ConvertSummary> s = convert::ConvertCheckpoint(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : convert::ConvertSummary{};
  }

  static std::unique_ptr<Snapshot> Open(const std::string& path) {
    absl::StatusOr<std::unique_ptr<Snapshot>> s = Snapshot::Open(path);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  static const TensorRow* Row(const Inventory& inv, const std::string& name) {
    for (const TensorRow& r : inv.tensors) {
      if (r.name == name) return &r;
    }
    ADD_FAILURE() << "no tensor " << name;
    return nullptr;
  }

  fs::path root_;
};

TEST_F(InspectTest, ConvertedCheckpointIsClassifiedModuleByModule) {
  const convert::ConvertSummary summary = Convert(Path("in"), Path("out"), 2);
  auto snapshot = Open(Path("out"));
  ASSERT_NE(snapshot, nullptr);
  EXPECT_EQ(snapshot->kind(), Snapshot::Kind::kDirectory);
  EXPECT_EQ(snapshot->quant_algo(), "NVFP4");
  ASSERT_NE(snapshot->exclude_list(), nullptr);
  const Inventory inv = Inspect(*snapshot);
  EXPECT_THAT(inv.problems, ::testing::IsEmpty());
  // Layers 1-2, experts 0-1, three GEMMs each: one NVFP4 module per quantized input tensor.
  EXPECT_EQ(summary.tensors_quantized, 2 * 2 * 3);
  ASSERT_EQ(static_cast<int64_t>(inv.modules.size()), summary.tensors_quantized);
  for (const Nvfp4Module& m : inv.modules) {
    EXPECT_TRUE(m.has_input_scale) << m.name;
    EXPECT_GT(m.min_global_scale, 0) << m.name;
    EXPECT_THAT(m.name, HasSubstr(".mlp.experts."));
  }
  EXPECT_EQ(inv.by_role.at("nvfp4_weight").tensors, summary.tensors_quantized);
  EXPECT_EQ(inv.by_role.at("nvfp4_input_scale").tensors, summary.tensors_quantized);
  EXPECT_EQ(static_cast<int64_t>(inv.tensors.size()), summary.tensors_out);
  EXPECT_EQ(inv.total_bytes, summary.bytes_out);

  const TensorRow* q = Row(inv, "model.layers.1.mlp.experts.0.gate_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->role, Role::kNvfp4Weight);
  EXPECT_EQ(q->dtype, "U8");
  EXPECT_EQ(q->reason, "quantized");
  const Tensor* t = snapshot->Find(q->name);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(q->checksum, transport::Checksum(t->bytes.data(), t->bytes.size()));
  // Why the rest is high precision.
  EXPECT_EQ(Row(inv, "model.layers.0.mlp.experts.0.down_proj.weight")->reason,
            "excluded:model.layers.0.*");
  EXPECT_EQ(Row(inv, "model.layers.1.mlp.experts.2.up_proj.weight")->reason,
            "excluded:model.layers.1.mlp.experts.2.up_proj");
  EXPECT_EQ(Row(inv, "model.layers.1.self_attn.q_proj.weight")->reason, "not_routed_expert");
  EXPECT_EQ(Row(inv, "model.layers.1.mlp.gate.weight")->reason, "not_routed_expert");
  EXPECT_EQ(Row(inv, "model.layers.1.input_layernorm.weight")->reason, "not_routed_expert");
  EXPECT_EQ(Row(inv, "model.layers.1.mlp.experts.0.up_proj.weight_scale")->role,
            Role::kNvfp4BlockScale);
  EXPECT_EQ(Row(inv, "model.layers.1.input_layernorm.weight")->role, Role::kHighPrecision);
  EXPECT_GT(inv.by_reason.at("excluded:model.layers.0.*").tensors, 0);

  const std::string text = FormatInventory(inv, /*list_tensors=*/true);
  EXPECT_THAT(text, AllOf(HasSubstr("quant_algo NVFP4"), HasSubstr("problems: none"),
                          HasSubstr("model.layers.1.mlp.experts.0.gate_proj.weight_scale_2")));
  const nlohmann::json j = nlohmann::json::parse(InventoryJson(inv));
  EXPECT_EQ(j["tensors"].size(), inv.tensors.size());
  EXPECT_EQ(j["nvfp4_modules"].size(), inv.modules.size());
  EXPECT_EQ(j["kind"], "directory");
  EXPECT_TRUE(j["problems"].empty());
}

TEST_F(InspectTest, WeightOnlyConversionHasNoInputScaleAndNoProblem) {
  ASSERT_TRUE(convert::testing::WriteSyntheticCheckpoint(Path("in"), Spec(2)).ok());
  convert::ConvertOptions o;
  o.model_dir = Path("in");
  o.save_dir = Path("out");
  o.cpu_threads = 2;
  o.weight_only = true;
  ASSERT_TRUE(convert::ConvertCheckpoint(o).ok());
  auto s = Open(Path("out"));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->quant_algo(), "W4A16_NVFP4");
  const Inventory inv = Inspect(*s);
  EXPECT_THAT(inv.problems, ::testing::IsEmpty());
  ASSERT_FALSE(inv.modules.empty());
  for (const Nvfp4Module& m : inv.modules) EXPECT_FALSE(m.has_input_scale) << m.name;
  EXPECT_EQ(inv.by_role.count("nvfp4_input_scale"), 0u);
  EXPECT_THAT(FormatInventory(inv, false), HasSubstr("quant_algo W4A16_NVFP4"));
}

// An output with input_scale (the default recipe) against one without (as a live publication
// carries none, or --quant_algo=W4A16_NVFP4): every tensor both hold is identical; the diff says
// so with --common_only and still differs without it. A changed tensor both hold still counts.
TEST_F(InspectTest, CommonOnlyComparesWhatBothSidesCarry) {
  ASSERT_TRUE(convert::testing::WriteSyntheticCheckpoint(Path("in"), Spec(2)).ok());
  for (const bool weight_only : {false, true}) {
    convert::ConvertOptions o;
    o.model_dir = Path("in");
    o.save_dir = Path(weight_only ? "w4a16" : "w4a4");
    o.cpu_threads = 2;
    o.weight_only = weight_only;
    ASSERT_TRUE(convert::ConvertCheckpoint(o).ok());
  }
  auto a = Open(Path("w4a4"));
  auto b = Open(Path("w4a16"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  DiffReport d = Diff(*a, *b);
  EXPECT_FALSE(d.identical());
  const int64_t modules = static_cast<int64_t>(Inspect(*a).modules.size());
  ASSERT_GT(modules, 0);
  EXPECT_EQ(d.counts.at("only_in_a"), modules);  // one input_scale per NVFP4 module
  EXPECT_EQ(d.counts.count("only_in_b"), 0u);
  EXPECT_EQ(d.counts.count("changed_bytes"), 0u);
  d.common_only = true;
  EXPECT_TRUE(d.identical());
  EXPECT_THAT(FormatDiff(d, 50), HasSubstr("identical tensors"));
  EXPECT_THAT(FormatDiff(d, 50), HasSubstr(absl::StrCat(modules, " only in A")));
  EXPECT_THAT(DiffJson(d), HasSubstr("\"common_only\": true"));
  // Tensors both hold that differ still make the report differ.
  auto in = Open(Path("in"));
  ASSERT_NE(in, nullptr);
  DiffReport io = Diff(*in, *b);
  io.common_only = true;
  EXPECT_FALSE(io.identical());
}

TEST_F(InspectTest, DigestAndDiffDoNotDependOnSharding) {
  Convert(Path("in1"), Path("out1"), 1);
  Convert(Path("in3"), Path("out3"), 3);
  auto a = Open(Path("out1"));
  auto b = Open(Path("out3"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->files().size(), 1u);
  EXPECT_EQ(b->files().size(), 3u);
  const Inventory ia = Inspect(*a), ib = Inspect(*b);
  EXPECT_EQ(ia.digest, ib.digest);
  const DiffReport d = Diff(*a, *b);
  EXPECT_TRUE(d.identical());
  EXPECT_EQ(d.counts.at("identical"), static_cast<int64_t>(ia.tensors.size()));
  EXPECT_EQ(d.digest_a, ia.digest);
  EXPECT_THAT(FormatDiff(d, 50), HasSubstr("identical tensors"));
  // The input differs from the output by exactly the quantized tensors and their new parts.
  auto in = Open(Path("in1"));
  ASSERT_NE(in, nullptr);
  const DiffReport io = Diff(*in, *a);
  EXPECT_FALSE(io.identical());
  EXPECT_EQ(io.counts.at("changed_desc"), static_cast<int64_t>(ia.modules.size()));
  EXPECT_EQ(io.counts.at("only_in_b"), 3 * static_cast<int64_t>(ia.modules.size()));
  EXPECT_EQ(io.counts.count("only_in_a"), 0u);
  EXPECT_NE(Inspect(*in).digest, ia.digest);
}

TEST_F(InspectTest, DiffOfTwoRecipesChangesOnlyNvfp4TensorsAndMeasuresThemDequantized) {
  Convert(Path("in"), Path("std"), 2);
  Convert(Path("in"), Path("4o6"), 2, kernels::QuantMode::FourOverSixDefault());
  auto a = Open(Path("std"));
  auto b = Open(Path("4o6"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const Inventory inv = Inspect(*a, /*threads=*/3);
  const DiffReport d = Diff(*a, *b, /*threads=*/4);
  EXPECT_FALSE(d.identical());
  // One thread or several: the same report.
  EXPECT_EQ(DiffJson(Diff(*a, *b, /*threads=*/1)), DiffJson(d));
  EXPECT_EQ(InventoryJson(Inspect(*a, /*threads=*/1)), InventoryJson(inv));
  int64_t changed_weights = 0;
  for (const TensorDiff& t : d.tensors) {
    const TensorRow* row = Row(inv, t.name);
    ASSERT_NE(row, nullptr);
    if (row->role == Role::kHighPrecision) {
      EXPECT_EQ(t.change, Change::kIdentical) << t.name;
    }
    EXPECT_NE(t.change, Change::kChangedDesc) << t.name;
    if (t.change == Change::kChangedBytes && row->role == Role::kNvfp4Weight) {
      ++changed_weights;
      // Codes are nibbles: the element count is the logical one.
      EXPECT_EQ(t.elements, 2 * static_cast<int64_t>(row->nbytes)) << t.name;
      EXPECT_GT(t.differing_elements, 0) << t.name;
      ASSERT_TRUE(t.max_abs_diff.has_value()) << t.name;
      EXPECT_GT(*t.max_abs_diff, 0) << t.name;
      EXPECT_TRUE(std::isfinite(*t.max_abs_diff)) << t.name;
    }
  }
  EXPECT_GT(changed_weights, 0);
  EXPECT_EQ(d.counts.count("only_in_a") + d.counts.count("only_in_b"), 0u);
}

TEST_F(InspectTest, DiffCountsExactlyTheChangedElements) {
  std::vector<Raw> a = {
      {"dense.weight", "BF16", {2, 4}, Bf16Bytes({1, 2, 3, 4, 5, 6, 7, 8})},
      {"gone.weight", "F32", {1}, F32Bytes({1})},
      {"retyped.bias", "F32", {2}, F32Bytes({1, 2})},
      {"same.weight", "F32", {2}, F32Bytes({3, 4})},
  };
  std::vector<Raw> b = a;
  b[0].bytes = Bf16Bytes({1, 2, 3, 4, 5.5f, 6, NAN, 8});  // one value moved, one now NaN
  b.erase(b.begin() + 1);
  b[1] = {"retyped.bias", "BF16", {2}, Bf16Bytes({1, 2})};
  b.push_back({"new.weight", "F32", {1}, F32Bytes({1})});
  WriteFile(Path("a.safetensors"), a, {{"version", "4"}, {"model_id", "m"}, {"format", "pt"}});
  WriteFile(Path("b.safetensors"), b, {{"version", "5"}, {"model_id", "m"}, {"format", "pt"}});
  auto sa = Open(Path("a.safetensors"));
  auto sb = Open(Path("b.safetensors"));
  ASSERT_NE(sa, nullptr);
  ASSERT_NE(sb, nullptr);
  EXPECT_EQ(sa->kind(), Snapshot::Kind::kFile);
  const DiffReport d = Diff(*sa, *sb);
  ASSERT_EQ(d.tensors.size(), 5u);
  std::map<std::string, const TensorDiff*> by;
  for (const TensorDiff& t : d.tensors) by[t.name] = &t;
  const TensorDiff& dense = *by.at("dense.weight");
  EXPECT_EQ(dense.change, Change::kChangedBytes);
  EXPECT_EQ(dense.elements, 8);
  EXPECT_EQ(dense.differing_elements, 2);
  EXPECT_EQ(dense.finiteness_changes, 1);
  ASSERT_TRUE(dense.max_abs_diff.has_value());
  EXPECT_DOUBLE_EQ(*dense.max_abs_diff, 0.5);
  EXPECT_EQ(by.at("gone.weight")->change, Change::kOnlyInA);
  EXPECT_EQ(by.at("new.weight")->change, Change::kOnlyInB);
  EXPECT_EQ(by.at("retyped.bias")->change, Change::kChangedDesc);
  EXPECT_EQ(by.at("same.weight")->change, Change::kIdentical);
  ASSERT_EQ(d.config_changes.count("metadata.version"), 1u);
  EXPECT_EQ(d.config_changes.at("metadata.version"),
            std::make_pair(std::string("4"), std::string("5")));
  EXPECT_EQ(d.config_changes.count("metadata.model_id"), 0u);
  const std::string text = FormatDiff(d, 2);
  EXPECT_THAT(text, AllOf(HasSubstr("dense.weight: 2 of 8 elements differ, max |a-b| 0.5, 1 "
                                    "finite on one side only"),
                          HasSubstr("... 2 more"), HasSubstr("tensors differ")));
  const nlohmann::json j = nlohmann::json::parse(DiffJson(d));
  EXPECT_FALSE(j["identical"].get<bool>());
  EXPECT_EQ(j["tensors"].size(), 4u);  // the identical one is not listed
  EXPECT_EQ(j["config_changes"]["metadata.version"]["b"], "5");
}

TEST_F(InspectTest, Nvfp4WeightsAreComparedAsDequantizedValues) {
  // E2M1 0x2 = 1.0, 0x3 = 1.5; block scale 2.0, global 0.25: values 0.5 and 0.75.
  std::vector<Raw> a, b;
  AddNvfp4(&a, "layers.1.mlp.experts.0.down_proj", 2, 32, 0x2, 0.25f);
  b = a;
  b[0].bytes[5] = kernels::PackE2M1(0x3, 0x2);  // element 10 of 64
  WriteFile(Path("a.safetensors"), a);
  WriteFile(Path("b.safetensors"), b);
  auto sa = Open(Path("a.safetensors"));
  auto sb = Open(Path("b.safetensors"));
  ASSERT_NE(sa, nullptr);
  ASSERT_NE(sb, nullptr);
  const Inventory inv = Inspect(*sa);
  EXPECT_THAT(inv.problems, ::testing::IsEmpty());
  ASSERT_EQ(inv.modules.size(), 1u);
  EXPECT_EQ(inv.modules[0].logical_shape, (Shape{2, 32}));
  EXPECT_FLOAT_EQ(inv.modules[0].max_global_scale, 0.25f);
  const DiffReport d = Diff(*sa, *sb);
  ASSERT_EQ(d.counts.at("changed_bytes"), 1);
  for (const TensorDiff& t : d.tensors) {
    if (t.change != Change::kChangedBytes) continue;
    EXPECT_EQ(t.name, "layers.1.mlp.experts.0.down_proj.weight");
    EXPECT_EQ(t.elements, 64);
    EXPECT_EQ(t.differing_elements, 1);
    ASSERT_TRUE(t.max_abs_diff.has_value());
    EXPECT_DOUBLE_EQ(*t.max_abs_diff, 0.25);
  }
}

TEST_F(InspectTest, ChecksNameWhatAnEngineWouldReject) {
  std::vector<Raw> t;
  AddNvfp4(&t, "model.layers.1.mlp.experts.0.down_proj", 2, 32, 0x2, 0.5f);  // fine
  AddNvfp4(&t, "model.layers.1.mlp.experts.1.down_proj", 2, 32, 0x2, 0.5f);
  AddNvfp4(&t, "model.layers.1.mlp.experts.2.down_proj", 2, 32, 0x2, 0.5f);
  AddNvfp4(&t, "model.layers.1.mlp.experts.3.down_proj", 2, 32, 0x2, 0.0f);
  AddNvfp4(&t, "model.layers.0.mlp.experts.0.down_proj", 2, 32, 0x2, 0.5f);
  AddNvfp4(&t, "model.layers.1.mlp.experts.4.down_proj", 2, 32, 0x2, 0.5f, /*input_scale=*/false);
  std::vector<Raw> kept;
  for (Raw& r : t) {
    if (r.name == "model.layers.1.mlp.experts.1.down_proj.weight_scale_2") continue;
    if (r.name == "model.layers.1.mlp.experts.2.down_proj.weight_scale") {
      r.shape = {4, 1};  // right size, wrong shape
    }
    kept.push_back(std::move(r));
  }
  kept.push_back(
      {"model.layers.1.self_attn.q_proj.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  kept.push_back({"model.embed_tokens.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  kept.push_back({"model.layers.1.mlp.gate.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  kept.push_back({"model.norm.weight", "BF16", {2}, Bf16Bytes({1, 2})});
  kept.push_back({"lm_head.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  fs::create_directories(Path("ckpt"));
  WriteFile(Path("ckpt/model.safetensors"), kept);
  WriteText(Path("ckpt/hf_quant_config.json"),
            R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
               "group_size": 16, "exclude_modules": ["model.layers.0.*", "lm_head",
               "model.layers.1.mlp.gate", "model.norm"]}})");
  auto s = Open(Path("ckpt"));
  ASSERT_NE(s, nullptr);
  const Inventory inv = Inspect(*s);
  const std::string p = "model.layers.1.mlp.experts.";
  EXPECT_THAT(inv.problems, Contains(HasSubstr(p + "1.down_proj.weight_scale_2: missing")));
  EXPECT_THAT(inv.problems, Contains(AllOf(HasSubstr(p + "2.down_proj.weight_scale: shape [4, 1]"),
                                           HasSubstr("expected [2, 2]"))));
  EXPECT_THAT(inv.problems, Contains(AllOf(HasSubstr(p + "3.down_proj.weight_scale_2: global "
                                                         "scale 0"))));
  EXPECT_THAT(inv.problems,
              Contains(AllOf(HasSubstr("model.layers.0.mlp.experts.0.down_proj: NVFP4 module"),
                             HasSubstr("\"model.layers.0.*\""))));
  EXPECT_THAT(inv.problems, Contains(HasSubstr(p + "4.down_proj.input_scale: missing")));
  EXPECT_THAT(inv.problems,
              Contains(AllOf(HasSubstr("model.layers.1.self_attn.q_proj.weight: high precision"),
                             HasSubstr("expect NVFP4"))));
  EXPECT_EQ(inv.problems.size(), 6u) << ::testing::PrintToString(inv.problems);
  for (const std::string& problem : inv.problems) {
    EXPECT_THAT(problem, ::testing::Not(HasSubstr("embed_tokens")));
    EXPECT_THAT(problem, ::testing::Not(HasSubstr(p + "0.")));
  }
  EXPECT_EQ(Row(inv, "model.layers.1.mlp.gate.weight")->reason, "not_routed_expert");
  EXPECT_THAT(FormatInventory(inv, false), HasSubstr("problems: 6"));

  // The same tensors as a receiver's file: no quantization config, so no exclude checks, and a
  // live publication carries no input_scale.
  WriteFile(Path("v7.safetensors"), kept, {{"version", "7"}, {"format", "pt"}});
  auto f = Open(Path("v7.safetensors"));
  ASSERT_NE(f, nullptr);
  const Inventory fi = Inspect(*f);
  EXPECT_EQ(fi.metadata.at("version"), "7");
  EXPECT_EQ(fi.problems.size(), 3u) << ::testing::PrintToString(fi.problems);
}

TEST_F(InspectTest, ExcludeEntriesMatchAsEnginesReadThem) {
  auto one = [](const std::string& entry) {
    absl::StatusOr<ExcludeList> list = ExcludeList::Create({entry});
    EXPECT_TRUE(list.ok()) << list.status();
    return *std::move(list);
  };
  auto every = [&](const std::string& entry, const std::string& module) {
    return one(entry).EveryEngine(module) != nullptr;
  };
  auto any = [&](const std::string& entry, const std::string& module) {
    return one(entry).AnyEngine(module) != nullptr;
  };
  EXPECT_TRUE(every("lm_head", "lm_head"));
  EXPECT_TRUE(every("model.layers.3", "model.layers.3.mlp.gate"));
  EXPECT_FALSE(every("model.layers.3", "model.layers.30.mlp.gate"));
  EXPECT_FALSE(every("model.layers.3.mlp", "model.layers.3"));
  EXPECT_TRUE(every("model.layers.0.*", "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(every("model.layers.0.*", "model.layers.10.self_attn.q_proj"));
  EXPECT_TRUE(every("*.mlp.gate", "model.layers.7.mlp.gate"));
  EXPECT_TRUE(every("model.layers.?.mlp.gate", "model.layers.7.mlp.gate"));
  EXPECT_FALSE(every("model.layers.?.mlp.gate", "model.layers.17.mlp.gate"));
  // `re:` entries as the project's ignore rules: a regex anchored at the start.
  EXPECT_TRUE(every("re:model\\.layers\\.[0-9]+\\.mlp\\.gate$", "model.layers.7.mlp.gate"));
  EXPECT_FALSE(every("re:model\\.layers\\.[0-9]+\\.mlp\\.gate$", "model.layers.7.mlp.gate_proj"));
  EXPECT_FALSE(every("re:mlp\\.gate", "model.layers.7.mlp.gate"));
  EXPECT_TRUE(every("re:.*mlp\\.gate", "model.layers.7.mlp.gate"));
  // vLLM also reads a plain entry as a substring of the module name.
  EXPECT_TRUE(any("model.layers.3", "model.layers.30.mlp.gate"));
  EXPECT_TRUE(any("mlp.gate", "model.layers.7.mlp.gate_proj"));
  EXPECT_TRUE(any("model.layers.0.*", "model.layers.0.self_attn"));
  EXPECT_FALSE(any("model.layers.4", "model.layers.3.mlp.gate"));
  EXPECT_FALSE(any("", "model.layers.3.mlp.gate"));
  EXPECT_FALSE(any("re:mlp\\.gate", "model.layers.7.mlp.gate"));
  // The first entry in list order that names the module, whichever reading found it.
  auto list = ExcludeList::Create({"model.layers.9", "*.mlp.gate", "model.layers.7", "mlp"});
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_NE(list->EveryEngine("model.layers.7.mlp.gate"), nullptr);
  EXPECT_EQ(*list->EveryEngine("model.layers.7.mlp.gate"), "*.mlp.gate");
  EXPECT_EQ(*list->EveryEngine("model.layers.7.self_attn"), "model.layers.7");
  EXPECT_EQ(*list->AnyEngine("model.layers.7.self_attn"), "model.layers.7");
  EXPECT_EQ(*list->AnyEngine("model.layers.99.mlp.up"), "model.layers.9");
  EXPECT_EQ(list->EveryEngine("model.layers.99.mlp.up"), nullptr);
  // A pattern RE2 cannot compile is refused, quoting it.
  absl::StatusOr<ExcludeList> bad = ExcludeList::Create({"lm_head", "re:(unclosed"});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("re:(unclosed"));
}

TEST_F(InspectTest, EveryModuleProblemIsReportedAndNoneHidesAnother) {
  std::vector<Raw> t;
  // A stack of two slices with a NaN global scale in slice 1 and a BF16 input_scale: both
  // reported, and the module still decodes for diff.
  const uint8_t two = kernels::FloatToE4M3(2.0f);
  t.push_back({"model.layers.1.mlp.experts.down_proj.weight",
               "U8",
               {2, 1, 8},
               std::vector<uint8_t>(16, 0x22)});
  t.push_back(
      {"model.layers.1.mlp.experts.down_proj.weight_scale", "F8_E4M3", {2, 1, 1}, {two, two}});
  t.push_back(
      {"model.layers.1.mlp.experts.down_proj.weight_scale_2", "F32", {2}, F32Bytes({1.0f, NAN})});
  t.push_back({"model.layers.1.mlp.experts.down_proj.input_scale", "BF16", {}, Bf16Bytes({1})});
  // Packed K = 4 (logical 8): named as such, not as a scale shape.
  t.push_back(
      {"model.layers.2.mlp.experts.0.up_proj.weight", "U8", {2, 4}, std::vector<uint8_t>(8)});
  t.push_back({"model.layers.2.mlp.experts.0.up_proj.weight_scale", "F8_E4M3", {2, 1}, {two, two}});
  t.push_back({"model.layers.2.mlp.experts.0.up_proj.weight_scale_2", "F32", {}, F32Bytes({1})});
  // A header-valid giant packed K behind a zero dim: no overflow, a problem.
  t.push_back({"model.layers.2.mlp.experts.1.up_proj.weight", "U8", {0, int64_t{1} << 62}, {}});
  t.push_back({"model.layers.2.mlp.experts.1.up_proj.weight_scale", "F8_E4M3", {0, 1}, {}});
  // Scales beside a BF16 weight: orphans.
  t.push_back({"model.layers.3.mlp.experts.0.up_proj.weight",
               "BF16",
               {2, 16},
               Bf16Bytes(std::vector<float>(32, 1.0f))});
  t.push_back({"model.layers.3.mlp.experts.0.up_proj.weight_scale", "F8_E4M3", {2, 1}, {two, two}});
  t.push_back({"model.layers.3.mlp.experts.0.up_proj.weight_scale_2", "F32", {}, F32Bytes({1})});
  WriteFile(Path("a.safetensors"), t);
  auto s = Open(Path("a.safetensors"));
  ASSERT_NE(s, nullptr);
  const Inventory inv = Inspect(*s);
  const std::string m = "model.layers.1.mlp.experts.down_proj";
  EXPECT_THAT(inv.problems,
              Contains(HasSubstr(m + ".weight_scale_2: global scale nan at slice 1")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr(m + ".input_scale: BF16 [], expected F32 with 1 "
                                                   "or 2 elements")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("experts.0.up_proj.weight: packed K = 4")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("experts.1.up_proj.weight: packed K = "
                                               "4611686018427387904 is too large")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("experts.1.up_proj.weight_scale_2: missing")));
  EXPECT_THAT(inv.problems,
              Contains(HasSubstr("layers.3.mlp.experts.0.up_proj.weight_scale: an NVFP4 scale "
                                 "without the U8 model.layers.3.mlp.experts.0.up_proj.weight")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("layers.3.mlp.experts.0.up_proj.weight_scale_2: an "
                                               "NVFP4 scale without")));
  EXPECT_EQ(inv.problems.size(), 7u) << ::testing::PrintToString(inv.problems);
  // The decodable stack is compared dequantized even with its bad input_scale: slice 0's global
  // scale 1.0 x block 2.0, one code 1.0 -> 1.5.
  std::vector<Raw> b = t;
  b[0].bytes[0] = kernels::PackE2M1(0x3, 0x2);
  WriteFile(Path("b.safetensors"), b);
  auto sb = Open(Path("b.safetensors"));
  ASSERT_NE(sb, nullptr);
  const DiffReport d = Diff(*s, *sb, 1);
  ASSERT_EQ(d.counts.at("changed_bytes"), 1);
  for (const TensorDiff& x : d.tensors) {
    if (x.change != Change::kChangedBytes) continue;
    EXPECT_EQ(x.elements, 32);
    EXPECT_EQ(x.differing_elements, 1);
    ASSERT_TRUE(x.max_abs_diff.has_value());
    EXPECT_DOUBLE_EQ(*x.max_abs_diff, 1.0);
  }
}

TEST_F(InspectTest, EngineReadingsOfTheExcludeList) {
  std::vector<Raw> t;
  AddNvfp4(&t, "model.layers.10.mlp.experts.0.down_proj", 2, 32, 0x2, 0.5f);
  t.push_back({"model.layers.10.self_attn.q_proj.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  t.push_back({"lm_head.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  t.push_back({"model.embed_tokens.weight", "BF16", {2, 2}, Bf16Bytes({1, 2, 3, 4})});
  fs::create_directories(Path("ckpt"));
  WriteFile(Path("ckpt/model.safetensors"), t);
  // "model.layers.1" is a substring of layer 10's names: vLLM would leave its experts
  // unquantized; the exact readers do not exclude q_proj; lm_head is a quantized layer to vLLM.
  WriteText(Path("ckpt/hf_quant_config.json"),
            R"({"quantization": {"quant_algo": "NVFP4", "group_size": 16,
               "kv_cache_quant_algo": null, "exclude_modules": ["model.layers.1"]}})");
  auto s = Open(Path("ckpt"));
  ASSERT_NE(s, nullptr);
  Inventory inv = Inspect(*s);
  EXPECT_THAT(inv.problems, Contains(AllOf(HasSubstr("model.layers.10.mlp.experts.0.down_proj: "
                                                     "NVFP4 module named by exclude entry"),
                                           HasSubstr("\"model.layers.1\""))));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("model.layers.10.self_attn.q_proj.weight: high "
                                               "precision")));
  EXPECT_THAT(inv.problems, Contains(HasSubstr("lm_head.weight: high precision")));
  EXPECT_EQ(inv.problems.size(), 3u) << ::testing::PrintToString(inv.problems);
  // MIXED_PRECISION lists what is quantized: no exclude checks. FP8: NVFP4 modules are wrong.
  WriteText(Path("ckpt/hf_quant_config.json"),
            R"({"quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": []}})");
  s = Open(Path("ckpt"));
  ASSERT_NE(s, nullptr);
  EXPECT_THAT(Inspect(*s).problems, ::testing::IsEmpty());
  WriteText(Path("ckpt/hf_quant_config.json"),
            R"({"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head",
               "model.layers.10.self_attn"]}})");
  s = Open(Path("ckpt"));
  ASSERT_NE(s, nullptr);
  inv = Inspect(*s);
  EXPECT_THAT(inv.problems,
              ::testing::ElementsAre(HasSubstr("1 NVFP4 modules under quant_algo FP8")));
  // A null quantization block is no quantization config.
  fs::remove(Path("ckpt/hf_quant_config.json"));
  WriteText(Path("ckpt/config.json"), R"({"quantization_config": null})");
  s = Open(Path("ckpt"));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->exclude_list(), nullptr);
}

TEST_F(InspectTest, EqualCodesUnderOtherScalesAreChangedScales) {
  std::vector<Raw> a;
  AddNvfp4(&a, "layers.1.mlp.experts.0.down_proj", 2, 32, 0x2, 0.25f);
  std::vector<Raw> b = a;
  b[2].bytes = F32Bytes({0.5f});  // weight_scale_2 doubled: every value doubles
  WriteFile(Path("a.safetensors"), a);
  WriteFile(Path("b.safetensors"), b);
  auto sa = Open(Path("a.safetensors"));
  auto sb = Open(Path("b.safetensors"));
  ASSERT_NE(sa, nullptr);
  ASSERT_NE(sb, nullptr);
  const DiffReport d = Diff(*sa, *sb);
  EXPECT_EQ(d.counts.at("changed_scales"), 1);
  EXPECT_EQ(d.counts.at("changed_bytes"), 1);  // weight_scale_2 itself
  for (const TensorDiff& t : d.tensors) {
    if (t.change != Change::kChangedScales) continue;
    EXPECT_EQ(t.name, "layers.1.mlp.experts.0.down_proj.weight");
    EXPECT_EQ(t.differing_elements, 0);
    ASSERT_TRUE(t.max_abs_diff.has_value());
    EXPECT_DOUBLE_EQ(*t.max_abs_diff, 0.5);  // 1.0 x 2.0 x (0.5 - 0.25)
  }
  EXPECT_THAT(FormatDiff(d, -1),
              HasSubstr("changed_scales layers.1.mlp.experts.0.down_proj.weight: "
                        "0 of 64 elements differ, max |a-b| 0.5"));
}

TEST_F(InspectTest, HostileSnapshotsAreRefusedNamingTheFile) {
  absl::StatusOr<std::unique_ptr<Snapshot>> s = Snapshot::Open(Path("absent"));
  EXPECT_TRUE(absl::IsNotFound(s.status())) << s.status();
  WriteText(Path("short.safetensors"), "abc");
  s = Snapshot::Open(Path("short.safetensors"));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("short.safetensors"));
  fs::create_directories(Path("empty"));
  EXPECT_FALSE(Snapshot::Open(Path("empty")).ok());

  const std::vector<Raw> one = {{"a.weight", "F32", {1}, F32Bytes({1})}};
  const std::vector<std::pair<std::string, std::string>> configs = {
      {"hf_quant_config.json", R"({"quantization": {"exclude_modules": "lm_head"}})"},
      {"hf_quant_config.json", R"({"quantization": {"exclude_modules": ["a", 3]}})"},
      {"hf_quant_config.json", R"({"quantization": 5})"},
      {"hf_quant_config.json", "{not json"},
      {"hf_quant_config.json", std::string(100, '[') + std::string(100, ']')},
      {"config.json", R"({"quantization_config": {"ignore": {"a": 1}}})"},
      {"hf_quant_config.json", R"({"quantization": {"exclude_modules": ["re:(unclosed"]}})"},
  };
  for (size_t i = 0; i < configs.size(); ++i) {
    const std::string dir = Path("bad" + std::to_string(i));
    fs::create_directories(dir);
    WriteFile(dir + "/model.safetensors", one);
    WriteText(fs::path(dir) / configs[i].first, configs[i].second);
    s = Snapshot::Open(dir);
    ASSERT_FALSE(s.ok()) << configs[i].second;
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr(configs[i].first)) << configs[i].second;
  }
  // A config without a quantization block is no quantization config at all.
  const std::string plain = Path("plain");
  fs::create_directories(plain);
  WriteFile(plain + "/model.safetensors", one);
  WriteText(fs::path(plain) / "config.json", R"({"num_hidden_layers": 2})");
  auto ok = Open(plain);
  ASSERT_NE(ok, nullptr);
  EXPECT_EQ(ok->exclude_list(), nullptr);
  EXPECT_TRUE(ok->quant_algo().empty());
}

}  // namespace
}  // namespace wpub::inspect
