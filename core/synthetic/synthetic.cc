// Synthetic MoE model descriptions: the Megatron -> HF conversion batches of four naming
// styles, and the seeded tensor value generator.
#include "core/synthetic/synthetic.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/nvfp4_math.h"

namespace wpub::synthetic {
namespace {

bool HasMla(NamingStyle s) { return s == NamingStyle::kDeepSeekV3; }
bool HasMtp(NamingStyle s) { return s == NamingStyle::kDeepSeekV3 || s == NamingStyle::kGlm; }
bool HasSharedExperts(NamingStyle s) { return HasMtp(s); }

// Builds the batches of one model; `shape` is already validated.
class Builder {
 public:
  explicit Builder(const ModelShape& shape) : s_(shape) {}

  std::vector<ConversionBatch> Build() {
    const int64_t h = s_.hidden_size;
    Add("embedding.word_embeddings.weight", {{"model.embed_tokens.weight", {s_.vocab_size, h}}});
    for (int layer = 0; layer < s_.num_layers; ++layer) {
      Layer(absl::StrCat("decoder.layers.", layer, "."), absl::StrCat("model.layers.", layer, "."),
            /*dense=*/layer < s_.first_k_dense);
    }
    Add("decoder.final_layernorm.weight", {{"model.norm.weight", {h}}});
    if (!s_.tie_word_embeddings) {
      Add("output_layer.weight", {{"lm_head.weight", {s_.vocab_size, h}}});
    }
    for (int i = 0; i < s_.num_mtp_layers; ++i) {
      const std::string mg = absl::StrCat("mtp.layers.", i, ".");
      const std::string hf = absl::StrCat("model.layers.", s_.num_layers + i, ".");
      Add(mg + "enorm.weight", {{hf + "enorm.weight", {h}}});
      Add(mg + "hnorm.weight", {{hf + "hnorm.weight", {h}}});
      Add(mg + "eh_proj.weight", {{hf + "eh_proj.weight", {h, 2 * h}}});
      Layer(mg + "transformer_layer.", hf, /*dense=*/false);
      Add(mg + "final_layernorm.weight", {{hf + "shared_head.norm.weight", {h}}});
    }
    return std::move(batches_);
  }

 private:
  struct Spec {
    std::string name;
    Shape shape;
  };

  void Add(std::string megatron, std::vector<Spec> specs, DType dtype) {
    ConversionBatch b;
    b.megatron_name = std::move(megatron);
    for (Spec& spec : specs)
      b.tensors.push_back({std::move(spec.name), dtype, std::move(spec.shape)});
    batches_.push_back(std::move(b));
  }
  void Add(std::string megatron, std::vector<Spec> specs) {
    Add(std::move(megatron), std::move(specs), s_.dtype);
  }

  void Attention(const std::string& mg, const std::string& hf) {
    const int64_t h = s_.hidden_size;
    const std::string a = mg + "self_attention.";
    const std::string o = hf + "self_attn.";
    if (HasMla(s_.style)) {
      const int64_t heads = s_.num_attention_heads;
      const int64_t nope = s_.head_dim;
      const int64_t rope = s_.qk_rope_head_dim;
      Add(mg + "input_layernorm.weight", {{hf + "input_layernorm.weight", {h}}});
      Add(a + "linear_q_down_proj.weight", {{o + "q_a_proj.weight", {s_.q_lora_rank, h}}});
      Add(a + "linear_q_up_proj.layer_norm_weight",
          {{o + "q_a_layernorm.weight", {s_.q_lora_rank}}});
      Add(a + "linear_q_up_proj.weight",
          {{o + "q_b_proj.weight", {heads * (nope + rope), s_.q_lora_rank}}});
      Add(a + "linear_kv_down_proj.weight",
          {{o + "kv_a_proj_with_mqa.weight", {s_.kv_lora_rank + rope, h}}});
      Add(a + "linear_kv_up_proj.layer_norm_weight",
          {{o + "kv_a_layernorm.weight", {s_.kv_lora_rank}}});
      Add(a + "linear_kv_up_proj.weight",
          {{o + "kv_b_proj.weight", {heads * (nope + s_.v_head_dim), s_.kv_lora_rank}}});
      Add(a + "linear_proj.weight", {{o + "o_proj.weight", {h, heads * s_.v_head_dim}}});
      return;
    }
    const int64_t q = s_.num_attention_heads * s_.head_dim;
    const int64_t kv = s_.num_key_value_heads * s_.head_dim;
    Add(a + "linear_qkv.layer_norm_weight", {{hf + "input_layernorm.weight", {h}}});
    Add(a + "linear_qkv.weight", {{o + "q_proj.weight", {q, h}},
                                  {o + "k_proj.weight", {kv, h}},
                                  {o + "v_proj.weight", {kv, h}}});
    if (s_.style == NamingStyle::kGlm) {  // GLM-4.5 has attention biases
      Add(a + "linear_qkv.bias",
          {{o + "q_proj.bias", {q}}, {o + "k_proj.bias", {kv}}, {o + "v_proj.bias", {kv}}});
    }
    if (s_.style == NamingStyle::kQwen3Moe) {
      Add(a + "q_layernorm.weight", {{o + "q_norm.weight", {s_.head_dim}}});
      Add(a + "k_layernorm.weight", {{o + "k_norm.weight", {s_.head_dim}}});
    }
    Add(a + "linear_proj.weight", {{o + "o_proj.weight", {h, q}}});
  }

