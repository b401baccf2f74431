// The HTTP side every engine family shares (engine_driver.h): one ordered request queue per
// engine over cpp-httplib, served by `lanes` keep-alive connections, with the engine's outcome
// (the first failure, requests answered, update requests sent), and concurrent GETs for health
// probes and version reads. What an answer means is the family's (AnswerCheck): SGLang says
// {"success": false}, vLLM answers a non-2xx status.
#pragma once

#include <httplib.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/common/json_bounds.h"
#include "core/rollout/engine_driver.h"

namespace wpub::rollout {

// The largest engine answer read (as the JSON bounds every answer is checked against allow).
inline constexpr size_t kMaxEngineAnswerBytes = kClientJsonBounds.max_bytes;

// One engine answer, read within bounds.
struct BoundedAnswer {
  int status = 0;          // 0: no complete answer (error says why)
  std::string body;        // at most kMaxEngineAnswerBytes
  std::string error;       // the transport error, or which bound cut the answer
  bool timed_out = false;  // no complete answer by `deadline`
};
// Sends `method path` (with `body` as application/json when not null) on `client` and reads the
// answer without buffering more than `max_bytes` (an answer declaring or sending more is cut,
// before it is held) and without reading past `deadline` (an engine that trickles its answer
// loses it at the deadline: each read's own timeout alone would let it hold the caller for as
// long as it keeps sending).
BoundedAnswer SendBounded(httplib::Client& client, const std::string& method,
                          const std::string& path, const std::string* body, absl::Time deadline,
                          size_t max_bytes = kMaxEngineAnswerBytes);

// Where one publication's engines meet before they resume (their resumes are sent together, once
// every engine finished its update, so none serves the new version while another still
// finalizes it). Each engine's resume request holds a ResumeSeat: the engine arrives when its
// queue takes the resume (everything before it answered), or when the request is skipped or
// dropped (the seat is destroyed unused: a failed or aborted engine never holds the others).
class ResumeBarrier {
 public:
  explicit ResumeBarrier(size_t engines) : waiting_for_(engines) {}
  void Arrive() {
    std::lock_guard lock(mu_);
    if (waiting_for_ > 0) --waiting_for_;
    cv_.notify_all();
  }
  // True when every engine arrived by `deadline` (false: released or timed out).
  bool Wait(absl::Time deadline) {
    std::unique_lock lock(mu_);
    while (waiting_for_ > 0 && !released_) {
      if (cv_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout) break;
    }
    return waiting_for_ == 0;
  }
  // Lets every waiter go at once (the driver's teardown: no queue thread may wait out a
  // deadline on engines that are being torn down).
  void Release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t waiting_for_;     // guarded by mu_
  bool released_ = false;  // guarded by mu_
};

// One engine's place at a ResumeBarrier.
class ResumeSeat {
 public:
  explicit ResumeSeat(std::shared_ptr<ResumeBarrier> barrier) : barrier_(std::move(barrier)) {}
  ~ResumeSeat() {
    if (!arrived_) barrier_->Arrive();
  }
  ResumeSeat(const ResumeSeat&) = delete;
  ResumeSeat& operator=(const ResumeSeat&) = delete;
  // Arrives and waits for the others until `deadline`; false when they did not all arrive.
  bool ArriveAndWait(absl::Time deadline) {
    if (!arrived_) barrier_->Arrive();
    arrived_ = true;
    return barrier_->Wait(deadline);
  }

