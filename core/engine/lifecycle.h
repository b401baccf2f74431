// The lifecycle of one publication as one explicit state: its stages, the transitions between
// them (each named, each saying when it is refused), the status it ended with and an abort
// request recorded while Commit runs. Internal to core/engine (PublicationSession::State owns
// one); the public PublicationState that GetStatus shows is derived from it.
//
//   kOpen --BeginCommit--> kChecking --Stage--> kStaged --BeginTransfer--> kTransferring
//                                                              (again for every attempt) |
//                                                    (a group member) --Prepare--> kPrepared
//                                          kCommitting <--PassPointOfNoReturn------------+
//                                               |            (the transports' Commit failed:
//                                               |             back to where it was, with the
//                                               |             failure as the abort request)
//   End(kCommitted): kCommitting -> kCommitted (nowhere else)
//   End(kAborted | kFailed): any stage before kCommitting -> kAborted | kFailed
//   Stop (any thread): in kOpen ends at once; from kChecking to kTransferring records the abort
//   request for the Commit thread (and tells the transports to stop once they have begun); in
//   kPrepared and kCommitting it is refused (a prepared group member's vote binds: the leader
//   decides); after the end it is ignored.
//
// Thread-safety: every method may be called from any thread; one mutex guards the stage, the
// end status and the request. `discard` (the constructor's) and the commit step of
// PassPointOfNoReturn run under that mutex, so an abort request can never slip between the
// decision to commit and the transports' Commit, nor reach the transports after the
// publication ended. They must not call back into the Lifecycle.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/engine/types.h"

namespace wpub::engine {

enum class LifecycleStage : uint8_t {
  kOpen,          // batches and inline chunks are accepted
  kChecking,      // Commit runs: the inputs are checked for completeness (GetStatus: open)
  kStaged,        // the inputs are complete; Commit plans the buckets (GetStatus: staged)
  kTransferring,  // the transports have begun (an attempt, or between two attempts)
  kPrepared,      // a group member voted prepared: the leader's decision alone ends it
  kCommitting,    // past the point of no return: the transports were told to commit
  kCommitted,     // terminal
  kAborted,       // terminal: a transport/receiver failure, an abort request, a cancellation
  kFailed,        // terminal: bad input
};
// "open", "checking", "staged", "transferring", "prepared", "committing", "committed", "aborted",
// "failed".
const char* LifecycleStageName(LifecycleStage stage);
// What GetStatus shows: kOpen and kChecking are open; kStaged to kCommitting are staged;
// kCommitted is committed; kAborted and kFailed are aborted.
PublicationState PublicStateOf(LifecycleStage stage);

class Lifecycle {
 public:
  // What one call to End or Stop did to the publication.
  struct Ending {
    bool ended_now = false;  // this call made the terminal transition: its caller reports it
    PublicationStatus outcome = PublicationStatus::kAborted;
    // Why it ended (OK when committed). An ABORTED end after an abort request was recorded
    // carries the request's status, whatever the caller passed.
    absl::Status status;
    bool commit_ran = false;      // Commit was called (its thread owns the commit path's data)
    bool transfer_begun = false;  // BeginTransfer succeeded at least once
  };
  enum class StopResult : uint8_t {
    kEnded,      // no Commit was running: the publication ended now (see the Ending)
    kRequested,  // Commit runs: the request is recorded for the Commit thread
    kRefused,    // past the point of no return: the publication commits
    kIgnored,    // it had ended, or an earlier request is recorded
  };

  // `discard(reason)` tells the transports to discard the version; it is called (under the
  // lock) when an abort request is recorded or the publication ends other than committed,
  // in both cases only once BeginTransfer succeeded. It may be null (nothing to tell).
  Lifecycle(uint64_t version, std::function<void(absl::string_view reason)> discard);
  Lifecycle(const Lifecycle&) = delete;
  Lifecycle& operator=(const Lifecycle&) = delete;

  // OK in kOpen. Otherwise FAILED_PRECONDITION: "publication V has ended: <status>" after the
  // end, "publication V is already committing" while Commit runs.
  absl::Status CheckOpen() const;
  // kOpen -> kChecking (Commit is called). The errors of CheckOpen otherwise.
  absl::Status BeginCommit();
  // kChecking -> kStaged (the inputs are complete). FAILED_PRECONDITION in any other stage.
  absl::Status Stage();
  // kStaged | kTransferring -> kTransferring (an attempt begins). Refused with the request's
  // status when an abort was requested; FAILED_PRECONDITION in any other stage.
  absl::Status BeginTransfer();
  // kTransferring -> kPrepared (a group member votes prepared; from now on Stop is refused).
  // Refused with the request's status when an abort was requested; FAILED_PRECONDITION in any
  // other stage.
  absl::Status Prepare();
  // kTransferring | kPrepared -> kCommitting, then runs `commit` (the transports' Commit) under
  // the lock.
  // Refused with the request's status when an abort was requested (commit is not run). When
  // `commit` fails, the stage returns to kTransferring with its status recorded as the abort
  // request, and that status is returned. FAILED_PRECONDITION in any other stage.
  absl::Status PassPointOfNoReturn(absl::FunctionRef<absl::Status()> commit);

  // The one terminal transition, for the thread that drives the publication (its producer,
  // then its Commit). `outcome` kCommitted is legal from kCommitting only; kAborted and
  // kFailed from every stage before kCommitting. Calls after the end, and illegal ones, are
  // no-ops (ended_now false).
  Ending End(PublicationStatus outcome, absl::Status status);
  // An abort from any thread: see StopResult. `outcome` is kAborted or kFailed (kCommitted is
  // taken as kAborted); `why` must not be OK. On kEnded, *ending says how it ended; otherwise
  // *ending is untouched.
  StopResult Stop(PublicationStatus outcome, absl::Status why, Ending* ending);

  // The recorded abort request (OK when none).
  absl::Status abort_request() const;
  LifecycleStage stage() const { return stage_.load(); }
  // Lock-free (GetStatus never waits for a transition in progress).
  PublicationState public_state() const { return PublicStateOf(stage_.load()); }

 private:
  // Requires mu_.
  bool Terminal() const;
  bool CommitRunning() const;  // kChecking .. kTransferring
  absl::Status CheckOpenLocked() const;
  void Discard(absl::string_view reason) const;
  Ending EndLocked(PublicationStatus outcome, absl::Status status);
  absl::Status Illegal(absl::string_view transition) const;

  const uint64_t version_;
  const std::function<void(absl::string_view)> discard_;
  mutable std::mutex mu_;
  std::atomic<LifecycleStage> stage_{LifecycleStage::kOpen};  // written under mu_
  absl::Status end_status_;                                   // guarded by mu_
  absl::Status abort_request_;                                // guarded by mu_; OK: none
  bool commit_ran_ = false;                                   // guarded by mu_
  bool transfer_begun_ = false;                               // guarded by mu_
};

}  // namespace wpub::engine
