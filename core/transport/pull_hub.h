// Internal to the pull transport (pull_transport.cc, subscription.cc): the state both halves
// share -- receivers and their event queues, the publication in flight, the outcomes of versions
// receivers may hold staged -- behind one mutex, and the helpers both use. Not part of the
// module's interface.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/transport/pull_transport.h"

namespace wpub::transport::pull_internal {

// Versions whose outcome a transport remembers for receivers that held them staged.
inline constexpr size_t kVersionsRemembered = 64;

inline std::chrono::steady_clock::time_point SteadyDeadline(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return std::chrono::steady_clock::now();
  if (left > absl::Hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(left);
}

}  // namespace wpub::transport::pull_internal

namespace wpub::transport {

struct Subscription::Hub {
  struct Receiver {
    std::string name;
    std::string instance;
    std::deque<ReceiverEvent> events;
    std::condition_variable cv;
    ReceiverState state = ReceiverState::kIdle;
    uint64_t last_committed_version = 0;
    uint64_t held_version = 0;  // as subscribed; raised by every commit
    bool accepts_patches = false;
    absl::Time connected_at;
    bool closed = false;
    bool cancelled = false;
    bool dropped = false;
    // Subscription::Attach: the sink events go to, and whether it holds an item.
    SubscriptionSink* sink = nullptr;
    bool sink_busy = false;
  };
  struct Participant {
    uint64_t id = 0;
    std::string name;
    std::string instance;
    std::vector<bool> acked;
    size_t num_acked = 0;
    ReceiverFailure failure = ReceiverFailure::kNone;
    std::string error;
    bool committed = false;
    uint64_t patch_base = 0;  // offered patches against this version (0: none)
  };
  // A bucket's patch, made once by its first reader (outside `mu`).
  struct PatchSlot {
    std::mutex mu;
    bool made = false;
    std::shared_ptr<const Bucket> patch;  // null: the bucket goes whole
    // A deferred bucket's bytes, read whole once (PatchSource::whole).
    bool whole_read = false;
    absl::StatusOr<std::shared_ptr<const Bucket>> whole = absl::UnknownError("not read");
  };

  explicit Hub(const PullTransportOptions& o) : options(o) {}

  const PullTransportOptions options;
  mutable std::mutex mu;
  std::condition_variable ack_cv;  // WaitAcknowledged
  // Items for idle sinks, taken under `mu` and handed over once it is released (HubLock): a
  // sink's Deliver converts and writes its event, which must not hold up the transport. Per
  // subscription id, the deliveries running now (Detach waits for them).
  struct Delivery {
    uint64_t id = 0;
    SubscriptionSink* sink = nullptr;
    absl::StatusOr<ReceiverEvent> item;
  };
  std::vector<Delivery> deliveries;
  std::map<uint64_t, int> delivering;
  std::condition_variable delivered_cv;
  std::map<uint64_t, std::shared_ptr<Receiver>> receivers;
  std::set<uint64_t> dropped_ids;
  uint64_t next_id = 1;
  uint64_t committed_version = 0;
  bool shutdown = false;
  // PullTransport::SetBehindListener's; called without the lock.
  std::function<void(const std::string&, uint64_t)> on_behind;

  PatchSource patches;            // SetPatchSource's
  uint32_t offered_in_a_row = 0;  // committed publications in a row that offered patches
  bool offered_now = false;       // the publication in flight offered patches
  bool all_patched = false;       // ... to every participant (it may take buckets deferred)
  // Per bucket of the publication in flight, when a participant was offered patches.
  std::vector<std::shared_ptr<PatchSlot>> patch_slots;