  void Layer(const std::string& mg, const std::string& hf, bool dense) {
    const int64_t h = s_.hidden_size;
    Attention(mg, hf);
    const std::string mlp = mg + "mlp.";
    if (dense) {
      const int64_t i = s_.intermediate_size;
      Add(mlp + "linear_fc1.layer_norm_weight", {{hf + "post_attention_layernorm.weight", {h}}});
      Add(mlp + "linear_fc1.weight",
          {{hf + "mlp.gate_proj.weight", {i, h}}, {hf + "mlp.up_proj.weight", {i, h}}});
      Add(mlp + "linear_fc2.weight", {{hf + "mlp.down_proj.weight", {h, i}}});
      return;
    }
    const int64_t i = s_.moe_intermediate_size;
    const int64_t e = s_.num_experts;
    const bool mixtral = s_.style == NamingStyle::kMixtral;
    const std::string moe = hf + (mixtral ? "block_sparse_moe." : "mlp.");
    Add(mg + "pre_mlp_layernorm.weight", {{hf + "post_attention_layernorm.weight", {h}}});
    Add(mlp + "router.weight", {{moe + "gate.weight", {e, h}}});
    if (HasMtp(s_.style)) {  // DeepSeek-V3/GLM sigmoid routing with a load-balancing bias
      Add(mlp + "router.expert_bias", {{moe + "gate.e_score_correction_bias", {e}}},
          DType::kFloat32);
    }
    for (int64_t x = 0; x < e; ++x) {
      const std::string ex = absl::StrCat(moe, "experts.", x, ".");
      Add(absl::StrCat(mlp, "experts.linear_fc1.weight", x),
          {{ex + (mixtral ? "w1.weight" : "gate_proj.weight"), {i, h}},
           {ex + (mixtral ? "w3.weight" : "up_proj.weight"), {i, h}}});
      Add(absl::StrCat(mlp, "experts.linear_fc2.weight", x),
          {{ex + (mixtral ? "w2.weight" : "down_proj.weight"), {h, i}}});
    }
    if (s_.num_shared_experts > 0) {
      const int64_t si = i * s_.num_shared_experts;
      const std::string sh = hf + "mlp.shared_experts.";
      Add(mlp + "shared_experts.linear_fc1.weight",
          {{sh + "gate_proj.weight", {si, h}}, {sh + "up_proj.weight", {si, h}}});
      Add(mlp + "shared_experts.linear_fc2.weight", {{sh + "down_proj.weight", {h, si}}});
    }
  }

