// Reading a process's memory figures from /proc/<pid>/status for the resource tests.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace wpub::testing {

// The `field` ("VmRSS", "VmHWM": peak RSS) of process `pid` in bytes; -1 when unreadable.
inline int64_t ProcStatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    if (!absl::ConsumePrefix(&v, field + ":")) continue;
    v = absl::StripAsciiWhitespace(v);
    if (!absl::ConsumeSuffix(&v, " kB")) return -1;
    int64_t kb = 0;
    return absl::SimpleAtoi(v, &kb) ? kb * 1024 : -1;
  }
  return -1;
}

}  // namespace wpub::testing
