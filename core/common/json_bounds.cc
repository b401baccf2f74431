// Size and depth bounds of untrusted JSON text (see json_bounds.h).
#include "core/common/json_bounds.h"

#include "absl/strings/str_cat.h"

namespace wpub {

absl::Status CheckJsonBounds(absl::string_view text, absl::string_view what,
                             const JsonBounds& bounds) {
  if (text.size() > bounds.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", text.size(), " bytes of JSON exceed the limit of ", bounds.max_bytes));
  }
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > bounds.max_depth) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": JSON nested deeper than ", bounds.max_depth, " levels (at byte ", i, ")"));
      }
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return absl::OkStatus();
}

}  // namespace wpub
