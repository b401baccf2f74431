// Parsing of a publication's recipe string into the policy's recipe and the kernels' quantization
// mode (see PublicationHeader::recipe for the accepted spellings). Pure functions.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/policy/settings.h"
#include "kernels/nvfp4.h"

namespace wpub::engine {

struct ParsedRecipe {
  policy::Recipe recipe = policy::Recipe::kNvfp4;
  kernels::QuantMode mode = kernels::QuantMode::Standard();
  // Canonical spelling: "bf16", "nvfp4", or "nvfp4_4over6:<mae|mse>-<e448|e256>-<exact|fp16>".
  std::string canonical;
};

// INVALID_ARGUMENT naming `recipe` and the offending token for anything not understood.
absl::StatusOr<ParsedRecipe> ParseRecipeString(absl::string_view recipe);

}  // namespace wpub::engine