  bool in_flight = false;
  bool failed = false;  // a participant failed the publication in flight
  PublicationManifest manifest;
  std::vector<std::shared_ptr<const Bucket>> staged;
  std::vector<Participant> participants;
  uint64_t last_aborted_version = 0;
  // What receivers were last told of each recent version (true: commit), newest kept.
  std::map<uint64_t, bool> told;
  void Told(uint64_t version, bool committed) {
    told[version] = committed;
    while (told.size() > pull_internal::kVersionsRemembered) told.erase(told.begin());
  }
  // What this transport knows of `version`, held staged by a receiver that subscribes.
  std::pair<StagedDecision, std::string> StagedLocked(uint64_t version) const {
    if (version == 0) return {StagedDecision::kUnknown, ""};
    if (in_flight && manifest.version == version) {
      return {StagedDecision::kUnknown,
              absl::StrCat("version ", version, " is still being published here")};
    }
    if (auto it = told.find(version); it != told.end()) {
      return {it->second ? StagedDecision::kApply : StagedDecision::kDiscard,
              absl::StrCat("version ", version, it->second ? " committed" : " aborted", " here")};
    }
    if (version < committed_version) {
      return {StagedDecision::kDiscard, absl::StrCat("version ", committed_version,
                                                     " committed here since version ", version)};
    }
    return {StagedDecision::kUnknown, absl::StrCat("no record of version ", version, " here")};
  }
  std::vector<ReceiverOutcome> last_outcomes;

  // FAILED_PRECONDITION when `attempt` (0 is read as 1) is not the attempt of `version` in
  // flight: a receiver still working through an attempt that was aborted and begun again.
  absl::Status CheckAttempt(absl::string_view receiver, uint64_t version, uint32_t attempt) const {
    const uint32_t a = attempt == 0 ? 1 : attempt;
    if (in_flight && manifest.version == version && manifest.attempt != a) {
      return absl::FailedPreconditionError(
          absl::StrCat("receiver ", receiver, ": attempt ", a, " of version ", version,
                       " was aborted; attempt ", manifest.attempt, " is in flight"));
    }
    return absl::OkStatus();
  }

  Participant* FindParticipant(uint64_t id) {
    for (auto& p : participants) {
      if (p.id == id) return &p;
    }
    return nullptr;
  }

  std::vector<ReceiverOutcome> OutcomesLocked() const {
    if (!in_flight) return last_outcomes;
    std::vector<ReceiverOutcome> out;
    for (const auto& p : participants) {
      ReceiverOutcome o{p.name,      p.instance, ReceiverState::kReceiving,
                        p.committed, p.failure,  p.error,
                        false,       {},         {}};
      if (p.failure != ReceiverFailure::kNone) {
        o.state = p.failure == ReceiverFailure::kDisconnected ? ReceiverState::kLeft
                                                              : ReceiverState::kFailed;
      } else if (p.num_acked == manifest.buckets.size()) {
        o.state = ReceiverState::kStaged;
      }
      out.push_back(std::move(o));
    }
    return out;
  }

  void FailParticipant(Participant& p, ReceiverFailure failure, std::string error) {
    if (p.failure != ReceiverFailure::kNone) return;
    p.failure = failure;
    p.error = std::move(error);
    failed = true;
    if (auto it = receivers.find(p.id); it != receivers.end()) {
      it->second->state = ReceiverState::kFailed;
    }
    ack_cv.notify_all();
  }

  // Queues `event` for receiver `id`; drops a receiver whose queue overflows.
  void Push(uint64_t id, ReceiverEvent event) {
    auto it = receivers.find(id);
    if (it == receivers.end()) return;
    Receiver& r = *it->second;
    if (r.events.size() >= options.max_queued_events) {
      r.dropped = true;
      Wake(id, r);
      dropped_ids.insert(id);
      receivers.erase(it);
      if (in_flight) {
        if (Participant* p = FindParticipant(id)) {
          FailParticipant(*p, ReceiverFailure::kProtocol,
                          absl::StrCat("receiver ", p->name, " fell behind (",
                                       options.max_queued_events, " undelivered events)"));
        }
      }
      return;
    }
    r.events.push_back(std::move(event));
    Wake(id, r);
  }

  // What Next returns now for `r` (nullopt: nothing yet). Events queued before a shutdown are
  // still delivered (the commit or abort of the last publication must reach every receiver);
  // only an empty queue reports the shutdown.
  std::optional<absl::StatusOr<ReceiverEvent>> NextLocked(Receiver& r) {
    if (r.dropped) {
      return absl::ResourceExhaustedError(
          absl::StrCat("receiver ", r.name, " was dropped for falling behind"));
    }
    if (r.closed || r.cancelled) {
      return absl::CancelledError(absl::StrCat("subscription of receiver ", r.name, " is closed"));
    }
    if (!r.events.empty()) {
      ReceiverEvent event = std::move(r.events.front());
      r.events.pop_front();
      return event;
    }
    if (shutdown) {
      return absl::CancelledError(absl::StrCat("subscription of receiver ", r.name, " is closed"));
    }
    return std::nullopt;
  }

