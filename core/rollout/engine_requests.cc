// Engine HTTP requests (engine_requests.h).
#include "core/rollout/engine_requests.h"

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
  if (it->is_number_unsigned()) {
    v = it->get<uint64_t>();
  } else if (!it->is_string() || !absl::SimpleAtoi(it->get<std::string>(), &v)) {
    return 0;
  }
  // Beyond any version a publication may have: not one wpub set, and believed it would hold
  // every later publication back.
  return v <= kMaxEngineVersion ? v : 0;
}

}  // namespace

BoundedAnswer SendBounded(httplib::Client& client, const std::string& method,
                          const std::string& path, const std::string* body, absl::Time deadline,
                          size_t max_bytes) {
  BoundedAnswer out;
  std::string cut;  // which bound cut the answer
  httplib::Request req;
  req.method = method;
  req.path = path;
  if (body != nullptr) {
    req.body = *body;
    req.set_header("Content-Type", "application/json");
  }
  req.response_handler = [&](const httplib::Response& r) {
    if (r.has_header("Content-Length")) {
      const std::string n = r.get_header_value("Content-Length");
      uint64_t declared = 0;
      if (absl::SimpleAtoi(n, &declared) && declared > max_bytes) {
        cut = absl::StrCat("an answer of ", declared, " bytes (at most ", max_bytes, " read)");
        return false;
      }
    }
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (out.body.size() + n > max_bytes) {
      cut = absl::StrCat("an answer of more than ", max_bytes, " bytes");
      return false;
    }
    if (absl::Now() > deadline) {
      cut = "an answer still arriving at the request's deadline";
      return false;
    }
    out.body.append(data, n);
    return true;
  };
  httplib::Result res = client.send(req);
  // The client's read timeout is the time left to `deadline`; a poll may wake a little early.
  out.timed_out = !res && absl::Now() + absl::Milliseconds(5) >= deadline;
  if (!cut.empty()) {
    out.body.clear();
    out.error = cut;
    return out;
  }
  if (!res) {
    out.body.clear();
    out.error = httplib::to_string(res.error());
    return out;
  }
  out.status = res->status;
  return out;
}

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
      BoundedAnswer r = SendBounded(c, "GET", path, nullptr, absl::Now() + timeout);
      if (r.status >= 200 && r.status < 300) bodies[i] = std::move(r.body);
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
        out[k].timed_out = true;
      }
      break;
    }
    c.set_read_timeout(us(left) / 1000000, us(left) % 1000000);
    BoundedAnswer r = SendBounded(c, "GET", paths[i], nullptr, deadline);
    if (r.status == 0) {
      for (size_t k = i; k < paths.size(); ++k) {
        out[k].error = r.error;
        out[k].timed_out = r.timed_out;
      }
      break;
    }
    out[i].status = r.status;
    if (CheckJsonBounds(r.body, "answer").ok()) out[i].body = std::move(r.body);
  }
  return out;
}

std::vector<absl::StatusOr<EngineProfile>> ProfileEngines(
    const std::vector<EngineSpec>& engines, const std::vector<std::string>& paths,
    absl::Duration timeout,
    const std::function<absl::StatusOr<EngineProfile>(const EngineSpec&,
                                                      const std::vector<RouteAnswer>&)>& read) {
  std::vector<absl::StatusOr<EngineProfile>> out(engines.size(), EngineProfile{});
  std::vector<std::thread> threads;
  for (size_t i = 0; i < engines.size(); ++i) {
    threads.emplace_back(
        [&, i] { out[i] = read(engines[i], ProbeRoutes(engines[i], paths, timeout)); });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

bool ReadServerInfo(const RouteAnswer& answer, EngineProfile* profile) {
  if (answer.status < 200 || answer.status >= 300) return false;
  json j = json::parse(answer.body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  if (auto v = j.find("version"); v != j.end() && v->is_string()) {
    profile->release = v->get<std::string>().substr(0, 64);
  }
  if (auto b = j.find("wpub_bucket_versions"); b != j.end() && b->is_boolean()) {
    profile->bucket_versions = b->get<bool>();
  }
  if (auto b = j.find("wpub_bucket_patches"); b != j.end() && b->is_array()) {
    for (const json& f : *b) profile->bucket_patches |= f.is_number_unsigned() && f == 3;
  }
  return true;
}

std::optional<absl::Status> ProbeRefusal(const std::string& what, const RouteAnswer& answer) {
  if (answer.status == 0 && answer.timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no answer within the join's time (", answer.error, ")"));
  }
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

std::shared_ptr<ResumeBarrier> PostResumesTogether(const EngineQueues& queues,
                                                   const std::vector<size_t>& engines,
                                                   const std::string& method,
                                                   const std::string& path,
                                                   const std::string& body) {
  auto barrier = std::make_shared<ResumeBarrier>(engines.size());
  auto shared = std::make_shared<const std::string>(body);
  for (size_t i : engines) {
    EngineRequest r{method, path, shared, /*overlappable=*/false, /*update=*/false};
    r.resumes = true;
    r.seat = std::make_shared<ResumeSeat>(barrier);
    queues[i]->Post(std::move(r));
  }
  return barrier;
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
