// SGLang driver: per-engine ordered request workers over cpp-httplib, JSON bodies.
#include "core/rollout/sglang_driver.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/common/json_bounds.h"
#include "core/rollout/engine_http.h"
#include "core/rollout/update_request.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

// SGLang answers {"success": bool, "message": str} on the weight-update routes.
std::string SglangAnswer(const std::string& what, const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("success") && j["success"].is_boolean() &&
      !j["success"].get<bool>()) {
    // json::value throws on a type mismatch: an engine's "message" may be anything.
    const auto message = j.find("message");
    const std::string text = message != j.end() && message->is_string()
                                 ? message->get<std::string>().substr(0, 300)
                                 : std::string("(no message)");
    return absl::StrCat(what, ": success=false: ", text);
  }
  return "";
}

}  // namespace

std::string InitGroupBody(const SglangDriverOptions& o, const GroupLayout& g, size_t engine) {
  json j = {{"master_address", o.master_address},
            {"master_port", o.master_port},
            {"rank_offset", g.rank_offsets.at(engine)},
            {"world_size", g.world_size},
            {"group_name", g.group_name},
            {"backend", o.endpoints.backend}};
  return j.dump();
}

std::string UpdateBody(const SglangDriverOptions& o, const engine::BucketManifest& bucket,
                       uint64_t version) {
  UpdateRequestFields f;
  f.group_name = o.group_name;
  f.flush_cache = o.flush_cache_on_update;
  f.weight_version = std::to_string(version);
  f.load_format = o.endpoints.load_format;
  // Several requests in flight: the engine must receive them in this order (see the option).
  if (o.requests_in_flight > 1) f.sequence = bucket.index;
  return EncodeUpdateRequest(bucket.tensors, f);
}

absl::StatusOr<std::unique_ptr<SglangDriver>> SglangDriver::Create(
    const SglangDriverOptions& options) {
  absl::StatusOr<GroupLayout> layout = LayoutGroup(options.engines, options.group_name);
  if (!layout.ok()) return layout.status();
  for (const EngineSpec& e : options.engines) {
    if (!absl::StartsWith(e.url, "http://") && !absl::StartsWith(e.url, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine URL '", e.url, "' must start with http:// or https://"));
    }
  }
  if (options.master_port == 0) {
    return absl::InvalidArgumentError("SGLang driver: master_port (the TCPStore port) is 0");
  }
  if (options.endpoints.update.empty() || options.endpoints.init_group.empty()) {
    return absl::InvalidArgumentError(
        "SGLang driver: the init_group and update endpoints may not be empty");
  }
  std::unique_ptr<SglangDriver> d(new SglangDriver(options, *std::move(layout)));
  for (const EngineSpec& e : options.engines) {
    d->workers_.push_back(std::make_unique<EngineRequestQueue>(
        e.url, options.connect_timeout, options.request_timeout, options.requests_in_flight,
        SglangAnswer, e.auth_token));
  }
  return d;
}

SglangDriver::SglangDriver(SglangDriverOptions options, GroupLayout layout)
    : options_(std::move(options)), layout_(std::move(layout)) {}
SglangDriver::~SglangDriver() = default;

void SglangDriver::PostAll(const std::string& method, const std::string& path,
                           const std::string& body) {
  if (path.empty()) return;
  auto shared = std::make_shared<const std::string>(body);
  for (auto& w : workers_) {
    w->Post(EngineRequest{method, path, shared, /*overlappable=*/false, /*update=*/false});
  }
}

void SglangDriver::StartJoin() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->Reset();
    workers_[i]->Post(
        EngineRequest{"POST", options_.endpoints.init_group,
                      std::make_shared<const std::string>(InitGroupBody(options_, layout_, i)),
                      /*overlappable=*/false});
  }
}

absl::Status SglangDriver::WaitIdle(absl::Time deadline) { return WaitAllIdle(workers_, deadline); }

void SglangDriver::BeginPublication(uint64_t version, bool lifecycle_calls) {
  std::lock_guard lock(post_mu_);
  version_ = version;
  closed_ = false;
  lifecycle_calls_ = lifecycle_calls;
  for (auto& w : workers_) w->Reset();
  if (!lifecycle_calls) return;
  const SglangEndpoints& e = options_.endpoints;
  PostAll("POST", e.pause, json({{"mode", e.pause_mode}}).dump());
  PostAll("GET", e.flush, "");
  PostAll("POST", e.begin, "{}");
}

