// The log setup of every binary: spdlog's default logger at a level, writing to stdout either
// text lines ("2026-12-02T10:00:01.123+00:00 info [wpubd] message") or JSON lines, one object
// per line: {"ts": RFC 3339 with offset, "level", "logger", "msg", "thread", and this thread's
// structured fields (core/common/log_context.h: "version", "phase", "engine", "bucket", ...)}.
// gRPC's own log lines go through the same logger ("grpc: ..." with the fields source=grpc and
// grpc_location). Call once from main, before other threads log.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace spdlog {
class formatter;
}

namespace wpub::cli {

// `level`: trace, debug, info, warn, error, critical or off; `format`: text or json.
// INVALID_ARGUMENT naming the flag's value otherwise (nothing changed then).
absl::Status ConfigureLogging(absl::string_view program, absl::string_view level,
                              absl::string_view format);

// The JSON-lines formatter (exposed for tests).
std::unique_ptr<spdlog::formatter> JsonFormatter(absl::string_view logger);

}  // namespace wpub::cli
