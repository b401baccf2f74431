// An SGLang server's weight-update HTTP surface for CPU tests, written from SGLang's own code
// (sgl-project/sglang), one behaviour per release family wpub supports:
//
//   release       | what it serves (read at)
//   --------------+---------------------------------------------------------------------------
//   kV0_5_5       | init/update/destroy group, pause/continue, /update_weight_version,
//                 | /get_model_info with weight_version, /get_server_info; no flattened bucket
//                 | of mixed dtypes (weight_sync/tensor_bucket.py before PRs #13413/#13824):
//                 | each update takes one broadcast per tensor -- http_server.py at
//                 | 0025436eab0556737d615b36a4dd3e1e26e82f3d
//   kV0_5_6       | the same plus load_format "flattened_bucket" (one uint8 broadcast of the
//                 | tensors back to back: tensor_bucket.py at
//                 0cbf0687be1b263c40f5e888741646398cd43809)
//   kV0_5_16      | the weight-update session: /begin_weight_update, /end_weight_update; the
//                 | scheduler ASSERTS a session is open for every distributed update and closed
//                 | at begin, and an assertion in the scheduler process kills the server (the
//                 | request gets no answer) -- scheduler_components/weight_updater.py and
//                 | scheduler.py at 00a2ca2e56d59f0a19186d7a8a58bdda5201023f; /server_info;
//                 | --admin-api-key (utils/auth.py at 0ce3659c2b55b6fb88c7b8ddf7401c61f8762c90)
//   kSessionRefusing | the later session object: the same misuse answered 400 success=false
//                 | ("a weight-update session is already open; call end_weight_update() first")
//                 | instead of a dead server (a later weight_updater.py with a _session object;
//                 | the commit that carries it was not identified, so no release is named)
//
// Common to all (http_server.py at the commits above): the weight routes answer
// {"success": bool, "message": str} with HTTP 200, or 400 when success is false; a failed
// distributed update has loaded part of the bucket ("Failed to update parameter online: ...
// Please discard the whole weights."); a successful one with "weight_version" adopts that
// version at once (per bucket, not per publication); /update_weight_version's
// abort_all_requests defaults to true (io_struct.py) and aborts every in-flight request;
// /flush_cache (GET or POST) answers 400 text/plain while any request is queued or running,
// which a pause in mode "retract" leaves queued and "in_place" running (scheduler.py at
// 0003215c: is_fully_idle), while "abort" ends them; /pause_generation and /continue_generation
// always answer 200 (no already-paused check); FastAPI answers 404 {"detail": "Not Found"} for
// a route the release lacks and 405 for a method a route does not take; with an API key the
// middleware answers 401 {"error": "Unauthorized"} on every route but /health* and /metrics*
// (with both keys, the weight routes take only the admin key).
//
// The bytes: CPU tests move none. The test says which version the current broadcasts carry
// (SetIncoming), and an update loads its tensors as that version -- what the engine's weights
// then hold is what a real engine would hold.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/types.h"
#include "core/rollout/engine_driver.h"
#include "tests/rollout/fake_http.h"

namespace wpub::rollout::testing {

enum class SglangRelease { kV0_5_5, kV0_5_6, kV0_5_16, kSessionRefusing };

struct FakeSglangOptions {
  SglangRelease release = SglangRelease::kV0_5_16;
  std::string api_key = "";        // --api-key ("" : none)
  std::string admin_api_key = "";  // --admin-api-key (kV0_5_16 and later)
};

class FakeSglang {
 public:
  explicit FakeSglang(FakeSglangOptions options = {});
  ~FakeSglang();
  FakeSglang(const FakeSglang&) = delete;
  FakeSglang& operator=(const FakeSglang&) = delete;

