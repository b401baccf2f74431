// Deterministic synthetic MoE models: the conversion batches a Megatron->HF converter would
// hand to wpub (Megatron parameter name + ordered HF tensor descriptors) for DeepSeek-V3, GLM,
// Qwen3-MoE and Mixtral naming, and a seeded value generator for payload bytes. Used by
// `wpubctl policy-report`, `wpubctl publish-synthetic`, tests and benchmarks.
// Thread-safety: value types and pure functions; SyntheticModel is immutable after Create.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"

namespace wpub::synthetic {

enum class NamingStyle : uint8_t {
  // model.layers.N.self_attn.{q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj} (MLA),
  // mlp.experts.E.{gate,up,down}_proj, mlp.shared_experts.*, mlp.gate (+ e_score_correction_bias),
  // dense first layers, MTP layers appended as model.layers.{num_layers + i}.
  kDeepSeekV3,
  // As DeepSeek-V3 but GQA attention (q/k/v_proj with bias) like GLM-4.5.
  kGlm,
  // model.layers.N.self_attn.{q,k,v,o}_proj + q_norm/k_norm, mlp.experts.E.*; no shared expert.
  kQwen3Moe,
  // model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}, block_sparse_moe.gate.
  kMixtral,
};

// "deepseek_v3", "glm", "qwen3_moe", "mixtral".
absl::string_view NamingStyleName(NamingStyle style);
absl::StatusOr<NamingStyle> ParseNamingStyle(absl::string_view name);

struct ModelShape {
  NamingStyle style = NamingStyle::kGlm;
  int num_layers = 92;         // decoder layers (MTP layers come on top)
  int first_k_dense = 3;       // layers [0, first_k_dense) have a dense MLP
  int num_experts = 160;       // routed experts per MoE layer
  int num_shared_experts = 1;  // 0 for none; must be 0 for Qwen3-MoE and Mixtral
  int num_mtp_layers = 1;      // DeepSeek-V3 / GLM only
  int64_t hidden_size = 5120;
  int64_t moe_intermediate_size = 1536;  // per routed (and shared) expert
  int64_t intermediate_size = 12288;     // dense MLP
  int64_t vocab_size = 151552;
  int num_attention_heads = 96;
  int num_key_value_heads = 8;
  int64_t head_dim = 128;
  // MLA (DeepSeek-V3 style only).
  int64_t q_lora_rank = 1536;
  int64_t kv_lora_rank = 512;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  DType dtype = DType::kBFloat16;
  bool tie_word_embeddings = false;

  // Presets with the public models' real dimensions (and the above defaults for GLM-4.5).
  static ModelShape GlmLike();         // GLM-4.5: 92 layers, 160 experts, 1 shared, 1 MTP
  static ModelShape DeepSeekV3Like();  // 61 layers, 3 dense, 256 experts, 1 shared, 1 MTP
  static ModelShape Qwen3MoeLike();    // Qwen3-235B-A22B: 94 layers, 128 experts
  static ModelShape MixtralLike();     // Mixtral-8x7B: 32 layers, 8 experts
  // The one model small enough for unit tests with every kind of tensor its style has: 3 decoder
  // layers (the first dense, 1 shared expert and 1 MTP layer where the style has them), 4 routed
  // experts, hidden 64 x `scale` (expert 32 x, dense MLP 96 x, vocabulary 128 x, head 16 x; MLA
  // ranks 32 x), 4 attention heads, 2 KV heads. Tests that need another count set that field.
  static ModelShape Tiny(NamingStyle style = NamingStyle::kGlm, int scale = 1);
  static absl::StatusOr<ModelShape> Preset(NamingStyle style);
};

// One conversion batch: what the trainer's converter yields for one Megatron parameter.
struct ConversionBatch {
  std::string megatron_name;        // e.g. decoder.layers.7.mlp.experts.linear_fc1.weight3
  std::vector<TensorDesc> tensors;  // HF tensors in converter order (gate before up)
};

class SyntheticModel {
 public:
  // INVALID_ARGUMENT naming the field for non-positive sizes, first_k_dense > num_layers, MTP
  // layers with a style that has none, etc.
  static absl::StatusOr<SyntheticModel> Create(const ModelShape& shape);

  const ModelShape& shape() const { return shape_; }
  // Every batch of one publication, in the order a trainer walks its parameters: embeddings,
  // then each decoder layer (attention, norms, MLP or router + routed experts + shared
  // experts), the final norm, the output layer, then the MTP layers.
  const std::vector<ConversionBatch>& batches() const { return batches_; }
  int64_t num_tensors() const;  // HF tensors over all batches
  int64_t num_bytes() const;    // their total size

 private:
  SyntheticModel(ModelShape shape, std::vector<ConversionBatch> batches)
      : shape_(shape), batches_(std::move(batches)) {}
  ModelShape shape_;
  std::vector<ConversionBatch> batches_;
};

// The ignore list a modelopt NVFP4 export of `model` carries: the module (HF tensor name minus
// its last component) of every tensor that is not a routed expert, in model order, unique.
std::vector<std::string> HighPrecisionModules(const SyntheticModel& model);

// Deterministic 64-bit FNV-1a of a string (stable across platforms and runs).
uint64_t StableHash(absl::string_view s);

// Fills `out` (exactly desc.nbytes() bytes, little-endian) with normal-ish values (mean 0,
// standard deviation `stddev`; a sum of four uniforms, so bounded by 2*sqrt(3)*stddev) for
// bf16, fp16 or fp32 descs. Element i depends only on (seed, desc.name, i): any slice of a
// tensor can be produced independently and every run yields the same bytes. Rounding to
// bf16/fp16 is round-to-nearest-even. INVALID_ARGUMENT naming the tensor for another dtype or a
// size mismatch.
absl::Status FillTensor(const TensorDesc& desc, uint64_t seed, absl::Span<uint8_t> out,
                        float stddev = 0.02f);

}  // namespace wpub::synthetic
