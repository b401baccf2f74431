// Synthetic model flags: a preset per naming style, each dimension overridable.
#include "server/wpubctl/model_flags.h"

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "core/common/status.h"

ABSL_FLAG(std::string, model_style, "glm",
          "Synthetic model naming style and preset: glm (GLM-4.5), deepseek_v3, qwen3_moe, "
          "mixtral.");
ABSL_FLAG(std::optional<int>, num_layers, std::nullopt,
          "Decoder layers (MTP layers come on top). Default: the preset's.");
ABSL_FLAG(std::optional<int>, first_k_dense, std::nullopt,
          "Leading layers with a dense MLP. Default: the preset's.");
ABSL_FLAG(std::optional<int>, num_experts, std::nullopt, "Routed experts per MoE layer.");
ABSL_FLAG(std::optional<int>, num_shared_experts, std::nullopt,
          "Shared experts per MoE layer (glm, deepseek_v3 only).");
ABSL_FLAG(std::optional<int>, num_mtp_layers, std::nullopt, "MTP layers (glm, deepseek_v3 only).");
ABSL_FLAG(std::optional<int64_t>, hidden_size, std::nullopt, "Hidden size.");
ABSL_FLAG(std::optional<int64_t>, moe_intermediate_size, std::nullopt,
          "Intermediate size of one routed (or shared) expert.");
ABSL_FLAG(std::optional<int64_t>, intermediate_size, std::nullopt,
          "Intermediate size of the dense MLP layers.");
ABSL_FLAG(std::optional<int64_t>, vocab_size, std::nullopt, "Vocabulary size.");
ABSL_FLAG(std::string, model_dtype, "bfloat16",
          "Element type of the weights: bfloat16, float16, float32.");

namespace wpub::wpubctl {

absl::StatusOr<synthetic::ModelShape> ModelShapeFromFlags() {
  WPUB_ASSIGN_OR_RETURN(synthetic::NamingStyle style,
                        synthetic::ParseNamingStyle(absl::GetFlag(FLAGS_model_style)));
  WPUB_ASSIGN_OR_RETURN(synthetic::ModelShape shape, synthetic::ModelShape::Preset(style));
  auto apply = [](const auto& flag, auto& field) {
    if (auto v = absl::GetFlag(flag)) field = *v;
  };
  apply(FLAGS_num_layers, shape.num_layers);
  apply(FLAGS_first_k_dense, shape.first_k_dense);
  apply(FLAGS_num_experts, shape.num_experts);
  apply(FLAGS_num_shared_experts, shape.num_shared_experts);
  apply(FLAGS_num_mtp_layers, shape.num_mtp_layers);
  apply(FLAGS_hidden_size, shape.hidden_size);
  apply(FLAGS_moe_intermediate_size, shape.moe_intermediate_size);
  apply(FLAGS_intermediate_size, shape.intermediate_size);
  apply(FLAGS_vocab_size, shape.vocab_size);
  WPUB_ASSIGN_OR_RETURN(shape.dtype, ParseDType(absl::GetFlag(FLAGS_model_dtype)));
  return shape;
}

}  // namespace wpub::wpubctl
