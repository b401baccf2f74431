#include "cli/secret_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace wpub::cli {

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " '", path, "' cannot be read"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string secret(absl::StripAsciiWhitespace(ss.str()));
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " '", path, "' is empty"));
  }
  return secret;
}

}  // namespace wpub::cli