 private:
  std::shared_ptr<ResumeBarrier> barrier_;
  bool arrived_ = false;
};

// One request to one engine.
struct EngineRequest {
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
  // Opens a state the engine must be told to end (vLLM's /start_weight_update): once it is
  // taken for sending, EngineRequestQueue::opened says so until the next Reset.
  bool opens = false;
  // When set: an answer 4xx or 5xx whose body contains `fallback_when` is not final (vLLM
  // answers a worker's ValueError with 500, an API-level refusal with 400); the request is
  // sent again with this body (an older release's form), and the queue remembers it did so
  // (EngineRequestQueue::fell_back).
  std::shared_ptr<const std::string> fallback_body = nullptr;
  std::string fallback_when = "";
  // Said instead of the body of an HTTP 404 answer (what the missing route means).
  std::string on_404 = "";
  // The engine stops serving (SGLang's /pause_generation, vLLM's /pause) or serves again
  // (/continue_generation, /resume) once this is answered: the answer times are the engine's
  // pause window (EngineOutcome::pause).
  bool pauses = false;
  bool resumes = false;
  // A refusal does not fail the engine: it is kept as EngineOutcome::warning (SGLang's
  // /flush_cache answers 400 while paused requests wait to resume, as pause mode retract keeps
  // them).
  bool best_effort = false;
  // A resume sent together with the other engines' (ResumeBarrier): the queue waits, before
  // sending it, until every engine arrived or the request timeout passed (then it is sent
  // anyway: an engine never stays paused because another is slow).
  std::shared_ptr<ResumeSeat> seat = nullptr;
};

// The verdict on a 2xx answer (within the JSON bounds): "" when it succeeded, otherwise a
// sentence beginning with `what` ("engine URL POST /path"). Null: every 2xx answer succeeds.
using AnswerCheck = std::function<std::string(const std::string& what, const std::string& body)>;

// One engine's ordered request queue, served by `lanes` connections (each its own thread), and
// its outcome. With one lane, requests go strictly one after another. With more, consecutive
// overlappable requests are taken from the queue in order and may be in flight together; a
// non-overlappable request starts only once every lane is idle, and nothing behind it starts
// before it is answered.
class EngineRequestQueue {
 public:
  // `auth_token` (EngineSpec::auth_token): a bearer token sent with every request, or "".
  EngineRequestQueue(std::string url, absl::Duration connect_timeout,
                     absl::Duration request_timeout, int lanes, AnswerCheck check,
                     const std::string& auth_token = "")
      : url_(std::move(url)), check_(std::move(check)), request_timeout_(request_timeout) {
    outcome_.url = url_;
    const auto us = [](absl::Duration d) { return absl::ToInt64Microseconds(d); };
    for (int i = 0; i < std::max(1, lanes); ++i) {
      auto c = std::make_unique<httplib::Client>(url_);
      c->set_connection_timeout(us(connect_timeout) / 1000000, us(connect_timeout) % 1000000);
      c->set_read_timeout(us(request_timeout) / 1000000, us(request_timeout) % 1000000);
      c->set_write_timeout(us(request_timeout) / 1000000, us(request_timeout) % 1000000);
      c->set_keep_alive(true);
      c->set_tcp_nodelay(true);  // small JSON requests: no Nagle delay per bucket
      if (!auth_token.empty()) c->set_bearer_token_auth(auth_token);
      clients_.push_back(std::move(c));
    }
    for (size_t i = 0; i < clients_.size(); ++i) {
      threads_.emplace_back([this, i] { Run(*clients_[i]); });
    }
  }
  // Drops queued requests and aborts those in flight, so tearing a driver down never waits
  // out a hung engine's request timeout.
  ~EngineRequestQueue() {
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
    opened_ = false;
  }
  // Forgets requests not yet sent (those of an aborted publication must never reach the engine
  // after it: each would post a receive that no broadcast matches), except those marked
  // `always`: the calls that close what an aborted publication opened (SGLang's
  // /end_weight_update, vLLM's /finish_weight_update) and resumes, which a teardown that follows
  // the abort at once (a retry re-forming the group) must not take back.
  void DropQueued() {
    std::lock_guard lock(mu_);
    std::erase_if(queue_, [](const EngineRequest& r) { return !r.always; });
    cv_.notify_all();
  }
  // Marks the engine failed with `error` (unless it already failed): its later requests of the
  // publication are skipped, and it is never reported committed.
  void Fail(std::string error) {
    std::lock_guard lock(mu_);
    if (!outcome_.failed) {
      outcome_.failed = true;
      outcome_.error = std::move(error);
    }
    cv_.notify_all();
  }
  void Post(EngineRequest r) {
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
  // Some request was answered by its fallback form (see EngineRequest::fallback_body).
  bool fell_back() const {
    std::lock_guard lock(mu_);
    return fell_back_;
  }
  // A request with `opens` was taken for sending since the last Reset (answered or not): after
  // DropQueued, whether the engine may be in the state it opens.
  bool opened() const {
    std::lock_guard lock(mu_);
    return opened_;
  }

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
      EngineRequest r = std::move(queue_.front());
      queue_.pop_front();
      if (outcome_.failed && !r.always) {
        cv_.notify_all();
        continue;  // an engine that failed gets no further requests of this publication
      }
      // Counted before it is sent, under the lock DropQueued takes: once an abort dropped the
      // queue, updates_sent says exactly which engines may hold bytes of the aborted version.
      if (r.update) ++outcome_.updates_sent;
      if (r.update && outcome_.pause.first_update == absl::InfinitePast()) {
        outcome_.pause.first_update = absl::Now();
      }
      if (r.opens) opened_ = true;
      ++in_flight_;
      exclusive_in_flight_ = !r.overlappable;
      lock.unlock();
      if (r.seat) r.seat->ArriveAndWait(absl::Now() + request_timeout_);
      std::string error = Send(client, r);
      lock.lock();
      --in_flight_;
      if (!r.overlappable) exclusive_in_flight_ = false;
      if (error.empty()) {
        ++outcome_.requests;
        const absl::Time now = absl::Now();
        if (r.pauses) outcome_.pause.paused = now;
        if (r.update) {
          outcome_.pause.last_update = now;
          ++outcome_.updates_answered;
        }
        if (r.resumes) outcome_.pause.resumed = now;
      } else if (r.best_effort) {
        outcome_.warning = std::move(error);
      } else if (!outcome_.failed) {
        outcome_.failed = true;
        outcome_.error = std::move(error);
      }
      cv_.notify_all();
    }
  }

