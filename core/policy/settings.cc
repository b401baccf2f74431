// Parsing and validation of the publication's precision settings and quantization config.
#include "core/policy/settings.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/json_bounds.h"
#include "core/common/status.h"
#include "nlohmann/json.hpp"

namespace wpub::policy {
namespace {

using Json = nlohmann::json;

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what) {
  // Depth and size first: the documents come from clients, and nesting bounds the recursion
  // of everything that walks a Json afterwards.
  WPUB_RETURN_IF_ERROR(CheckJsonBounds(text, what));
  // nlohmann reports malformed input by exception; keep it inside this function.
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // parse_error, and out_of_range for 1e999
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON: ", e.what()));
  }
}

// A value quoted in an error message: its JSON, cut to 80 bytes (a client's value may be large).
std::string Shown(const Json& v) {
  std::string text = v.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

absl::StatusOr<std::string> OptionalString(const Json& obj, absl::string_view key,
                                           absl::string_view path) {
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return std::string();
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, key, " must be a string, got ", it->type_name()));
  }
  return it->get<std::string>();
}

// A string (one-element list) or a list of strings; null/absent is empty.
absl::StatusOr<std::vector<std::string>> StringOrList(const Json& obj, absl::string_view key,
                                                      absl::string_view path) {
  std::vector<std::string> out;
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return out;
  if (it->is_string()) {
    out.push_back(it->get<std::string>());
    return out;
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, key, " must be a string or a list of strings, got ", it->type_name()));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& v = (*it)[i];
    if (!v.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, key, "[", i, "] must be a string, got ",
                                                     v.type_name(), ": ", Shown(v)));
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

absl::StatusOr<QuantizationConfig> QuantizationConfigFromJson(const Json& doc,
                                                              const std::string& path) {
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.empty() ? "quantization config" : path,
                                                   " must be a JSON object, got ",
                                                   doc.type_name()));
  }
  // A whole config.json: descend into its quantization_config.
  if (auto it = doc.find("quantization_config"); it != doc.end()) {
    return QuantizationConfigFromJson(*it, absl::StrCat(path, "quantization_config."));
  }
  const Json* body = &doc;
  std::string body_path = path;
  // hf_quant_config.json: {"producer": ..., "quantization": {...}}.
  if (auto it = doc.find("quantization"); it != doc.end()) {
    if (!it->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, "quantization must be a JSON object, got ", it->type_name()));
    }
    body = &*it;
    body_path = absl::StrCat(path, "quantization.");
  }
  QuantizationConfig config;
  WPUB_ASSIGN_OR_RETURN(config.quant_algo, OptionalString(*body, "quant_algo", body_path));
  WPUB_ASSIGN_OR_RETURN(config.quant_method, OptionalString(*body, "quant_method", body_path));
  WPUB_ASSIGN_OR_RETURN(std::vector<std::string> ignore, StringOrList(*body, "ignore", body_path));
  WPUB_ASSIGN_OR_RETURN(std::vector<std::string> exclude,
                        StringOrList(*body, "exclude_modules", body_path));
  // NVFP4 scales one E4M3 value per 16 elements; a config claiming another group size would make
  // the engine read the published scales with the wrong layout.
  if (config.IsNvfp4()) {
    if (auto it = body->find("group_size"); it != body->end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<int64_t>() != 16) {
        return absl::InvalidArgumentError(
            absl::StrCat(body_path, "group_size must be 16 for NVFP4, got ", Shown(*it)));
      }
    }
  }
  // `ignore` first, then the `exclude_modules` entries not already present, order kept.
  absl::flat_hash_set<std::string> seen(ignore.begin(), ignore.end());
  config.ignore_rules = std::move(ignore);
  for (std::string& rule : exclude) {
    if (seen.insert(rule).second) config.ignore_rules.push_back(std::move(rule));
  }
  return config;
}

