// FakeSglang (fake_sglang.h): SGLang's weight-update routes per release, from its source.
#include "tests/rollout/fake_sglang.h"

#include <algorithm>

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout::testing {
namespace {

using json = nlohmann::json;

// The routes each release serves for POST (http_server.py at the commits in the header).
const std::set<std::string>& PostRoutes(SglangRelease r) {
  static const std::set<std::string> kBefore = {"/init_weights_update_group",
                                                "/update_weights_from_distributed",
                                                "/destroy_weights_update_group",
                                                "/pause_generation",
                                                "/continue_generation",
                                                "/update_weight_version",
                                                "/flush_cache"};
  static const std::set<std::string> kSession = [] {
    std::set<std::string> s = kBefore;
    s.insert("/begin_weight_update");
    s.insert("/end_weight_update");
    return s;
  }();
  return r == SglangRelease::kV0_5_5 || r == SglangRelease::kV0_5_6 ? kBefore : kSession;
}

const char* ReleaseName(SglangRelease r) {
  switch (r) {
    case SglangRelease::kV0_5_5:
      return "0.5.5.post3";
    case SglangRelease::kV0_5_6:
      return "0.5.6";
    case SglangRelease::kV0_5_16:
      return "0.5.16";
    case SglangRelease::kSessionRefusing:
      return "0.5.19";
  }
  return "";
}

// {"success": ok, "message": m}: 200, or 400 when !ok (every weight route's ORJSONResponse).
void Answer(httplib::Response& r, bool ok, const std::string& message) {
  r.status = ok ? 200 : 400;
  r.set_content(json{{"success", ok}, {"message", message}}.dump(), "application/json");
}

}  // namespace

FakeSglang::FakeSglang(FakeSglangOptions options) : options_(std::move(options)) {
  auto handler = [this](const char* method) {
    return [this, method](const httplib::Request& q, httplib::Response& r) {
      Serve(method, q.path, q, r);
    };
  };
  http_.server().Get(R"(/.*)", handler("GET"));
  http_.server().Post(R"(/.*)", handler("POST"));
  http_.Start();
}

FakeSglang::~FakeSglang() { http_.Stop(); }

std::string FakeSglang::url() const { return http_.url(); }

std::string FakeSglang::Name(size_t i) { return absl::StrCat("model.layers.", i, ".mlp.weight"); }

void FakeSglang::SetIncoming(const std::string& version) {
  std::lock_guard lock(mu_);
  incoming_ = version;
}

void FakeSglang::SetModel(size_t tensors, const std::string& version) {
  std::lock_guard lock(mu_);
  model_size_ = tensors;
  for (size_t i = 0; i < tensors; ++i) weights_[Name(i)] = version;
}

void FakeSglang::FailNextUpdate() { FailUpdateAt(0); }

void FakeSglang::FailUpdateAt(int k) {
  std::lock_guard lock(mu_);
  fail_in_ = k;
}

void FakeSglang::ClearFailure() {
  std::lock_guard lock(mu_);
  fail_in_ = -1;
}

void FakeSglang::Kill() {
  std::lock_guard lock(mu_);
  dead_ = true;
  if (death_.empty()) death_ = "killed";
}

void FakeSglang::Restart() {
  std::lock_guard lock(mu_);
  dead_ = false;
  death_.clear();
  session_open_ = false;
  serving_ = true;
  fail_in_ = -1;
  waiting_ = 0;
  for (auto& [name, version] : weights_) version = "0";  // its start-up checkpoint
  weight_version_.clear();                               // reported as SGLang's "default"
}

void FakeSglang::SetAbortLag(int n) {
  std::lock_guard lock(mu_);
  abort_lag_ = n;
}

std::string FakeSglang::last_pause_mode() const {
  std::lock_guard lock(mu_);
  return last_pause_mode_;
}

void FakeSglang::SetWaitingRequests(int n) {
  std::lock_guard lock(mu_);
  waiting_ = n;
}

bool FakeSglang::serving() const {
  std::lock_guard lock(mu_);
  return serving_ && !dead_;
}

bool FakeSglang::dead() const {
  std::lock_guard lock(mu_);
  return dead_;
}

std::string FakeSglang::death() const {
  std::lock_guard lock(mu_);
  return death_;
}

bool FakeSglang::session_open() const {
  std::lock_guard lock(mu_);
  return session_open_;
}

std::string FakeSglang::held_version() const {
  std::lock_guard lock(mu_);
  std::set<std::string> versions;
  for (const auto& [name, v] : weights_) versions.insert(v);
  return versions.size() == 1 && (model_size_ == 0 || weights_.size() == model_size_)
             ? *versions.begin()
             : "";
}

std::string FakeSglang::reported_version() const {
  std::lock_guard lock(mu_);
  return weight_version_;
}

int FakeSglang::mixed_resumes() const {
  std::lock_guard lock(mu_);
  return mixed_resumes_;
}

int FakeSglang::requests_aborted_by_version() const {
  std::lock_guard lock(mu_);
  return aborted_by_version_;
}

std::vector<std::string> FakeSglang::calls() const {
  std::lock_guard lock(mu_);
  return calls_;
}

std::vector<std::string> FakeSglang::load_formats() const {
  std::lock_guard lock(mu_);
  return load_formats_;
}

bool FakeSglang::Has(const std::string& path) const {
  return PostRoutes(options_.release).count(path) > 0;
}

void FakeSglang::Die(httplib::Response& r, const std::string& why) {
  // The scheduler logs "Scheduler hit an exception" and SIGQUITs the server's process tree:
  // the caller's connection closes without an answer, every later one is refused.
  dead_ = true;
  if (death_.empty()) death_ = why;
  r.set_content_provider(1024, "application/json", [](size_t, size_t, httplib::DataSink&) {
    return false;
  });  // headers, then a cut
}

bool FakeSglang::Authorized(const httplib::Request& q, bool weight_route) const {
  // utils/auth.py: /health* and /metrics* are exempt; with both keys the weight routes
  // (ADMIN_OPTIONAL) take only the admin key; otherwise the one key configured.
  if (absl::StartsWith(q.path, "/health") || absl::StartsWith(q.path, "/metrics")) return true;
  const std::string& need =
      weight_route && !options_.admin_api_key.empty() ? options_.admin_api_key : options_.api_key;
  if (need.empty()) return true;
  return q.get_header_value("Authorization") == "Bearer " + need;
}

void FakeSglang::SetDelay(std::chrono::milliseconds delay, const std::string& prefix) {
  std::lock_guard lock(mu_);
  delay_prefix_ = prefix;
  delay_ms_ = delay.count();
}

void FakeSglang::Serve(const std::string& method, const std::string& path,
                       const httplib::Request& q, httplib::Response& r) {
  if (const int64_t ms = delay_ms_.load(); ms > 0) {
    bool delayed;
    {
      std::lock_guard lock(mu_);
      delayed = absl::StartsWith(path, delay_prefix_);
    }
    if (delayed) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
  std::lock_guard lock(mu_);
  if (dead_) return Die(r, death_);
  const bool weight_route = Has(path);
  if (!Authorized(q, weight_route)) {
    r.status = 401;
    r.set_content(R"({"error":"Unauthorized"})", "application/json");
    return;
  }
  calls_.push_back(absl::StrCat(method, " ", path));
  json body = json::parse(q.body.empty() ? "{}" : q.body, nullptr, /*allow_exceptions=*/false);
  if (path == "/health") return;  // 200, empty
  if (path == "/get_model_info" || path == "/model_info") {
    json j = {{"model_path", "fake"}, {"is_generation", true}};
    j["weight_version"] = weight_version_.empty() ? json("default") : json(weight_version_);
    r.set_content(j.dump(), "application/json");
    return;
  }
  const bool session_release = options_.release == SglangRelease::kV0_5_16 ||
                               options_.release == SglangRelease::kSessionRefusing;
  if (path == "/get_server_info" || (path == "/server_info" && session_release)) {
    r.set_content(json{{"version", ReleaseName(options_.release)}}.dump(), "application/json");
    return;
  }
  if (path == "/flush_cache") {  // GET or POST
    if (waiting_ > 0) {
      r.status = 400;
      r.set_content("Flush cache failed.\n", "text/plain");
    } else {
      r.set_content("Cache flushed.\n", "text/plain");
    }
    return;
  }
  if (!weight_route) {
    r.status = 404;
    r.set_content(R"({"detail":"Not Found"})", "application/json");
    return;
  }
  if (method != "POST") {
    r.status = 405;
    r.set_header("Allow", "POST");
    r.set_content(R"({"detail":"Method Not Allowed"})", "application/json");
    return;
  }
  // Session misuse: an assertion in the scheduler (kV0_5_16) or a refusal (later).
  const auto misuse = [&](const std::string& why) {
    if (options_.release == SglangRelease::kV0_5_16) return Die(r, why);
    Answer(r, false, why);
  };
  if (path == "/init_weights_update_group" || path == "/destroy_weights_update_group") {
    return Answer(r, true, "Succeeded.");
  }
  if (path == "/pause_generation") {
    serving_ = false;
    // PauseGenerationReqInput.mode defaults to "abort" (io_struct.py at 001067ff): the tokenizer
    // manager aborts every request (all leave the scheduler, but those still in the abort's way:
    // SetAbortLag); "retract" re-queues the running ones, "in_place" keeps them running
    // (scheduler.py at 0003215c). New requests wait in the tokenizer manager either way.
    last_pause_mode_ = body.is_object() ? body.value("mode", std::string("abort")) : "abort";
    if (last_pause_mode_ == "abort") waiting_ = std::min(waiting_, abort_lag_);
    r.set_content(R"({"message":"Generation paused successfully.","status":"ok"})",
                  "application/json");
    return;
  }
  if (path == "/continue_generation") {
    serving_ = true;
    std::set<std::string> versions;
    for (const auto& [name, v] : weights_) versions.insert(v);
    if (versions.size() > 1 || (model_size_ != 0 && weights_.size() != model_size_)) {
      ++mixed_resumes_;
    }
    r.set_content(R"({"message":"Generation continued successfully.","status":"ok"})",
                  "application/json");
    return;
  }
  if (path == "/begin_weight_update") {
    if (session_open_) {
      return misuse("begin_weight_update called while a weight-update session is already open");
    }
    session_open_ = true;
    return Answer(r, true, "Success");
  }
  if (path == "/end_weight_update") {
    if (!session_open_) return misuse("end_weight_update called without begin_weight_update");
    session_open_ = false;
    return Answer(r, true, "Success");
  }
  if (path == "/update_weight_version") {
    if (!body.is_object() || !body.contains("new_version") || !body["new_version"].is_string()) {
      r.status = 400;
      r.set_content(R"({"object":"error","message":"new_version is required","code":400})",
                    "application/json");
      return;
    }
    if (body.value("abort_all_requests", true)) {
      ++aborted_by_version_;
      waiting_ = 0;
    }
    weight_version_ = body["new_version"].get<std::string>();
    return Answer(r, true, "Weight version updated to " + weight_version_);
  }
  // /update_weights_from_distributed
  if (session_release && !session_open_) {
    return misuse("update_weights_from_distributed requires an open begin_weight_update session");
  }
  if (!body.is_object() || !body.contains("names") || !body["names"].is_array()) {
    r.status = 400;
    r.set_content(R"({"object":"error","message":"names is required","code":400})",
                  "application/json");
    return;
  }
  const std::string format = body.value("load_format", std::string());
  load_formats_.push_back(format);
  if (format == "flattened_bucket" && options_.release == SglangRelease::kV0_5_5) {
    // A release before the flattened bucket of mixed dtypes cannot decode it.
    return Answer(r, false,
                  "Failed to update parameter online: unsupported load_format. The full weights "
                  "of the ModelRunner are partially updated. Please discard the whole weights.");
  }
  std::vector<std::string> names;
  for (const json& n : body["names"]) names.push_back(n.is_string() ? n.get<std::string>() : "");
  // Loaded on receipt; a failure may come after part of the bucket was loaded.
  const bool fail = fail_in_ == 0;
  if (fail_in_ >= 0) --fail_in_;
  const size_t loaded = fail ? names.size() / 2 : names.size();
  for (size_t i = 0; i < loaded; ++i) weights_[names[i]] = incoming_;
  if (fail) {
    return Answer(r, false,
                  "Failed to update parameter online: injected. The full weights of the "
                  "ModelRunner are partially updated. Please discard the whole weights.");
  }
  std::string message = "Succeeded to update parameter online.";
  if (auto v = body.find("weight_version"); v != body.end() && v->is_string()) {
    weight_version_ = v->get<std::string>();  // adopted per bucket
    absl::StrAppend(&message, " Weight version updated to ", weight_version_, ".");
  }
  Answer(r, true, message);
}

std::vector<bool> PublishThrough(EngineDriver& driver, const std::vector<FakeSglang*>& engines,
                                 uint64_t version, int sent, bool commit,
                                 const std::function<transport::BucketManifest(int)>& bucket,
                                 std::set<std::string>& dirty_urls) {
  const auto settle = [&] { (void)driver.WaitIdle(absl::Now() + absl::Seconds(10)); };
  for (FakeSglang* e : engines) e->SetIncoming(std::to_string(version));
  driver.BeginPublication(version, /*lifecycle_calls=*/true);
  for (int b = 0; b < sent; ++b) driver.PostBucket(bucket(b));
  settle();
  if (commit && !driver.any_failed()) {
    driver.EndPublication();
    settle();
    dirty_urls.clear();
    return {};
  }
  std::vector<bool> dirty = driver.ResumeAfterAbort(dirty_urls);
  settle();
  for (size_t i = 0; i < dirty.size() && i < engines.size(); ++i) {
    if (dirty[i]) dirty_urls.insert(engines[i]->url());
  }
  return dirty;
}

}  // namespace wpub::rollout::testing
