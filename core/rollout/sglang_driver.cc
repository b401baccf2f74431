// SGLang driver: per-engine ordered request workers over cpp-httplib, JSON bodies.
#include "core/rollout/sglang_driver.h"

#include <httplib.h>

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
#include "core/rollout/update_request.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

struct Request {
  std::string method;  // "GET" | "POST"
  std::string path;
  // Encoded once and shared by every engine's request (a bucket's body lists thousands of
  // tensors).
  std::shared_ptr<const std::string> body;
  // An update request that may overlap with other update requests of this engine (when the
  // driver allows more than one in flight). Every other request waits for the lanes to drain
  // and holds back what follows it.
  bool overlappable = false;
  // A bucket's update request: once it is sent the engine may have loaded some of the bucket.
  bool update = false;
  // Sent even to an engine that failed this publication (resuming one after an abort).
  bool always = false;
};

}  // namespace

// One engine's ordered request queue, served by `lanes` connections (each its own thread), and
// its outcome. With one lane, requests go strictly one after another. With more, consecutive
// overlappable requests are taken from the queue in order and may be in flight together; a
// non-overlappable request starts only once every lane is idle, and nothing behind it starts
// before it is answered.
class SglangDriver::Worker {
 public:
  Worker(std::string url, absl::Duration connect_timeout, absl::Duration request_timeout, int lanes)
      : url_(std::move(url)) {
    outcome_.url = url_;
    const auto us = [](absl::Duration d) { return absl::ToInt64Microseconds(d); };
    for (int i = 0; i < std::max(1, lanes); ++i) {
      auto c = std::make_unique<httplib::Client>(url_);
      c->set_connection_timeout(us(connect_timeout) / 1000000, us(connect_timeout) % 1000000);
      c->set_read_timeout(us(request_timeout) / 1000000, us(request_timeout) % 1000000);
      c->set_write_timeout(us(request_timeout) / 1000000, us(request_timeout) % 1000000);
      c->set_keep_alive(true);
      c->set_tcp_nodelay(true);  // small JSON requests: no Nagle delay per bucket
      clients_.push_back(std::move(c));
    }
    for (size_t i = 0; i < clients_.size(); ++i) {
      threads_.emplace_back([this, i] { Run(*clients_[i]); });
    }
  }
  // Drops queued requests and aborts those in flight, so tearing a driver down never waits
  // out a hung engine's request timeout.
  ~Worker() {
    std::unique_lock lock(mu_);
    stop_ = true;
    queue_.clear();
    cv_.notify_all();
    // Retried: a lane may be between taking a request and opening its socket, where stop()
    // has nothing to shut down yet.
    while (in_flight_ > 0) {
      lock.unlock();
      for (auto& c : clients_) c->stop();
      lock.lock();
      cv_.wait_for(lock, std::chrono::milliseconds(20));
    }
    lock.unlock();
    for (std::thread& t : threads_) t.join();
  }

