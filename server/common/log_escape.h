// Escaping of client-controlled strings (tensor names, model ids, receiver names, error
// messages that quote them) before they reach a log line, so that a name holding a newline or
// a terminal escape cannot forge or hide log lines.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace wpub::server {

// `text` with every control character, backslash and non-ASCII byte written as a C escape
// (`\n`, `\x1b`, `\\`, `\xff`; absl::CHexEscape); printable ASCII (quotes included) is kept,
// so an ordinary tensor name or error message reads unchanged. Thread-safe (pure function).
std::string LogEscape(absl::string_view text);

}  // namespace wpub::server
