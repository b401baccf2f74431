// Bounds on untrusted JSON text, checked before any parser or serializer touches it. A
// document nested tens of thousands deep overflows the stack of a recursive serializer or
// visitor; one of hundreds of megabytes costs that much memory per copy. Every JSON the daemon
// reads from a client or an engine goes through CheckJsonBounds first. Pure; thread-safe.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace wpub {

struct JsonBounds {
  size_t max_bytes = size_t{4} << 20;  // whole document
  int max_depth = 32;                  // nesting of objects and arrays
};

// Bounds for documents a client sends (policy, quantization config) and engine answers.
inline constexpr JsonBounds kClientJsonBounds{};

// INVALID_ARGUMENT "<what>: ..." when `text` is longer than `bounds.max_bytes` or nests objects
// and arrays deeper than `bounds.max_depth` (brackets inside strings do not count; escapes are
// honoured). Does not validate the JSON otherwise: the parser does that after. O(size), no
// allocation.
absl::Status CheckJsonBounds(absl::string_view text, absl::string_view what,
                             const JsonBounds& bounds = kClientJsonBounds);

}  // namespace wpub
