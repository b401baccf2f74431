// The HTTP side of the rollout tests' engine fakes.
//
// LocalHttpServer: an httplib server on 127.0.0.1 at a port of its own. Routes are registered on
// server(); Start binds and serves on a thread of its own and returns once connections are
// accepted; the destructor stops it. Every fake engine of these tests is one (FakeSglang, the
// scripted engine below, the hostile and vLLM fakes of the driver tests).
//
// ScriptedEngine: for the drivers' mechanics -- request order per engine, bodies, concurrency,
// timeouts, refusals -- rather than a release's behaviour (fake_sglang.h models those). Every GET
// and POST answers SGLang's success body {"success": true, "message": "ok"} (http_server.py:
// the weight routes answer 200 with success and message); scripted failures answer as SGLang
// does: success=false with HTTP 400 (http_server.py at 00a2ca2e56d59f0a19186d7a8a58bdda5201023f,
// `status_code=200 if success else HTTPStatus.BAD_REQUEST`), an unhandled exception with
// Starlette's 500 "Internal Server Error" text/plain, a missing API key with 401
// {"error": "Unauthorized"} (utils/auth.py at 0ce3659c2b55b6fb88c7b8ddf7401c61f8762c90).
#pragma once

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace wpub::rollout::testing {

class LocalHttpServer {
 public:
  LocalHttpServer() = default;
  ~LocalHttpServer() { Stop(); }
  LocalHttpServer(const LocalHttpServer&) = delete;
  LocalHttpServer& operator=(const LocalHttpServer&) = delete;

  httplib::Server& server() { return server_; }
  // Binds an ephemeral port of 127.0.0.1 and serves the routes registered so far.
  void Start() {
    server_.set_tcp_nodelay(true);
    port_ = server_.bind_to_any_port("127.0.0.1");
    if (port_ <= 0) throw std::runtime_error("LocalHttpServer: cannot bind a port of 127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Idempotent; answers in progress end first.
  void Stop() {
    if (!thread_.joinable()) return;
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
};

class ScriptedEngine {
 public:
  ScriptedEngine() {
    auto handle = [this](const httplib::Request& req, httplib::Response& res) { Answer(req, res); };
    http_.server().Post(R"(/.*)", handle);
    http_.server().Get(R"(/.*)", handle);
    http_.Start();
  }
  std::string url() const { return http_.url(); }

  // Every request must carry "Authorization: Bearer <key>", else 401.
  void RequireApiKey(std::string key) {
    std::lock_guard lock(mu_);
    api_key_ = std::move(key);
  }
  // The `nth` request (1-based; 0: every one) to `path` fails with an unhandled exception
  // (HTTP 500).
  void FailOn(const std::string& path, int nth) {
    std::lock_guard lock(mu_);
    fail_path_ = path;
    fail_on_nth_ = nth;
    fail_count_ = 0;
  }
  // Every request to `path` answers success=false, with HTTP 400 as SGLang's weight routes do
  // (or `status`: a driver must read the body's verdict even under a 200).
  void SoftFailOn(const std::string& path, int status = 400) {
    std::lock_guard lock(mu_);
    soft_fail_path_ = path;
    soft_fail_status_ = status;
  }
  // Every request to `path` ("POST" ones only when `post_only`) answers `ms` late.
  void SlowOn(const std::string& path, int ms, bool post_only = false) {
    std::lock_guard lock(mu_);
    slow_path_ = path;
    slow_ms_ = ms;
    slow_post_only_ = post_only;
  }

  // The path of every request, in arrival order, and their bodies.
  std::vector<std::string> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  std::vector<std::string> bodies() const {
    std::lock_guard lock(mu_);
    return bodies_;
  }
  // When each request arrived (steady clock), in the order of calls().
  std::vector<std::chrono::steady_clock::time_point> arrivals() const {
    std::lock_guard lock(mu_);
    return arrivals_;
  }
  bool Called(const std::string& path) const {
    std::lock_guard lock(mu_);
    return std::find(calls_.begin(), calls_.end(), path) != calls_.end();
  }
  // The most requests answered at once, and whether a lifecycle call (anything but a bucket's
  // update) ever overlapped another request.
  int max_active() const {
    std::lock_guard lock(mu_);
    return max_active_;
  }
  bool lifecycle_overlapped() const {
    std::lock_guard lock(mu_);
    return lifecycle_overlapped_;
  }

 private:
  void Answer(const httplib::Request& req, httplib::Response& res) {
    int delay_ms = 0;
    bool fail = false, soft_fail = false;
    int soft_fail_status = 400;
    const bool update = req.path == "/update_weights_from_distributed";
    {
      std::lock_guard lock(mu_);
      calls_.push_back(req.path);
      bodies_.push_back(req.body);
      arrivals_.push_back(std::chrono::steady_clock::now());
      if (!api_key_.empty() && req.get_header_value("Authorization") != "Bearer " + api_key_) {
        res.status = 401;
        res.set_content(R"({"error": "Unauthorized"})", "application/json");
        return;
      }
      if (active_ > 0 && (!update || lifecycle_active_ > 0)) lifecycle_overlapped_ = true;
      ++active_;
      if (!update) ++lifecycle_active_;
      max_active_ = std::max(max_active_, active_);
      if (req.path == fail_path_ && (++fail_count_ == fail_on_nth_ || fail_on_nth_ == 0)) {
        fail = true;
      }
      soft_fail = req.path == soft_fail_path_;
      soft_fail_status = soft_fail_status_;
      if (req.path == slow_path_ && (!slow_post_only_ || req.method == "POST")) delay_ms = slow_ms_;
    }
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    {
      std::lock_guard lock(mu_);
      --active_;
      if (!update) --lifecycle_active_;
    }
    if (fail) {
      res.status = 500;
      res.set_content("Internal Server Error", "text/plain; charset=utf-8");
    } else if (soft_fail) {
      res.status = soft_fail_status;
      res.set_content(R"({"success": false, "message": "Please discard the whole weights"})",
                      "application/json");
    } else {
      res.set_content(R"({"success": true, "message": "ok"})", "application/json");
    }
  }

  mutable std::mutex mu_;
  std::vector<std::string> calls_, bodies_;  // guarded by mu_, as the rest
  std::vector<std::chrono::steady_clock::time_point> arrivals_;
  std::string fail_path_, soft_fail_path_, slow_path_, api_key_;
  int fail_on_nth_ = 0, fail_count_ = 0, slow_ms_ = 0, soft_fail_status_ = 400;
  bool slow_post_only_ = false;
  int active_ = 0, lifecycle_active_ = 0, max_active_ = 0;
  bool lifecycle_overlapped_ = false;
  LocalHttpServer http_;  // last: stopped (its handlers finished) before the state above goes
};

}  // namespace wpub::rollout::testing
