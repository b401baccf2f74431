// Comparison of secrets (bearer tokens, subscription tokens) in time independent of where the
// strings differ, so a secret cannot be guessed byte by byte from response times.
#pragma once

#include <string_view>

namespace wpub {

inline bool SecureEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace wpub