  // Empty on success, otherwise a sentence naming the engine and call.
  std::string Send(httplib::Client& client, const EngineRequest& r) {
    const auto send = [&](const std::string* body) {
      return SendBounded(client, r.method, r.path, r.method == "GET" ? nullptr : body,
                         absl::Now() + request_timeout_);
    };
    BoundedAnswer res = send(r.body.get());
    const std::string what = absl::StrCat("engine ", url_, " ", r.method, " ", r.path);
    if (res.status == 0) return absl::StrCat(what, ": ", res.error);
    if (r.fallback_body && res.status >= 400 && res.status < 600 &&
        res.body.find(r.fallback_when) != std::string::npos) {
      res = send(r.fallback_body.get());
      if (res.status == 0) return absl::StrCat(what, ": ", res.error);
      std::lock_guard lock(mu_);
      fell_back_ = true;
    }
    if (res.status == 404 && !r.on_404.empty()) {
      return absl::StrCat(what, ": HTTP 404: ", r.on_404);
    }
    if (res.status < 200 || res.status >= 300) {
      return absl::StrCat(what, ": HTTP ", res.status, ": ", res.body.substr(0, 300));
    }
    // An answer beyond the bounds is not one (and would cost the daemon its stack or memory to
    // parse).
    if (absl::Status bounded = CheckJsonBounds(res.body, "answer"); !bounded.ok()) {
      return absl::StrCat(what, ": ", bounded.message());
    }
    if (check_) return check_(what, res.body);
    return "";
  }

  const std::string url_;
  const AnswerCheck check_;
  const absl::Duration request_timeout_;  // the whole of a request: sending and answer
  std::vector<std::unique_ptr<httplib::Client>> clients_;  // one per lane
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineRequest> queue_;   // guarded by mu_
  int in_flight_ = 0;                 // guarded by mu_
  bool exclusive_in_flight_ = false;  // guarded by mu_: a non-overlappable request is out
  bool stop_ = false;                 // guarded by mu_
  EngineOutcome outcome_;             // guarded by mu_
  bool fell_back_ = false;            // guarded by mu_
  bool opened_ = false;               // guarded by mu_
};

// Over a driver's queues: waits for every request posted so far (ABORTED naming the failed
// engines, DEADLINE_EXCEEDED naming the silent ones), the outcomes, whether any failed.
using EngineQueues = std::vector<std::unique_ptr<EngineRequestQueue>>;
absl::Status WaitAllIdle(const EngineQueues& queues, absl::Time deadline);
std::vector<EngineOutcome> OutcomesOf(const EngineQueues& queues);
bool AnyFailed(const EngineQueues& queues);
// Queues `method path` with `body` on each engine of `engines` (indices into `queues`) as a
// resume sent together (EngineRequest::resumes, a seat each at one new ResumeBarrier, which is
// returned: the driver releases it when it tears its queues down).
std::shared_ptr<ResumeBarrier> PostResumesTogether(const EngineQueues& queues,
                                                   const std::vector<size_t>& engines,
                                                   const std::string& method,
                                                   const std::string& path,
                                                   const std::string& body);

// GETs `path` on every engine concurrently (one thread each, `timeout` for the connection and
// the answer) and returns the 2xx answers' bodies (nullopt where there was none).
std::vector<std::optional<std::string>> GetAll(const std::vector<EngineSpec>& engines,
                                               const std::string& path, absl::Duration timeout);

}  // namespace wpub::rollout
