// Secrets read from files named by flags (--auth_token_file, --engine_api_key_file): the file's
// content with surrounding whitespace stripped. Shared by wpubd, wpubctl and wpub-recv.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wpub::cli {

// INVALID_ARGUMENT "<flag> '<path>' cannot be read" or "... is empty"; the secret itself is
// never in a message.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view flag);

}  // namespace wpub::cli
