// Flags that describe a synthetic MoE model (--model_style, --num_layers, ...), shared by the
// subcommands that build one (policy-report, demo, and publish-synthetic later).
#pragma once

#include "absl/status/statusor.h"
#include "core/synthetic/synthetic.h"

namespace wpub::wpubctl {

// The preset of --model_style with every explicitly given dimension flag applied on top.
// Errors name the flag (unknown style or dtype) or the field (invalid shape).
absl::StatusOr<synthetic::ModelShape> ModelShapeFromFlags();

}  // namespace wpub::wpubctl
