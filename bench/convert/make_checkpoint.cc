// convert_bench_checkpoint: writes a synthetic HF MoE checkpoint of about --gb gigabytes for the
// conversion benchmark (GLM-like naming, experts [1536, 4096] bf16, shards of about 4 GB with a
// gate/up pair straddling every shard boundary). Prints the model's tensor count and bytes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/convert/testing/synthetic_checkpoint.h"
#include "core/synthetic/synthetic.h"

ABSL_FLAG(std::string, dir, "", "Output directory (created).");
ABSL_FLAG(double, gb, 8.0, "Approximate checkpoint size in GB (1e9 bytes).");
ABSL_FLAG(int, experts, 64, "Routed experts per MoE layer.");
ABSL_FLAG(int64_t, hidden_size, 4096, "Hidden size (K of gate/up, M of down).");
ABSL_FLAG(int64_t, moe_intermediate_size, 1536, "Expert intermediate size.");
ABSL_FLAG(int64_t, vocab_size, 32768, "Vocabulary size.");
ABSL_FLAG(double, shard_gb, 4.0, "Approximate shard size in GB.");
ABSL_FLAG(int, threads, 0, "Generator threads (0: all cores).");
ABSL_FLAG(uint64_t, seed, 1, "Value seed.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) {
    std::fprintf(stderr, "convert_bench_checkpoint: --dir is required\n");
    return 2;
  }
  wpub::synthetic::ModelShape shape = wpub::synthetic::ModelShape::GlmLike();
  shape.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  shape.moe_intermediate_size = absl::GetFlag(FLAGS_moe_intermediate_size);
  shape.intermediate_size = 2 * shape.hidden_size;
  shape.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  shape.num_attention_heads = static_cast<int>(shape.hidden_size / 128);
  shape.num_key_value_heads = std::max(1, shape.num_attention_heads / 4);
  shape.num_experts = absl::GetFlag(FLAGS_experts);
  shape.num_shared_experts = 1;
  shape.num_mtp_layers = 0;
  shape.first_k_dense = 1;
  // Bytes of one MoE layer's routed experts; layers are added until the target is reached.
  const double per_layer =
      3.0 * shape.num_experts * shape.hidden_size * shape.moe_intermediate_size * 2;
  const double target = absl::GetFlag(FLAGS_gb) * 1e9;
  shape.num_layers = 1 + std::max(1, static_cast<int>(std::ceil(target / per_layer)) - 1);
  auto model = wpub::synthetic::SyntheticModel::Create(shape);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  wpub::convert::testing::CheckpointSpec spec;
  spec.tensors = wpub::convert::testing::HfTensors(*model);
  spec.num_hidden_layers = shape.num_layers;
  spec.num_shards = std::max(1, static_cast<int>(std::ceil(static_cast<double>(model->num_bytes()) /
                                                           (absl::GetFlag(FLAGS_shard_gb) * 1e9))));
  spec.seed = absl::GetFlag(FLAGS_seed);
  const int threads = absl::GetFlag(FLAGS_threads);
  spec.threads = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  if (absl::Status s = wpub::convert::testing::WriteSyntheticCheckpoint(dir, spec); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("checkpoint %s: %d layers, %d experts, %zu tensors, %.3f GB, %d shards\n",
              dir.c_str(), shape.num_layers, shape.num_experts, spec.tensors.size(),
              static_cast<double>(model->num_bytes()) / 1e9, spec.num_shards);
  return 0;
}
