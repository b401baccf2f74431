// --device cuda against --device cpu: byte-identical output directories on a few-hundred-MB
// synthetic checkpoint (GLM naming, pairs across shards, bf16/fp16/fp32 and stacked experts),
// standard NVFP4 and a 4over6 mode. Skips itself without a GPU or in a build without CUDA.
#include <unistd.h>

#include <filesystem>

#include "core/convert/convert.h"
#include "core/convert/testing/synthetic_checkpoint.h"
#include "gtest/gtest.h"
#include "tests/convert/convert_check.h"

namespace wpub::convert {
namespace {

namespace fs = std::filesystem;

class ConvertGpuTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wpub_convert_gpu_" + std::to_string(::getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

// Skips (returns false) when --device cuda is unavailable, probing with a one-tensor checkpoint
// before the large one is generated.
bool CudaAvailable(const fs::path& root, std::string* why) {
  testing::CheckpointSpec tiny;
  tiny.tensors = {{"model.layers.0.mlp.experts.0.down_proj.weight", DType::kBFloat16, {16, 32}}};
  tiny.num_hidden_layers = 1;
  tiny.num_shards = 1;
  if (!testing::WriteSyntheticCheckpoint((root / "probe").string(), tiny).ok()) return false;
  ConvertOptions o;
  o.model_dir = (root / "probe").string();
  o.save_dir = (root / "probe_out").string();
  o.device = Device::kCuda;
  absl::StatusOr<ConvertSummary> s = ConvertCheckpoint(o);
  if (s.ok()) return true;
  *why = s.status().ToString();
  return false;
}

TEST_P(ConvertGpuTest, CudaOutputIsByteIdenticalToCpu) {
  std::string why;
  if (!CudaAvailable(root_, &why)) GTEST_SKIP() << why;
  synthetic::ModelShape shape = synthetic::ModelShape::GlmLike();
  shape.num_layers = 6;
  shape.first_k_dense = 1;
  shape.num_experts = 24;
  shape.hidden_size = 1024;
  shape.moe_intermediate_size = 768;
  shape.intermediate_size = 2048;
  shape.vocab_size = 4096;
  shape.num_attention_heads = 8;
  shape.num_key_value_heads = 2;
  auto model = synthetic::SyntheticModel::Create(shape);
  ASSERT_TRUE(model.ok()) << model.status();
  testing::CheckpointSpec spec;
  spec.tensors = testing::HfTensors(*model);
  spec.tensors.push_back(
      {"model.layers.2.mlp.experts.gate_up_proj.weight", DType::kFloat16, {8, 256, 512}});
  spec.tensors.push_back({"model.layers.3.mlp.experts.7.w2.weight", DType::kFloat32, {100, 64}});
  spec.num_hidden_layers = shape.num_layers;
  spec.num_shards = 3;
  const std::string in = (root_ / "in").string();
  ASSERT_TRUE(testing::WriteSyntheticCheckpoint(in, spec).ok());

  ConvertOptions o;
  o.model_dir = in;
  o.mode = kernels::kAllQuantModes[GetParam()];
  o.num_layers_at_end_in_bf16 = 1;
  o.staging_bytes = 24 << 20;  // several batches, both staging slots used
  o.save_dir = (root_ / "cuda").string();
  o.device = Device::kCuda;
  absl::StatusOr<ConvertSummary> gpu = ConvertCheckpoint(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  o.save_dir = (root_ / "cpu").string();
  o.device = Device::kCpu;
  absl::StatusOr<ConvertSummary> cpu = ConvertCheckpoint(o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(gpu->tensors_quantized, 100);
  EXPECT_EQ(gpu->tensors_quantized, cpu->tensors_quantized);
  absl::Status same = CompareDirectories((root_ / "cuda").string(), (root_ / "cpu").string());
  EXPECT_TRUE(same.ok()) << same;
}

INSTANTIATE_TEST_SUITE_P(Modes, ConvertGpuTest, ::testing::Values(0, 3, 6));

}  // namespace
}  // namespace wpub::convert
