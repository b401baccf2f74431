// Flags that make a publication's policy settings (--recipe, --quantization_config,
// --policy_settings, the precision exceptions), shared by the subcommands that plan a model.
#pragma once

#include "absl/status/statusor.h"
#include "core/policy/settings.h"
#include "core/synthetic/synthetic.h"

namespace wpub::wpubctl {

// Settings from --policy_settings (a whole settings JSON file), or else from --recipe,
// --quantization_config (any document ParsePolicySettings/engines accept; default: NVFP4 with
// synthetic::HighPrecisionModules(model)) and the exception flags; first/last BF16 layers count
// against the model's decoder layers. Mixing --policy_settings with the other policy flags is an
// error.
absl::StatusOr<policy::PolicySettings> PolicySettingsFromFlags(
    const synthetic::SyntheticModel& model);

}  // namespace wpub::wpubctl