  void Reset() {
    std::lock_guard lock(mu_);
    outcome_ = EngineOutcome();
    outcome_.url = url_;
  }
  // Forgets requests not yet sent (those of an aborted publication must never reach the engine
  // after it: each would post a receive that no broadcast matches).
  void DropQueued() {
    std::lock_guard lock(mu_);
    queue_.clear();
    cv_.notify_all();
  }
  void Post(Request r) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(r));
    }
    cv_.notify_all();
  }
  // True when every posted request was answered (or skipped) before the deadline.
  bool WaitIdle(absl::Time deadline) {
    std::unique_lock lock(mu_);
    while (!queue_.empty() || in_flight_ > 0) {
      if (cv_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout &&
          (!queue_.empty() || in_flight_ > 0)) {
        return false;
      }
    }
    return true;
  }
  EngineOutcome outcome() const {
    std::lock_guard lock(mu_);
    return outcome_;
  }
  const std::string& url() const { return url_; }

 private:
  // Whether the front request may start now (mu_ held, queue non-empty).
  bool FrontMayStart() const {
    if (exclusive_in_flight_) return false;
    if (in_flight_ == 0) return true;
    return queue_.front().overlappable;
  }

  void Run(httplib::Client& client) {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && FrontMayStart()); });
      if (queue_.empty()) return;  // stop_ and drained
      Request r = std::move(queue_.front());
      queue_.pop_front();
      if (outcome_.failed && !r.always) {
        cv_.notify_all();
        continue;  // an engine that failed gets no further requests of this publication
      }
      // Counted before it is sent, under the lock DropQueued takes: once an abort dropped the
      // queue, updates_sent says exactly which engines may hold bytes of the aborted version.
      if (r.update) ++outcome_.updates_sent;
      ++in_flight_;
      exclusive_in_flight_ = !r.overlappable;
      lock.unlock();
      std::string error = Send(client, r);
      lock.lock();
      --in_flight_;
      if (!r.overlappable) exclusive_in_flight_ = false;
      if (error.empty()) {
        ++outcome_.requests;
      } else if (!outcome_.failed) {
        outcome_.failed = true;
        outcome_.error = std::move(error);
      }
      cv_.notify_all();
    }
  }

  // Empty on success, otherwise a sentence naming the engine and call.
  std::string Send(httplib::Client& client, const Request& r) {
    httplib::Result res =
        r.method == "GET" ? client.Get(r.path) : client.Post(r.path, *r.body, "application/json");
    const std::string what = absl::StrCat("engine ", url_, " ", r.method, " ", r.path);
    if (!res) return absl::StrCat(what, ": ", httplib::to_string(res.error()));
    if (res->status < 200 || res->status >= 300) {
      return absl::StrCat(what, ": HTTP ", res->status, ": ", res->body.substr(0, 300));
    }
    // SGLang answers {"success": bool, "message": str} on the weight-update routes. An answer
    // beyond the bounds is not one (and would cost the daemon its stack or memory to parse).
    if (absl::Status bounded = CheckJsonBounds(res->body, "answer"); !bounded.ok()) {
      return absl::StrCat(what, ": ", bounded.message());
    }
    json j = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
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

  const std::string url_;
  std::vector<std::unique_ptr<httplib::Client>> clients_;  // one per lane
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;         // guarded by mu_
  int in_flight_ = 0;                 // guarded by mu_
  bool exclusive_in_flight_ = false;  // guarded by mu_: a non-overlappable request is out
  bool stop_ = false;                 // guarded by mu_
  EngineOutcome outcome_;             // guarded by mu_
};

namespace {

// GETs `path` on every engine concurrently (one thread each, `timeout` for the connection and
// the answer) and returns the 2xx answers' bodies (nullopt where there was none).
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
      httplib::Result r = c.Get(path);
      if (r && r->status >= 200 && r->status < 300) bodies[i] = std::move(r->body);
    });
  }
  for (auto& t : threads) t.join();
  return bodies;
}

// The "weight_version" of an engine's /get_model_info answer, or 0 (see FetchWeightVersions).
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
    d->workers_.push_back(std::make_unique<Worker>(
        e.url, options.connect_timeout, options.request_timeout, options.requests_in_flight));
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
    w->Post(Request{method, path, shared, /*overlappable=*/false, /*update=*/false});
  }
}

void SglangDriver::StartJoin() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->Reset();
    workers_[i]->Post(
        Request{"POST", options_.endpoints.init_group,
                std::make_shared<const std::string>(InitGroupBody(options_, layout_, i)),
                /*overlappable=*/false});
  }
}

absl::Status SglangDriver::WaitIdle(absl::Time deadline) {
  std::vector<std::string> silent, failed;
  for (auto& w : workers_) {
    if (!w->WaitIdle(deadline)) silent.push_back(w->url());
  }
  for (auto& w : workers_) {
    const EngineOutcome o = w->outcome();
    if (o.failed) failed.push_back(o.error);
  }
  if (!failed.empty()) return absl::AbortedError(absl::StrJoin(failed, "; "));
  if (!silent.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat("engines did not answer in time: ", absl::StrJoin(silent, ", ")));
  }
  return absl::OkStatus();
}

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
    w->Post(Request{"POST", path, body, /*overlappable=*/true, /*update=*/true});
  }
}

void SglangDriver::EndPublication() {
  std::lock_guard lock(post_mu_);
  if (closed_) return;
  closed_ = true;
  if (!lifecycle_calls_) return;
  const SglangEndpoints& e = options_.endpoints;
  PostAll("POST", e.version, json({{"new_version", std::to_string(version_)}}).dump());
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
      workers_[i]->Post(Request{"POST", options_.endpoints.resume,
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

std::vector<EngineOutcome> SglangDriver::outcomes() const {
  std::vector<EngineOutcome> out;
  for (const auto& w : workers_) out.push_back(w->outcome());
  return out;
}

bool SglangDriver::any_failed() const {
  for (const auto& w : workers_) {
    if (w->outcome().failed) return true;
  }
  return false;
}

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
