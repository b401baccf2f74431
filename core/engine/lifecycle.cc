// The publication lifecycle's transitions (lifecycle.h has the diagram).
#include "core/engine/lifecycle.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace wpub::engine {

const char* LifecycleStageName(LifecycleStage stage) {
  switch (stage) {
    case LifecycleStage::kOpen:
      return "open";
    case LifecycleStage::kChecking:
      return "checking";
    case LifecycleStage::kStaged:
      return "staged";
    case LifecycleStage::kTransferring:
      return "transferring";
    case LifecycleStage::kPrepared:
      return "prepared";
    case LifecycleStage::kCommitting:
      return "committing";
    case LifecycleStage::kCommitted:
      return "committed";
    case LifecycleStage::kAborted:
      return "aborted";
    case LifecycleStage::kFailed:
      return "failed";
  }
  return "unknown";
}

PublicationState PublicStateOf(LifecycleStage stage) {
  switch (stage) {
    case LifecycleStage::kOpen:
    case LifecycleStage::kChecking:
      return PublicationState::kOpen;
    case LifecycleStage::kStaged:
    case LifecycleStage::kTransferring:
    case LifecycleStage::kPrepared:
    case LifecycleStage::kCommitting:
      return PublicationState::kStaged;
    case LifecycleStage::kCommitted:
      return PublicationState::kCommitted;
    case LifecycleStage::kAborted:
    case LifecycleStage::kFailed:
      return PublicationState::kAborted;
  }
  return PublicationState::kAborted;
}

Lifecycle::Lifecycle(uint64_t version, std::function<void(absl::string_view reason)> discard)
    : version_(version), discard_(std::move(discard)) {}

void Lifecycle::Discard(absl::string_view reason) const {
  if (discard_) discard_(reason);
}

bool Lifecycle::Terminal() const {
  const LifecycleStage s = stage_.load();
  return s == LifecycleStage::kCommitted || s == LifecycleStage::kAborted ||
         s == LifecycleStage::kFailed;
}

bool Lifecycle::CommitRunning() const {
  const LifecycleStage s = stage_.load();
  return s == LifecycleStage::kChecking || s == LifecycleStage::kStaged ||
         s == LifecycleStage::kTransferring;
}

absl::Status Lifecycle::Illegal(absl::string_view transition) const {
  return absl::FailedPreconditionError(absl::StrCat("publication ", version_, ": cannot ",
                                                    transition, " while ",
                                                    LifecycleStageName(stage_.load())));
}

absl::Status Lifecycle::CheckOpenLocked() const {
  if (Terminal()) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication ", version_, " has ended: ", end_status_.ToString()));
  }
  if (stage_.load() != LifecycleStage::kOpen) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication ", version_, " is already committing"));
  }
  return absl::OkStatus();
}

absl::Status Lifecycle::CheckOpen() const {
  std::lock_guard lock(mu_);
  return CheckOpenLocked();
}

absl::Status Lifecycle::BeginCommit() {
  std::lock_guard lock(mu_);
  if (absl::Status s = CheckOpenLocked(); !s.ok()) return s;
  commit_ran_ = true;
  stage_ = LifecycleStage::kChecking;
  return absl::OkStatus();
}

absl::Status Lifecycle::Stage() {
  std::lock_guard lock(mu_);
  if (stage_.load() != LifecycleStage::kChecking) return Illegal("stage");
  stage_ = LifecycleStage::kStaged;
  return absl::OkStatus();
}

absl::Status Lifecycle::BeginTransfer() {
  std::lock_guard lock(mu_);
  const LifecycleStage s = stage_.load();
  if (s != LifecycleStage::kStaged && s != LifecycleStage::kTransferring) {
    return Illegal("begin a transfer");
  }
  if (!abort_request_.ok()) return abort_request_;
  transfer_begun_ = true;
  stage_ = LifecycleStage::kTransferring;
  return absl::OkStatus();
}

absl::Status Lifecycle::Prepare() {
  std::lock_guard lock(mu_);
  if (stage_.load() != LifecycleStage::kTransferring) return Illegal("vote prepared");
  if (!abort_request_.ok()) return abort_request_;
  stage_ = LifecycleStage::kPrepared;
  return absl::OkStatus();
}

absl::Status Lifecycle::PassPointOfNoReturn(absl::FunctionRef<absl::Status()> commit) {
  std::lock_guard lock(mu_);
  const LifecycleStage was = stage_.load();
  if (was != LifecycleStage::kTransferring && was != LifecycleStage::kPrepared) {
    return Illegal("commit");
  }
  if (!abort_request_.ok()) return abort_request_;
  stage_ = LifecycleStage::kCommitting;
  absl::Status s = commit();
  if (!s.ok()) {
    // The transports refused the commit (e.g. a receiver left after its last acknowledgement):
    // nothing was applied, so the publication is back before the point of no return and ends
    // ABORTED with this failure.
    stage_ = was;
    abort_request_ = s;
  }
  return s;
}

Lifecycle::Ending Lifecycle::EndLocked(PublicationStatus outcome, absl::Status status) {
  Ending e;
  const LifecycleStage s = stage_.load();
  const bool legal = outcome == PublicationStatus::kCommitted
                         ? s == LifecycleStage::kCommitting
                         : !Terminal() && s != LifecycleStage::kCommitting;
  if (!legal) return e;
  if (outcome == PublicationStatus::kCommitted) {
    status = absl::OkStatus();
  } else if (outcome == PublicationStatus::kAborted && !abort_request_.ok()) {
    status = abort_request_;
  }
  e.ended_now = true;
  e.outcome = outcome;
  e.status = status;
  e.commit_ran = commit_ran_;
  e.transfer_begun = transfer_begun_;
  end_status_ = status;
  switch (outcome) {
    case PublicationStatus::kCommitted:
      stage_ = LifecycleStage::kCommitted;
      break;
    case PublicationStatus::kAborted:
      stage_ = LifecycleStage::kAborted;
      break;
    case PublicationStatus::kFailed:
      stage_ = LifecycleStage::kFailed;
      break;
  }
  if (transfer_begun_ && outcome != PublicationStatus::kCommitted) Discard(status.message());
  return e;
}

Lifecycle::Ending Lifecycle::End(PublicationStatus outcome, absl::Status status) {
  std::lock_guard lock(mu_);
  return EndLocked(outcome, std::move(status));
}

Lifecycle::StopResult Lifecycle::Stop(PublicationStatus outcome, absl::Status why, Ending* ending) {
  std::lock_guard lock(mu_);
  if (Terminal()) return StopResult::kIgnored;
  if (stage_.load() == LifecycleStage::kCommitting || stage_.load() == LifecycleStage::kPrepared) {
    return StopResult::kRefused;
  }
  if (CommitRunning()) {
    // The Commit thread ends the publication; make it stop promptly.
    if (!abort_request_.ok()) return StopResult::kIgnored;
    abort_request_ = why;
    if (transfer_begun_) Discard(why.message());
    return StopResult::kRequested;
  }
  // kOpen: nothing else is running on the publication's behalf.
  *ending =
      EndLocked(outcome == PublicationStatus::kCommitted ? PublicationStatus::kAborted : outcome,
                std::move(why));
  return StopResult::kEnded;
}

absl::Status Lifecycle::abort_request() const {
  std::lock_guard lock(mu_);
  return abort_request_;
}

}  // namespace wpub::engine