  const ModelShape& s_;
  std::vector<ConversionBatch> batches_;
};

absl::Status Positive(int64_t v, absl::string_view field) {
  if (v > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("model shape: ", field, " must be > 0, got ", v));
}

absl::Status Validate(const ModelShape& s) {
  for (auto [v, field] : {std::pair<int64_t, absl::string_view>{s.num_layers, "num_layers"},
                          {s.hidden_size, "hidden_size"},
                          {s.moe_intermediate_size, "moe_intermediate_size"},
                          {s.vocab_size, "vocab_size"},
                          {s.num_attention_heads, "num_attention_heads"},
                          {s.head_dim, "head_dim"}}) {
    if (absl::Status st = Positive(v, field); !st.ok()) return st;
  }
  if (s.first_k_dense < 0 || s.first_k_dense > s.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("model shape: first_k_dense must be in [0, num_layers=", s.num_layers,
                     "], got ", s.first_k_dense));
  }
  if (s.first_k_dense > 0) {
    if (absl::Status st = Positive(s.intermediate_size, "intermediate_size"); !st.ok()) return st;
  }
  if (s.first_k_dense < s.num_layers || s.num_mtp_layers > 0) {
    if (absl::Status st = Positive(s.num_experts, "num_experts"); !st.ok()) return st;
  }
  if (s.num_shared_experts < 0 || s.num_mtp_layers < 0) {
    return absl::InvalidArgumentError(
        "model shape: num_shared_experts and num_mtp_layers must be >= 0");
  }
  if (!HasMtp(s.style) && s.num_mtp_layers > 0) {
    return absl::InvalidArgumentError(absl::StrCat("model shape: style ", NamingStyleName(s.style),
                                                   " has no MTP layers; num_mtp_layers must be 0"));
  }
  if (!HasSharedExperts(s.style) && s.num_shared_experts > 0) {
    return absl::InvalidArgumentError(absl::StrCat("model shape: style ", NamingStyleName(s.style),
                                                   " has no shared experts; num_shared_experts "
                                                   "must be 0"));
  }
  if (HasMla(s.style)) {
    for (auto [v, field] : {std::pair<int64_t, absl::string_view>{s.q_lora_rank, "q_lora_rank"},
                            {s.kv_lora_rank, "kv_lora_rank"},
                            {s.qk_rope_head_dim, "qk_rope_head_dim"},
                            {s.v_head_dim, "v_head_dim"}}) {
      if (absl::Status st = Positive(v, field); !st.ok()) return st;
    }
  } else {
    if (absl::Status st = Positive(s.num_key_value_heads, "num_key_value_heads"); !st.ok())
      return st;
    if (s.num_attention_heads % s.num_key_value_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model shape: num_attention_heads=", s.num_attention_heads,
                       " must be a multiple of num_key_value_heads=", s.num_key_value_heads));
    }
  }
  if (!IsQuantizableFloat(s.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model shape: dtype must be bf16, fp16 or fp32, got ", DTypeName(s.dtype)));
  }
  return absl::OkStatus();
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

absl::string_view NamingStyleName(NamingStyle style) {
  switch (style) {
    case NamingStyle::kDeepSeekV3:
      return "deepseek_v3";
    case NamingStyle::kGlm:
      return "glm";
    case NamingStyle::kQwen3Moe:
      return "qwen3_moe";
    case NamingStyle::kMixtral:
      return "mixtral";
  }
  return "unknown";
}

absl::StatusOr<NamingStyle> ParseNamingStyle(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (NamingStyle s : {NamingStyle::kDeepSeekV3, NamingStyle::kGlm, NamingStyle::kQwen3Moe,
                        NamingStyle::kMixtral}) {
    if (lower == NamingStyleName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "naming style \"", name, "\" is not one of deepseek_v3, glm, qwen3_moe, mixtral"));
}

ModelShape ModelShape::GlmLike() { return ModelShape{}; }

ModelShape ModelShape::DeepSeekV3Like() {
  ModelShape s;
  s.style = NamingStyle::kDeepSeekV3;
  s.num_layers = 61;
  s.first_k_dense = 3;
  s.num_experts = 256;
  s.num_shared_experts = 1;
  s.num_mtp_layers = 1;
  s.hidden_size = 7168;
  s.moe_intermediate_size = 2048;
  s.intermediate_size = 18432;
  s.vocab_size = 129280;
  s.num_attention_heads = 128;
  s.num_key_value_heads = 128;
  s.head_dim = 128;  // qk_nope_head_dim
  return s;
}

ModelShape ModelShape::Qwen3MoeLike() {
  ModelShape s;
  s.style = NamingStyle::kQwen3Moe;
  s.num_layers = 94;
  s.first_k_dense = 0;
  s.num_experts = 128;
  s.num_shared_experts = 0;
  s.num_mtp_layers = 0;
  s.hidden_size = 4096;
  s.moe_intermediate_size = 1536;
  s.intermediate_size = 12288;
  s.vocab_size = 151936;
  s.num_attention_heads = 64;
  s.num_key_value_heads = 4;
  s.head_dim = 128;
  return s;
}

ModelShape ModelShape::Tiny(NamingStyle style, int scale) {
  const bool full = style == NamingStyle::kDeepSeekV3 || style == NamingStyle::kGlm;
  ModelShape s;
  s.style = style;
  s.num_layers = 3;
  s.first_k_dense = full ? 1 : 0;
  s.num_experts = 4;
  s.num_shared_experts = full ? 1 : 0;
  s.num_mtp_layers = full ? 1 : 0;
  s.hidden_size = 64 * scale;
  s.moe_intermediate_size = 32 * scale;
  s.intermediate_size = 96 * scale;
  s.vocab_size = 128 * scale;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.head_dim = 16 * scale;
  s.q_lora_rank = 32 * scale;
  s.kv_lora_rank = 32 * scale;
  s.qk_rope_head_dim = 16 * scale;
  s.v_head_dim = 16 * scale;
  return s;
}

ModelShape ModelShape::MixtralLike() {
  ModelShape s;
  s.style = NamingStyle::kMixtral;
  s.num_layers = 32;
  s.first_k_dense = 0;
  s.num_experts = 8;
  s.num_shared_experts = 0;
  s.num_mtp_layers = 0;
  s.hidden_size = 4096;
  s.moe_intermediate_size = 14336;
  s.intermediate_size = 14336;
  s.vocab_size = 32000;
  s.num_attention_heads = 32;
  s.num_key_value_heads = 8;
  s.head_dim = 128;
  return s;
}

absl::StatusOr<ModelShape> ModelShape::Preset(NamingStyle style) {
  switch (style) {
    case NamingStyle::kDeepSeekV3:
      return DeepSeekV3Like();
    case NamingStyle::kGlm:
      return GlmLike();
    case NamingStyle::kQwen3Moe:
      return Qwen3MoeLike();
    case NamingStyle::kMixtral:
      return MixtralLike();
  }
  return absl::InvalidArgumentError("unknown naming style");
}

absl::StatusOr<SyntheticModel> SyntheticModel::Create(const ModelShape& shape) {
  if (absl::Status st = Validate(shape); !st.ok()) return st;
  return SyntheticModel(shape, Builder(shape).Build());
}

int64_t SyntheticModel::num_tensors() const {
  int64_t n = 0;
  for (const ConversionBatch& b : batches_) n += static_cast<int64_t>(b.tensors.size());
  return n;
}

int64_t SyntheticModel::num_bytes() const {
  int64_t n = 0;
  for (const ConversionBatch& b : batches_) {
    for (const TensorDesc& t : b.tensors) n += t.nbytes();
  }
  return n;
}

std::vector<std::string> HighPrecisionModules(const SyntheticModel& model) {
  std::vector<std::string> modules;
  absl::flat_hash_set<std::string> seen;
  for (const ConversionBatch& b : model.batches()) {
    // Routed experts are exactly the batches of the Megatron grouped expert GEMMs.
    if (absl::StrContains(b.megatron_name, "mlp.experts.linear_fc")) continue;
    for (const TensorDesc& t : b.tensors) {
      std::string module = t.name.substr(0, t.name.rfind('.'));
      if (seen.insert(module).second) modules.push_back(std::move(module));
    }
  }
  return modules;
}

uint64_t StableHash(absl::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

absl::Status FillTensor(const TensorDesc& desc, uint64_t seed, absl::Span<uint8_t> out,
                        float stddev) {
  if (!IsQuantizableFloat(desc.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("FillTensor: ", desc.name, " is ",
                                                   DTypeName(desc.dtype),
                                                   "; only bf16, fp16 and fp32 are generated"));
  }
  if (static_cast<int64_t>(out.size()) != desc.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("FillTensor: ", desc.name, " needs ",
                                                   desc.nbytes(), " bytes, got ", out.size()));
  }
  const uint64_t key = SplitMix64(seed ^ StableHash(desc.name));
  // Irwin-Hall with four 16-bit uniforms: mean 2, variance 4/12; rescaled to N(0, stddev)-ish.
  const float scale = stddev * std::sqrt(3.0f) / 65536.0f;
  const int64_t n = desc.numel();
  uint8_t* dst = out.data();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = SplitMix64(key + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull);
    const int32_t sum = static_cast<int32_t>(r & 0xFFFF) +
                        static_cast<int32_t>((r >> 16) & 0xFFFF) +
                        static_cast<int32_t>((r >> 32) & 0xFFFF) + static_cast<int32_t>(r >> 48);
    const float v = (static_cast<float>(sum) - 131070.0f) * scale;  // exact: sum < 2^24
    switch (desc.dtype) {
      case DType::kFloat32: {
        const uint32_t bits = std::bit_cast<uint32_t>(v);
        std::memcpy(dst + 4 * i, &bits, 4);
        break;
      }
      case DType::kBFloat16: {
        const uint16_t bits = kernels::FloatToBf16(v);
        std::memcpy(dst + 2 * i, &bits, 2);
        break;
      }
      default: {
        const uint16_t bits = kernels::FloatToFp16(v);
        std::memcpy(dst + 2 * i, &bits, 2);
        break;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace wpub::synthetic
