// Structured fields for log lines: a thread-local stack of key/value pairs that the code doing
// a piece of work pushes for its duration (LogField), and that a log sink may attach to every
// line written on that thread (cli/logging.h's JSON lines: "version", "phase", "engine",
// "bucket", ...). The text format ignores them; messages still say what they are about.
// Thread-safe: each thread sees only its own fields.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace wpub {

// Pushes `key`=`value` for this thread until destruction (a later push of the same key shadows
// it meanwhile). Not movable: scopes nest strictly.
class LogField {
 public:
  LogField(absl::string_view key, std::string value);
  ~LogField();
  LogField(const LogField&) = delete;
  LogField& operator=(const LogField&) = delete;
};

// This thread's fields, innermost last (the same key may appear more than once).
const std::vector<std::pair<std::string, std::string>>& CurrentLogFields();

}  // namespace wpub
