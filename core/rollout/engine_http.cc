// Engine HTTP requests (engine_http.h).
#include "core/rollout/engine_http.h"

#include <httplib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/json_bounds.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

// The "weight_version" of an engine's version answer, or 0 (see FetchWeightVersions).
uint64_t WeightVersionOf(const std::string& body) {
  if (!CheckJsonBounds(body, "answer").ok()) return 0;
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return 0;
  auto it = j.find("weight_version");
  if (it == j.end()) return 0;
  uint64_t v = 0;
  if (it->is_string() && absl::SimpleAtoi(it->get<std::string>(), &v)) return v;
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  return 0;
}

}  // namespace

std::vector<std::optional<std::string>> GetAll(const std::vector<EngineSpec>& engines,
                                               const std::string& path, absl::Duration timeout) {
  std::vector<std::optional<std::string>> bodies(engines.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < engines.size(); ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c(engines[i].url);
      const int64_t us = absl::ToInt64Microseconds(timeout);
      c.set_connection_timeout(us / 1000000, us % 1000000);
      c.set_read_timeout(us / 1000000, us % 1000000);
      if (!engines[i].auth_token.empty()) c.set_bearer_token_auth(engines[i].auth_token);
      httplib::Result r = c.Get(path);
      if (r && r->status >= 200 && r->status < 300) bodies[i] = std::move(r->body);
    });
  }
  for (auto& t : threads) t.join();
  return bodies;
}

std::vector<RouteAnswer> ProbeRoutes(const EngineSpec& engine,
                                     const std::vector<std::string>& paths,
                                     absl::Duration timeout) {
  std::vector<RouteAnswer> out(paths.size());
  httplib::Client c(engine.url);
  const auto us = [](absl::Duration d) {
    return std::max<int64_t>(1, absl::ToInt64Microseconds(d));
  };
  c.set_connection_timeout(us(timeout) / 1000000, us(timeout) % 1000000);
  c.set_keep_alive(true);
  if (!engine.auth_token.empty()) c.set_bearer_token_auth(engine.auth_token);
  // One budget for the whole probe: an engine that answers slowly cannot hold a join for
  // `timeout` per route.
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t i = 0; i < paths.size(); ++i) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      for (size_t k = i; k < paths.size(); ++k) {
        out[k].error = absl::StrCat("the probe took longer than ", absl::FormatDuration(timeout));
      }
      break;
    }
    c.set_read_timeout(us(left) / 1000000, us(left) % 1000000);
    httplib::Result r = c.Get(paths[i]);
    if (!r) {
      for (size_t k = i; k < paths.size(); ++k) out[k].error = httplib::to_string(r.error());
      break;
    }
    out[i].status = r->status;
    if (CheckJsonBounds(r->body, "answer").ok()) out[i].body = std::move(r->body);
  }
  return out;
}

std::optional<absl::Status> ProbeRefusal(const std::string& what, const RouteAnswer& answer) {
  if (answer.status == 0) {
    return absl::UnavailableError(absl::StrCat(what, ": no answer (", answer.error, ")"));
  }
  if (answer.status == 401 || answer.status == 403) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": HTTP ", answer.status, " ", answer.body.substr(0, 200),
        ": the engine requires an API key -- start wpubd with --engine_api_key_file naming the "
        "key the engine was started with (SGLang's --admin-api-key when it has one, else its "
        "--api-key)"));
  }
  return std::nullopt;
}

absl::Status WaitAllIdle(const EngineQueues& queues, absl::Time deadline) {
  std::vector<std::string> silent, failed;
  for (const auto& q : queues) {
    if (!q->WaitIdle(deadline)) silent.push_back(q->url());
  }
  for (const auto& q : queues) {
    const EngineOutcome o = q->outcome();
    if (o.failed) failed.push_back(o.error);
  }
  if (!failed.empty()) return absl::AbortedError(absl::StrJoin(failed, "; "));
  if (!silent.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat("engines did not answer in time: ", absl::StrJoin(silent, ", ")));
  }
  return absl::OkStatus();
}

std::vector<EngineOutcome> OutcomesOf(const EngineQueues& queues) {
  std::vector<EngineOutcome> out;
  for (const auto& q : queues) out.push_back(q->outcome());
  return out;
}

bool AnyFailed(const EngineQueues& queues) {
  for (const auto& q : queues) {
    if (q->outcome().failed) return true;
  }
  return false;
}

std::vector<bool> ProbeEngines(const std::vector<EngineSpec>& engines, const std::string& path,
                               absl::Duration timeout) {
  std::vector<bool> alive;
  for (const auto& body : GetAll(engines, path, timeout)) alive.push_back(body.has_value());
  return alive;
}

std::vector<uint64_t> FetchWeightVersions(const std::vector<EngineSpec>& engines,
                                          const std::string& path, absl::Duration timeout) {
  std::vector<uint64_t> versions;
  for (const auto& body : GetAll(engines, path, timeout)) {
    versions.push_back(body ? WeightVersionOf(*body) : 0);
  }
  return versions;
}

}  // namespace wpub::rollout
