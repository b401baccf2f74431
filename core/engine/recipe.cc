// Recipe strings -> policy recipe + NVFP4 quantization mode.
#include "core/engine/recipe.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace wpub::engine {
namespace {

absl::Status BadRecipe(absl::string_view recipe, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "recipe '", recipe, "': ", why,
      " (expected bf16, nvfp4, or nvfp4_4over6[:<mae|mse>-<e448|e256>-<exact|fp16>])"));
}

}  // namespace

absl::StatusOr<ParsedRecipe> ParseRecipeString(absl::string_view recipe) {
  const std::string lower = absl::AsciiStrToLower(recipe);
  absl::string_view base = lower;
  absl::string_view mode_text;
  bool has_mode = false;
  if (const size_t colon = base.find(':'); colon != absl::string_view::npos) {
    mode_text = base.substr(colon + 1);
    base = base.substr(0, colon);
    has_mode = true;
  }
  ParsedRecipe out;
  if (base == "bf16" || base == "nvfp4") {
    if (has_mode) return BadRecipe(recipe, absl::StrCat("'", base, "' takes no mode"));
    out.recipe = base == "bf16" ? policy::Recipe::kBf16 : policy::Recipe::kNvfp4;
    out.canonical = std::string(base);
    return out;
  }
  if (base != "nvfp4_4over6" && base != "4over6") {
    return BadRecipe(recipe, "unsupported recipe");
  }
  kernels::ErrMetric metric = kernels::ErrMetric::kMAE;
  int e4m3_max = 256;
  kernels::ErrKind kind = kernels::ErrKind::kExact;
  if (has_mode) {
    if (mode_text.empty()) return BadRecipe(recipe, "empty mode");
    for (absl::string_view token : absl::StrSplit(mode_text, absl::ByAnyChar("-_"))) {
      if (token == "mae") {
        metric = kernels::ErrMetric::kMAE;
      } else if (token == "mse") {
        metric = kernels::ErrMetric::kMSE;
      } else if (token == "e448" || token == "448") {
        e4m3_max = 448;
      } else if (token == "e256" || token == "256") {
        e4m3_max = 256;
      } else if (token == "exact") {
        kind = kernels::ErrKind::kExact;
      } else if (token == "fp16" || token == "fp16err") {
        kind = kernels::ErrKind::kFP16;
      } else {
        return BadRecipe(recipe, absl::StrCat("unknown mode token '", token, "'"));
      }
    }
  }
  out.recipe = policy::Recipe::kNvfp4FourOverSix;
  out.mode = kernels::QuantMode::FourOverSix(metric, e4m3_max, kind);
  out.canonical =
      absl::StrCat("nvfp4_4over6:", metric == kernels::ErrMetric::kMAE ? "mae" : "mse", "-e",
                   e4m3_max, "-", kind == kernels::ErrKind::kExact ? "exact" : "fp16");
  return out;
}

}  // namespace wpub::engine