void SglangDriver::PostBucket(const engine::BucketManifest& bucket) {
  const std::string& path = options_.endpoints.update;
  if (path.empty()) return;
  std::lock_guard lock(post_mu_);
  if (closed_) return;  // aborted: no engine may receive more of this version
  // Encoded here, once for every engine: a 3,300-tensor body takes ~0.3 ms
  // (bench/rollout/update_request_bench), less than copying the manifest for another thread.
  auto body = std::make_shared<const std::string>(UpdateBody(options_, bucket, version_));
  for (auto& w : workers_) {
    w->Post(EngineRequest{"POST", path, body, /*overlappable=*/true, /*update=*/true});
  }
}

void SglangDriver::EndPublication() {
  std::lock_guard lock(post_mu_);
  if (closed_) return;
  closed_ = true;
  if (!lifecycle_calls_) return;
  const SglangEndpoints& e = options_.endpoints;
  // SGLang's UpdateWeightVersionReqInput defaults abort_all_requests to true (io_struct.py):
  // left out, every publication would abort every in-flight rollout request, the ones the
  // pause kept included.
  PostAll("POST", e.version,
          json({{"new_version", std::to_string(version_)}, {"abort_all_requests", false}}).dump());
  PostAll("POST", e.end, "{}");
  PostAll("POST", e.resume, "{}");
}

std::vector<bool> SglangDriver::ResumeAfterAbort(const std::set<std::string>& still_dirty) {
  std::lock_guard lock(post_mu_);
  std::vector<bool> dirty(workers_.size(), false);
  for (size_t i = 0; i < workers_.size(); ++i) dirty[i] = still_dirty.count(workers_[i]->url()) > 0;
  if (closed_) return dirty;  // already ended (committed, or resumed by an earlier call)
  closed_ = true;
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->DropQueued();
    // After the drop no further update can start, so this is final for the publication.
    dirty[i] = dirty[i] || workers_[i]->outcome().updates_sent > 0;
    if (!dirty[i] && lifecycle_calls_ && !options_.endpoints.resume.empty()) {
      workers_[i]->Post(EngineRequest{"POST", options_.endpoints.resume,
                                      std::make_shared<const std::string>("{}"),
                                      /*overlappable=*/false, /*update=*/false, /*always=*/true});
    }
  }
  return dirty;
}

void SglangDriver::Leave() {
  std::lock_guard lock(post_mu_);
  closed_ = true;
  for (auto& w : workers_) {
    w->DropQueued();
    w->Reset();
  }
  PostAll("POST", options_.endpoints.destroy_group,
          json({{"group_name", layout_.group_name}}).dump());
}

std::vector<EngineOutcome> SglangDriver::outcomes() const { return OutcomesOf(workers_); }

bool SglangDriver::any_failed() const { return AnyFailed(workers_); }

std::vector<bool> SglangFamily::Probe(const std::vector<EngineSpec>& engines,
                                      absl::Duration timeout) const {
  if (options_.health_endpoint.empty()) return std::vector<bool>(engines.size(), true);
  return ProbeEngines(engines, options_.health_endpoint, timeout);
}

std::vector<uint64_t> SglangFamily::WeightVersions(const std::vector<EngineSpec>& engines,
                                                   absl::Duration timeout) const {
  if (options_.model_info_endpoint.empty()) return std::vector<uint64_t>(engines.size(), 0);
  return FetchWeightVersions(engines, options_.model_info_endpoint, timeout);
}

absl::StatusOr<std::unique_ptr<EngineDriver>> SglangFamily::CreateDriver(
    const GroupAddress& address) const {
  SglangDriverOptions d = options_.driver;
  d.engines = address.engines;
  d.master_address = address.master_address;
  d.master_port = address.master_port;
  d.group_name = address.group_name;
  absl::StatusOr<std::unique_ptr<SglangDriver>> driver = SglangDriver::Create(d);
  if (!driver.ok()) return driver.status();
  return std::unique_ptr<EngineDriver>(*std::move(driver));
}

}  // namespace wpub::rollout