absl::StatusOr<std::vector<std::string>> StringList(const Json& obj, absl::string_view key) {
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return std::vector<std::string>();
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, " must be a list of strings, got ", it->type_name()));
  }
  return StringOrList(obj, key, "");
}

absl::StatusOr<int64_t> OptionalInt(const Json& obj, absl::string_view key, int64_t fallback) {
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, " must be an integer, got ", it->type_name(), ": ", Shown(*it)));
  }
  return it->get<int64_t>();
}

absl::StatusOr<bool> OptionalBool(const Json& obj, absl::string_view key) {
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return false;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, " must be a boolean, got ", it->type_name(), ": ", Shown(*it)));
  }
  return it->get<bool>();
}

}  // namespace

absl::string_view RecipeName(Recipe recipe) {
  switch (recipe) {
    case Recipe::kBf16:
      return "bf16";
    case Recipe::kNvfp4:
      return "nvfp4";
    case Recipe::kNvfp4FourOverSix:
      return "nvfp4_4over6";
  }
  return "unknown";
}

absl::StatusOr<Recipe> ParseRecipe(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bf16") return Recipe::kBf16;
  if (lower == "nvfp4") return Recipe::kNvfp4;
  if (lower == "nvfp4_4over6" || lower == "4over6") return Recipe::kNvfp4FourOverSix;
  return absl::InvalidArgumentError(
      absl::StrCat("recipe \"", name, "\" is not one of bf16, nvfp4, nvfp4_4over6"));
}

bool IsNvfp4(Recipe recipe) { return recipe != Recipe::kBf16; }

bool QuantizationConfig::IsNvfp4() const {
  if (!quant_algo.empty()) return absl::StrContains(absl::AsciiStrToLower(quant_algo), "nvfp4");
  return absl::EqualsIgnoreCase(quant_method, "modelopt_fp4") ||
         absl::StrContains(absl::AsciiStrToLower(quant_method), "nvfp4");
}

absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(absl::string_view json_text) {
  WPUB_ASSIGN_OR_RETURN(Json doc, ParseJson(json_text, "quantization config"));
  return QuantizationConfigFromJson(doc, "");
}

absl::Status ValidatePolicySettings(const PolicySettings& settings) {
  if (IsNvfp4(settings.recipe) && !settings.quantization.IsNvfp4()) {
    const QuantizationConfig& q = settings.quantization;
    return absl::InvalidArgumentError(
        absl::StrCat("recipe ", RecipeName(settings.recipe),
                     " needs an NVFP4 quantization_config, but quant_algo is \"", q.quant_algo,
                     "\" and quant_method is \"", q.quant_method, "\""));
  }
  const PrecisionExceptions& e = settings.exceptions;
  if (e.first_last_layers_bf16) {
    if (e.num_layers < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("first_last_layers_bf16 needs num_layers >= 1, got ", e.num_layers));
    }
    if (e.num_layers_at_start_in_bf16 < 0 || e.num_layers_at_end_in_bf16 < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16 must be >= 0, got ",
          e.num_layers_at_start_in_bf16, " and ", e.num_layers_at_end_in_bf16));
    }
  }
  return absl::OkStatus();
}