  // Something changed for `r` (subscription `id`): wakes Next, or takes what waits for an idle
  // sink, which the HubLock hands over once the lock is released.
  void Wake(uint64_t id, Receiver& r) {
    r.cv.notify_all();
    if (r.sink == nullptr || r.sink_busy) return;
    std::optional<absl::StatusOr<ReceiverEvent>> item = NextLocked(r);
    if (!item.has_value()) return;
    r.sink_busy = true;
    Hand(id, r.sink, *std::move(item));
  }

  // `item` for `sink` (subscription `id`), handed over once the HubLock is released.
  void Hand(uint64_t id, SubscriptionSink* sink, absl::StatusOr<ReceiverEvent> item) {
    ++delivering[id];
    deliveries.push_back(Delivery{id, sink, std::move(item)});
  }

  // Ends the publication in flight, recording outcomes and releasing the staged buckets.
  void EndLocked(bool committed) {
    for (auto& p : participants) {
      p.committed = committed;
      if (auto it = receivers.find(p.id); it != receivers.end()) {
        Receiver& r = *it->second;
        if (committed) {
          r.last_committed_version = manifest.version;
          r.held_version = std::max(r.held_version, manifest.version);
        }
        if (p.failure == ReceiverFailure::kNone) r.state = ReceiverState::kIdle;
      }
    }
    last_outcomes = OutcomesLocked();
    if (committed) {
      for (auto& o : last_outcomes) o.state = ReceiverState::kStaged;
    }
    in_flight = false;
    staged.clear();
    patch_slots.clear();  // patches and whole reads (a reader still busy holds its slot)
    ack_cv.notify_all();
  }

  std::optional<HeldVersion> HighestHeldLocked() const {
    std::optional<HeldVersion> best;
    for (const auto& [id, r] : receivers) {
      if (r->held_version != 0 && (!best || r->held_version > best->version)) {
        best = HeldVersion{r->name, r->held_version};
      }
    }
    return best;
  }

  absl::Status CheckVersionAheadLocked(uint64_t version) const {
    std::optional<HeldVersion> held = HighestHeldLocked();
    if (held && version <= held->version) {
      return absl::FailedPreconditionError(
          absl::StrCat("version: ", version, " is not greater than version ", held->version,
                       " held by receiver '", held->receiver, "'"));
    }
    return absl::OkStatus();
  }

  void Leave(uint64_t id, bool closed) {
    auto it = receivers.find(id);
    if (it == receivers.end()) return;
    it->second->closed = closed;
    Wake(id, *it->second);
    const std::string name = it->second->name;
    receivers.erase(it);
    if (in_flight) {
      if (Participant* p = FindParticipant(id)) {
        FailParticipant(
            *p, ReceiverFailure::kDisconnected,
            absl::StrCat("receiver ", name, " disconnected during publication ", manifest.version));
      }
    }
  }
};

// The hub's lock: on release, hands the sinks the items taken for them meanwhile (in order,
// after the lock is released, so a sink's conversion and write never hold the transport up).
class HubLock {
 public:
  explicit HubLock(Subscription::Hub& hub) : hub_(hub), lock_(hub.mu) {}
  HubLock(const HubLock&) = delete;
  HubLock& operator=(const HubLock&) = delete;
  ~HubLock() {
    if (!lock_.owns_lock()) lock_.lock();
    while (!hub_.deliveries.empty()) {
      std::vector<Subscription::Hub::Delivery> batch;
      batch.swap(hub_.deliveries);
      lock_.unlock();
      for (Subscription::Hub::Delivery& d : batch) d.sink->Deliver(std::move(d.item));
      lock_.lock();
      for (const Subscription::Hub::Delivery& d : batch) {
        if (auto it = hub_.delivering.find(d.id);
            it != hub_.delivering.end() && --it->second == 0) {
          hub_.delivering.erase(it);
        }
      }
      hub_.delivered_cv.notify_all();
    }
  }
  // For condition-variable waits.
  std::unique_lock<std::mutex>& lock() { return lock_; }

 private:
  Subscription::Hub& hub_;
  std::unique_lock<std::mutex> lock_;
};

}  // namespace wpub::transport
