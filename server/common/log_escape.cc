// LogEscape: absl's C escaping for the bytes that could break a log line, one place for every
// server log line.
#include "server/common/log_escape.h"

#include "absl/strings/escaping.h"

namespace wpub::server {

std::string LogEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += absl::CHexEscape(text.substr(i, 1));
    }
  }
  return out;
}

}  // namespace wpub::server