namespace {

// The settings of a parsed document (ParsePolicySettings' and ParseHeaderSettings' common part).
absl::StatusOr<PolicySettings> SettingsFromDocument(const Json& doc) {
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy settings must be a JSON object, got ", doc.type_name()));
  }
  static constexpr absl::string_view kKeys[] = {"recipe",
                                                "quantization_config",
                                                "extra_high_precision_layers_megatron",
                                                "extra_high_precision_layers_hf",
                                                "first_last_layers_bf16",
                                                "num_layers",
                                                "num_layers_at_start_in_bf16",
                                                "num_layers_at_end_in_bf16",
                                                "allow_nothing_quantized"};
  for (const auto& [key, value] : doc.items()) {
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
      return absl::InvalidArgumentError(absl::StrCat("policy settings: unknown key \"", key, "\""));
    }
  }
  PolicySettings settings;
  WPUB_ASSIGN_OR_RETURN(std::string recipe, OptionalString(doc, "recipe", ""));
  if (!recipe.empty()) {
    WPUB_ASSIGN_OR_RETURN(settings.recipe, ParseRecipe(recipe));
  }
  if (auto it = doc.find("quantization_config"); it != doc.end() && !it->is_null()) {
    WPUB_ASSIGN_OR_RETURN(settings.quantization,
                          QuantizationConfigFromJson(*it, "quantization_config."));
  }
  PrecisionExceptions& e = settings.exceptions;
  WPUB_ASSIGN_OR_RETURN(e.extra_high_precision_layers_megatron,
                        StringList(doc, "extra_high_precision_layers_megatron"));
  WPUB_ASSIGN_OR_RETURN(e.extra_high_precision_layers_hf,
                        StringList(doc, "extra_high_precision_layers_hf"));
  WPUB_ASSIGN_OR_RETURN(e.first_last_layers_bf16, OptionalBool(doc, "first_last_layers_bf16"));
  WPUB_ASSIGN_OR_RETURN(e.num_layers, OptionalInt(doc, "num_layers", 0));
  WPUB_ASSIGN_OR_RETURN(e.num_layers_at_start_in_bf16,
                        OptionalInt(doc, "num_layers_at_start_in_bf16", 0));
  WPUB_ASSIGN_OR_RETURN(e.num_layers_at_end_in_bf16,
                        OptionalInt(doc, "num_layers_at_end_in_bf16", 0));
  WPUB_ASSIGN_OR_RETURN(settings.allow_nothing_quantized,
                        OptionalBool(doc, "allow_nothing_quantized"));
  WPUB_RETURN_IF_ERROR(ValidatePolicySettings(settings));
  return settings;
}

}  // namespace

absl::StatusOr<PolicySettings> ParsePolicySettings(absl::string_view json_text) {
  WPUB_ASSIGN_OR_RETURN(Json doc, ParseJson(json_text, "policy settings"));
  return SettingsFromDocument(doc);
}

absl::StatusOr<PolicySettings> ParseHeaderSettings(absl::string_view policy_json,
                                                   absl::string_view quantization_config_json,
                                                   Recipe recipe) {
  Json doc = Json::object();
  if (!policy_json.empty()) {
    WPUB_ASSIGN_OR_RETURN(doc, ParseJson(policy_json, "policy_json"));
    if (!doc.is_object()) return absl::InvalidArgumentError("policy_json: not a JSON object");
  }
  const std::string recipe_name(RecipeName(recipe));
  if (auto it = doc.find("recipe"); it != doc.end()) {
    if (!it->is_string()) {
      return absl::InvalidArgumentError("policy_json.recipe: must be a string");
    }
    absl::StatusOr<Recipe> r = ParseRecipe(it->get<std::string>());
    if (!r.ok() || *r != recipe) {
      return absl::InvalidArgumentError(absl::StrCat("policy_json.recipe '", it->get<std::string>(),
                                                     "' conflicts with recipe '", recipe_name,
                                                     "'"));
    }
  }
  doc["recipe"] = recipe_name;
  if (!quantization_config_json.empty()) {
    if (doc.contains("quantization_config")) {
      return absl::InvalidArgumentError(
          "quantization_config given both in quantization_config_json and in policy_json");
    }
    WPUB_ASSIGN_OR_RETURN(Json qc, ParseJson(quantization_config_json, "quantization_config_json"));
    if (!qc.is_object()) {
      return absl::InvalidArgumentError("quantization_config_json: not a JSON object");
    }
    doc["quantization_config"] = std::move(qc);
  } else if (!doc.contains("quantization_config") && IsNvfp4(recipe)) {
    // A trainer that sends no config gets the plain NVFP4 one (no ignore rules).
    doc["quantization_config"] = {{"quant_algo", "NVFP4"}, {"quant_method", "modelopt"}};
  }
  return SettingsFromDocument(doc);
}

}  // namespace wpub::policy
