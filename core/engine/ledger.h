// The engine's publication ledger: the one active slot (held by a publication, by a
// ConnectEngines forming the engine group, or by a replay of the retained version), the
// committed version, the report history and the shutdown flag, with the condition variable
// queued Opens and Drain wait on. Internal to core/engine (Engine::Impl owns one).
//
// A replay (a restore or a catch-up: replay.h) yields: a publication or a ConnectEngines that
// finds the slot held by one preempts it (its `preempt` is called) and waits for it to end, so
// that a replay never delays the trainer's version by more than its abort.
//
// Thread-safety: every method may be called from any thread. One mutex guards everything here;
// it is never held while calling into a publication or a transport, except for the `admit`
// step of Acquire (see there).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/types.h"

namespace wpub::engine {

class PublicationLedger {
 public:
  using Active = std::shared_ptr<PublicationSession::State>;
  // Runs with the slot free and held for the caller (under the ledger's lock, so nothing can
  // take it meanwhile): the version checks that need the committed version, then the new
  // publication. Its error leaves the slot free; its publication becomes the active one.
  using Admit = absl::FunctionRef<absl::StatusOr<Active>(uint64_t committed_version)>;

  struct Snapshot {
    uint64_t committed_version = 0;
    std::string committed_model_id;
    absl::Time committed_at = absl::InfinitePast();
    bool shutting_down = false;
    std::vector<PublicationReport> last_reports;  // newest first, at most status_reports
    Active active;                                // null when none
    int queued = 0;                               // Opens waiting for the slot (`queue`)
  };

  // Keeps the last max(report_history, 1) reports; Snapshot shows status_reports of them.
  PublicationLedger(size_t report_history, size_t status_reports);

  // The slot for publication `version` (Engine::Open's rules, in order): UNAVAILABLE after
  // BeginShutdown; when the slot is held, FAILED_PRECONDITION naming the holder, or with
  // `queue` a wait until it is free (DEADLINE_EXCEEDED after `queue_timeout`, UNAVAILABLE on
  // shutdown); FAILED_PRECONDITION for a version <= the committed one; then `admit`'s error.
  // A replay holding the slot is preempted and waited for (at most kReplayYield; past it,
  // FAILED_PRECONDITION naming the replay).
  absl::StatusOr<Active> Acquire(uint64_t version, bool queue, absl::Duration queue_timeout,
                                 Admit admit);
  // The slot for a ConnectEngines: UNAVAILABLE after BeginShutdown, FAILED_PRECONDITION while a
  // publication is active or another ConnectEngines runs; a replay is preempted and waited for
  // as by Acquire. EndConnecting frees it.
  absl::Status BeginConnecting();
  void EndConnecting();
  // The slot for a replay of committed version `version` (`what`: "restore", "catch-up"):
  // UNAVAILABLE after BeginShutdown, FAILED_PRECONDITION naming the holder while the slot is
  // held or an Acquire waits for it (`queue`: the new version goes first), or when the committed
  // version is no longer `version`. `preempt` is called, from the
  // thread that wants the slot and without the ledger's lock, at most once; the replay must
  // then end promptly. EndReplay frees the slot.
  absl::Status BeginReplay(uint64_t version, std::string what, std::function<void()> preempt);
  void EndReplay();
  // How long a publication or ConnectEngines waits for a preempted replay to end.
  static constexpr absl::Duration kReplayYield = absl::Seconds(30);
  // Records a publication's final report (newest first), advances the committed version when
  // it committed, and frees the slot when `holder` holds it. Wakes every waiter.
  void Record(const PublicationSession::State* holder, const PublicationReport& report);

  Snapshot GetSnapshot() const;
  uint64_t committed_version() const;
  std::vector<PublicationReport> Recent(size_t n) const;  // the last n, newest first

  // Acquire and BeginConnecting refuse from now on (queued Opens wake up and refuse).
  void BeginShutdown();
  // Blocks until no publication is active or `timeout` passed; the active publication then,
  // or null.
  Active WaitUntilIdle(absl::Duration timeout);

 private:
  // Requires mu_: what holds the slot, for messages.
  std::string HolderLocked() const;
  // Requires mu_ (held by `lock`): preempts a replay holding the slot and waits until it ends
  // (or shutdown). FAILED_PRECONDITION naming it when it outlives kReplayYield.
  absl::Status YieldReplayLocked(std::unique_lock<std::mutex>& lock);
  struct Replay {
    uint64_t version = 0;
    std::string what;
    std::function<void()> preempt;  // taken (moved out) by the first preemption
  };

  const size_t report_history_;
  const size_t status_reports_;
  mutable std::mutex mu_;
  std::condition_variable cv_;      // signalled when the slot is freed, or on shutdown
  Active active_;                   // guarded by mu_
  bool connecting_ = false;         // guarded by mu_
  std::optional<Replay> replay_;    // guarded by mu_
  int queued_ = 0;                  // guarded by mu_: Acquires waiting with `queue`
  uint64_t committed_version_ = 0;  // guarded by mu_
  std::string committed_model_id_;  // guarded by mu_
  absl::Time committed_at_ = absl::InfinitePast();  // guarded by mu_
  std::deque<PublicationReport> reports_;           // guarded by mu_; newest first
  bool shutting_down_ = false;                      // guarded by mu_
};

}  // namespace wpub::engine
