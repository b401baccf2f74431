// Policy settings flags.
#include "server/wpubctl/policy_flags.h"

#include <fstream>
#include <optional>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/policy/settings.h"

ABSL_FLAG(std::string, policy_settings, "",
          "Path to a policy settings JSON file ({\"recipe\", \"quantization_config\", "
          "\"extra_high_precision_layers_megatron\", ...}); excludes the other policy flags.");
ABSL_FLAG(std::optional<std::string>, recipe, std::nullopt,
          "bf16, nvfp4 or nvfp4_4over6. Default: nvfp4.");
ABSL_FLAG(std::optional<std::string>, quantization_config, std::nullopt,
          "Path to a quantization config JSON: a quantization_config object, a whole config.json "
          "or an hf_quant_config.json. Default: NVFP4 (modelopt) ignoring every module of the "
          "synthetic model that is not a routed-expert GEMM.");
ABSL_FLAG(std::vector<std::string>, extra_high_precision_layers_megatron, {},
          "Comma-separated substrings of Megatron names whose batches stay in high precision.");
ABSL_FLAG(std::vector<std::string>, extra_high_precision_layers_hf, {},
          "Comma-separated substrings of HF names kept in high precision (offline path).");
ABSL_FLAG(bool, first_last_layers_bf16, false,
          "Keep the first/last decoder layers in BF16 (counts below; MTP layer indices count "
          "from 0 and are compared the same way).");
ABSL_FLAG(int64_t, num_layers_at_start_in_bf16, 0, "With --first_last_layers_bf16.");
ABSL_FLAG(int64_t, num_layers_at_end_in_bf16, 0, "With --first_last_layers_bf16.");

namespace wpub::wpubctl {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<policy::PolicySettings> PolicySettingsFromFlags(
    const synthetic::SyntheticModel& model) {
  const std::string settings_path = absl::GetFlag(FLAGS_policy_settings);
  if (!settings_path.empty()) {
    if (absl::GetFlag(FLAGS_recipe) || absl::GetFlag(FLAGS_quantization_config) ||
        !absl::GetFlag(FLAGS_extra_high_precision_layers_megatron).empty() ||
        !absl::GetFlag(FLAGS_extra_high_precision_layers_hf).empty() ||
        absl::GetFlag(FLAGS_first_last_layers_bf16)) {
      return absl::InvalidArgumentError(
          "--policy_settings excludes --recipe, --quantization_config and the exception flags");
    }
    WPUB_ASSIGN_OR_RETURN(std::string text, ReadFile(settings_path, "policy_settings"));
    absl::StatusOr<policy::PolicySettings> s = policy::ParsePolicySettings(text);
    if (!s.ok()) {
      return absl::Status(s.status().code(), absl::StrCat("--policy_settings ", settings_path, ": ",
                                                          s.status().message()));
    }
    return s;
  }
  policy::PolicySettings s;
  if (auto recipe = absl::GetFlag(FLAGS_recipe)) {
    WPUB_ASSIGN_OR_RETURN(s.recipe, policy::ParseRecipe(*recipe));
  }
  if (auto path = absl::GetFlag(FLAGS_quantization_config)) {
    WPUB_ASSIGN_OR_RETURN(std::string text, ReadFile(*path, "quantization_config"));
    absl::StatusOr<policy::QuantizationConfig> q = policy::ParseQuantizationConfig(text);
    if (!q.ok()) {
      return absl::Status(q.status().code(), absl::StrCat("--quantization_config ", *path, ": ",
                                                          q.status().message()));
    }
    s.quantization = *std::move(q);
  } else if (policy::IsNvfp4(s.recipe)) {
    s.quantization.quant_algo = "NVFP4";
    s.quantization.quant_method = "modelopt";
    s.quantization.ignore_rules = synthetic::HighPrecisionModules(model);
  }
  s.exceptions.extra_high_precision_layers_megatron =
      absl::GetFlag(FLAGS_extra_high_precision_layers_megatron);
  s.exceptions.extra_high_precision_layers_hf = absl::GetFlag(FLAGS_extra_high_precision_layers_hf);
  s.exceptions.first_last_layers_bf16 = absl::GetFlag(FLAGS_first_last_layers_bf16);
  s.exceptions.num_layers = model.shape().num_layers;
  s.exceptions.num_layers_at_start_in_bf16 = absl::GetFlag(FLAGS_num_layers_at_start_in_bf16);
  s.exceptions.num_layers_at_end_in_bf16 = absl::GetFlag(FLAGS_num_layers_at_end_in_bf16);
  WPUB_RETURN_IF_ERROR(policy::ValidatePolicySettings(s));
  return s;
}

}  // namespace wpub::wpubctl
