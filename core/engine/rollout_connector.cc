// ValidateRolloutConnectRequest (what every ConnectEngines request is checked for first) and
// SplitEngineFamily.
#include "core/engine/rollout_connector.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace wpub::engine {
namespace {

// Why `url` is not http(s)://host[:port], or "" when it is.
std::string UrlProblem(const std::string& url) {
  if (url.empty()) return "the URL is empty";
  for (char c : url) {
    if (c <= ' ' || c == 0x7f) return "the URL holds whitespace or a control character";
  }
  size_t host = 0;
  if (absl::StartsWith(url, "http://")) {
    host = 7;
  } else if (absl::StartsWith(url, "https://")) {
    host = 8;
  } else {
    return "the URL must start with http:// or https://";
  }
  const std::string rest = url.substr(host);
  // The SGLang driver's HTTP client takes scheme://host:port only.
  if (rest.find_first_of("/?#") != std::string::npos) {
    return "the URL must be scheme://host[:port], without a path";
  }
  if (rest.empty() || rest[0] == ':') return "the URL has no host";
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && rest.back() != ']') {
    int port = 0;
    if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return "the URL's port is not in [1, 65535]";
    }
  }
  return "";
}

}  // namespace

absl::Status ValidateRolloutConnectRequest(const RolloutConnectRequest& request) {
  if (request.engines.empty()) return absl::InvalidArgumentError("engines: no engine given");
  std::set<std::string> seen;
  for (size_t i = 0; i < request.engines.size(); ++i) {
    const RolloutEndpoint& e = request.engines[i];
    const std::string entry = absl::StrCat("engines[", i, "] '", e.url, "'");
    if (std::string why = UrlProblem(e.url); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", why));
    }
    if (e.gpus < 1 || e.gpus > 4096) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry, ": gpus is ", e.gpus, "; it must be in [1, 4096]"));
    }
    if (!seen.insert(e.url).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": the URL is given twice"));
    }
    if (!e.family.empty() && !IsEngineFamily(e.family)) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": unknown engine kind '", e.family,
                                                     "' (sglang, vllm, sglang-ipc or vllm-ipc)"));
    }
  }
  if (request.group_name.size() > 100) {
    return absl::InvalidArgumentError("group_name: longer than 100 characters");
  }
  for (char c : request.group_name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("group_name '", request.group_name,
                       "': only letters, digits, '_', '-' and '.' are allowed"));
    }
  }
  if (request.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout ", absl::FormatDuration(request.timeout), " is negative"));
  }
  return absl::OkStatus();
}

bool IsEngineFamily(std::string_view family) {
  for (std::string_view f : kEngineFamilies) {
    if (f == family) return true;
  }
  return false;
}

bool IsColocatedFamily(std::string_view family) {
  return family.size() >= 4 && family.substr(family.size() - 4) == "-ipc";
}

absl::StatusOr<std::pair<std::string, std::string>> SplitEngineFamily(std::string_view url) {
  const size_t plus = url.find('+');
  const size_t scheme = url.find("://");
  if (plus == std::string_view::npos || scheme == std::string_view::npos || plus > scheme) {
    return std::pair<std::string, std::string>{"", std::string(url)};
  }
  const std::string family(url.substr(0, plus));
  if (!IsEngineFamily(family)) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine '", std::string(url), "': unknown engine kind '", family,
                     "+' (vllm+http://, sglang+http://, sglang-ipc+http://, vllm-ipc+http://)"));
  }
  return std::pair<std::string, std::string>{family, std::string(url.substr(plus + 1))};
}

}  // namespace wpub::engine