  std::string url() const;
  // What the broadcasts of the coming updates carry (the test's stand-in for the bytes).
  void SetIncoming(const std::string& version);
  // The model: `tensors` tensors named Name(i), all of `version`. Without it the model is
  // whatever names the updates brought (held_version then checks versions only).
  void SetModel(size_t tensors, const std::string& version);
  static std::string Name(size_t i);
  // The next distributed update loads half of its tensors, then fails (success=false, 400).
  void FailNextUpdate();
  // The same for the `k`th distributed update from now (0: the next).
  void FailUpdateAt(int k);
  // The server process dies (SIGKILL): every request from now on gets no answer.
  void Kill();
  // The server comes back (a restarted process on the same port): its start-up checkpoint
  // ("0" in every tensor, reported as "default"), no session, no weight-update group, serving.
  void Restart();
  void ClearFailure();
  // Requests in the scheduler, queued or running: a pause in mode "abort" ends them, "retract"
  // re-queues and "in_place" keeps them (and /flush_cache answers 400 while any is there).
  void SetWaitingRequests(int n);
  // How many of them an abort pause has not ended yet when later calls arrive (SGLang's
  // tokenizer manager sends its abort again every second until the update lock is free).
  void SetAbortLag(int n);
  // Every answer to a path starting with `prefix` ("" : every path) waits this long first (a
  // busy or stalled engine).
  void SetDelay(std::chrono::milliseconds delay, const std::string& prefix = "");

  // Observations.
  bool serving() const;
  bool dead() const;  // the server process exited (a scheduler assertion)
  std::string death() const;
  bool session_open() const;
  std::string last_pause_mode() const;  // the last /pause_generation's mode
  // The single version the weights hold, or "" when they mix versions.
  std::string held_version() const;
  // What /get_model_info reports ("" : none).
  std::string reported_version() const;
  int mixed_resumes() const;                // continue_generation on a mix of versions
  int requests_aborted_by_version() const;  // update_weight_version with abort_all_requests
  std::vector<std::string> calls() const;   // "METHOD /path" of every request answered
  // The load_format of every distributed update ("" : absent, one broadcast per tensor).
  std::vector<std::string> load_formats() const;

 private:
  // Answers `r` as a server process that exited: the connection closes with no complete answer.
  void Die(httplib::Response& r, const std::string& why);
  bool Authorized(const httplib::Request& q, bool weight_route) const;
  void Serve(const std::string& method, const std::string& path, const httplib::Request& q,
             httplib::Response& r);
  bool Has(const std::string& path) const;

  const FakeSglangOptions options_;
  LocalHttpServer http_;
  mutable std::mutex mu_;
  std::string incoming_ = "0";
  std::map<std::string, std::string> weights_;  // tensor name -> version
  size_t model_size_ = 0;
  bool serving_ = true;
  bool session_open_ = false;
  bool dead_ = false;
  std::string death_;
  int fail_in_ = -1;  // updates to let through before the failing one; -1: none
  int waiting_ = 0;
  int abort_lag_ = 0;
  std::string last_pause_mode_;
  std::string weight_version_;  // "" : none reported
  int mixed_resumes_ = 0;
  int aborted_by_version_ = 0;
  std::vector<std::string> calls_;
  std::vector<std::string> load_formats_;
  std::atomic<int64_t> delay_ms_{0};
  std::string delay_prefix_;  // guarded by mu_
};

// One publication as the rollout group drives it, through `driver` to `engines`: what the
// broadcasts carry (SetIncoming), begin, `sent` buckets (`bucket(b)`), then the end calls when
// `commit` and nothing failed, else the abort path -- the engines left dirty kept in
// `dirty_urls` across publications, as the rollout group keeps them. Returns the abort's dirty
// flags, empty after a commit.
std::vector<bool> PublishThrough(EngineDriver& driver, const std::vector<FakeSglang*>& engines,
                                 uint64_t version, int sent, bool commit,
                                 const std::function<transport::BucketManifest(int)>& bucket,
                                 std::set<std::string>& dirty_urls);

}  // namespace wpub::rollout::testing
