// ConfigureLogging: spdlog's pattern formatter for text, JsonLinesFormatter for JSON.
#include "cli/logging.h"

#include <grpc/support/log.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/log_context.h"
#include "nlohmann/json.hpp"

namespace wpub::cli {
namespace {

class JsonLinesFormatter final : public spdlog::formatter {
 public:
  explicit JsonLinesFormatter(std::string logger) : logger_(std::move(logger)) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    nlohmann::json j;
    j["ts"] =
        absl::FormatTime("%Y-%m-%dT%H:%M:%E6S%Ez", absl::FromChrono(msg.time), absl::UTCTimeZone());
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    j["level"] = std::string(level.data(), level.size());
    j["logger"] = logger_;
    j["msg"] = std::string(msg.payload.data(), msg.payload.size());
    j["thread"] = msg.thread_id;
    // Innermost wins: a nested scope's value replaces its enclosing one's.
    for (const auto& [key, value] : CurrentLogFields()) j[key] = value;
    const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    dest.append(line.data(), line.data() + line.size());
    dest.push_back('\n');
  }

  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonLinesFormatter>(logger_);
  }

 private:
  const std::string logger_;
};

// gRPC's own log lines (its gpr_log: a listener that cannot bind, TLS handshakes, ...) in the
// binary's format instead of gRPC's "E1204 ..." lines on stderr: one spdlog line each, at the
// matching level, tagged with the field source=grpc and gRPC's file:line.
void GrpcLogToSpdlog(gpr_log_func_args* args) {
  const LogField source("source", "grpc");
  const LogField where("grpc_location",
                       absl::StrCat(args->file != nullptr ? args->file : "?", ":", args->line));
  const char* message = args->message != nullptr ? args->message : "";
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      spdlog::debug("grpc: {}", message);
      break;
    case GPR_LOG_SEVERITY_INFO:
      spdlog::info("grpc: {}", message);
      break;
    default:
      spdlog::error("grpc: {}", message);
      break;
  }
}

}  // namespace

std::unique_ptr<spdlog::formatter> JsonFormatter(absl::string_view logger) {
  return std::make_unique<JsonLinesFormatter>(std::string(logger));
}

absl::Status ConfigureLogging(absl::string_view program, absl::string_view level,
                              absl::string_view format) {
  const spdlog::level::level_enum l = spdlog::level::from_str(std::string(level));
  if (l == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level='", level, "' is not trace, debug, info, warn, error, critical or off"));
  }
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format='", format, "' is not text or json"));
  }
  spdlog::set_level(l);
  if (format == "json") {
    spdlog::set_formatter(JsonFormatter(program));
  } else {
    spdlog::set_pattern(absl::StrCat("%Y-%m-%dT%H:%M:%S.%e%z %^%l%$ [", program, "] %v"),
                        spdlog::pattern_time_type::utc);
  }
  gpr_set_log_function(GrpcLogToSpdlog);  // one log format, gRPC's lines included
  return absl::OkStatus();
}

}  // namespace wpub::cli
