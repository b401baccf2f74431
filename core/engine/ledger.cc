// The engine's publication ledger: slot, committed version, reports, shutdown (ledger.h).
#include "core/engine/ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"

namespace wpub::engine {
namespace {

std::chrono::steady_clock::time_point SteadyIn(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return std::chrono::steady_clock::now();
  if (d > absl::Hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(d);
}

}  // namespace

PublicationLedger::PublicationLedger(size_t report_history, size_t status_reports)
    : report_history_(std::max<size_t>(report_history, 1)), status_reports_(status_reports) {}

std::string PublicationLedger::HolderLocked() const {
  if (active_) return absl::StrCat("publication version ", active_->version());
  if (replay_) return absl::StrCat("the ", replay_->what, " of version ", replay_->version);
  return "ConnectEngines (forming the engine group)";
}

absl::Status PublicationLedger::YieldReplayLocked(std::unique_lock<std::mutex>& lock) {
  if (!replay_) return absl::OkStatus();
  if (std::function<void()> preempt = std::move(replay_->preempt)) {
    replay_->preempt = nullptr;
    lock.unlock();
    preempt();
    lock.lock();
  }
  const bool ended = cv_.wait_until(lock, SteadyIn(kReplayYield),
                                    [&] { return !replay_.has_value() || shutting_down_; });
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  if (!ended) {
    return absl::FailedPreconditionError(
        absl::StrCat(HolderLocked(), " did not yield within ", absl::FormatDuration(kReplayYield)));
  }
  return absl::OkStatus();
}

absl::Status PublicationLedger::BeginReplay(uint64_t version, std::string what,
                                            std::function<void()> preempt) {
  std::lock_guard lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  if (active_ || connecting_ || replay_) {
    return absl::FailedPreconditionError(absl::StrCat(
        HolderLocked(), " is active; the ", what, " of version ", version, " must wait for it"));
  }
  if (queued_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(queued_, " publication(s) queued for the slot: the ", what, " of version ",
                     version, " yields to the new version"));
  }
  if (version != committed_version_) {
    return absl::FailedPreconditionError(absl::StrCat("the ", what, " of version ", version,
                                                      ": the committed version is now ",
                                                      committed_version_));
  }
  replay_ = Replay{version, std::move(what), std::move(preempt)};
  return absl::OkStatus();
}

void PublicationLedger::EndReplay() {
  {
    std::lock_guard lock(mu_);
    replay_.reset();
  }
  cv_.notify_all();
}

absl::StatusOr<PublicationLedger::Active> PublicationLedger::Acquire(uint64_t version, bool queue,
                                                                     absl::Duration queue_timeout,
                                                                     Admit admit) {
  std::unique_lock lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  // The trainer's version wins over a replay of the committed one.
  WPUB_RETURN_IF_ERROR(YieldReplayLocked(lock));
  if (active_ || connecting_ || replay_) {
    if (!queue) {
      return absl::FailedPreconditionError(
          absl::StrCat(HolderLocked(), " is active; version ", version, " must wait for it"));
    }
    // Counted while it waits: a replay does not take the slot ahead of a queued version
    // (BeginReplay refuses), so the queued one never waits behind the committed one's replay.
    ++queued_;
    const bool freed = cv_.wait_until(lock, SteadyIn(queue_timeout), [&] {
      return (!active_ && !connecting_ && !replay_) || shutting_down_;
    });
    --queued_;
    if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
    if (!freed) {
      return absl::DeadlineExceededError(absl::StrCat("version ", version, " queued for ",
                                                      absl::FormatDuration(queue_timeout),
                                                      " behind ", HolderLocked()));
    }
  }
  if (version <= committed_version_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version: ", version, " is not greater than the committed version ", committed_version_));
  }
  absl::StatusOr<Active> admitted = admit(committed_version_);
  if (admitted.ok()) active_ = *admitted;
  return admitted;
}

absl::Status PublicationLedger::BeginConnecting() {
  std::unique_lock lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  WPUB_RETURN_IF_ERROR(YieldReplayLocked(lock));
  if (active_) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication version ", active_->version(),
                     " is active; ConnectEngines must wait until it ends"));
  }
  if (connecting_) return absl::FailedPreconditionError("another ConnectEngines is in progress");
  if (replay_) {
    return absl::FailedPreconditionError(
        absl::StrCat(HolderLocked(), " is active; ConnectEngines must wait until it ends"));
  }
  connecting_ = true;
  return absl::OkStatus();
}

void PublicationLedger::EndConnecting() {
  {
    std::lock_guard lock(mu_);
    connecting_ = false;
  }
  cv_.notify_all();
}

void PublicationLedger::Record(const PublicationSession::State* holder,
                               const PublicationReport& report) {
  {
    std::lock_guard lock(mu_);
    reports_.push_front(report);
    while (reports_.size() > report_history_) reports_.pop_back();
    if (report.status == PublicationStatus::kCommitted) {
      committed_version_ = report.version;
      committed_model_id_ = report.model_id;
      committed_at_ = absl::Now();
    }
    if (active_.get() == holder) active_.reset();
  }
  cv_.notify_all();
}

PublicationLedger::Snapshot PublicationLedger::GetSnapshot() const {
  Snapshot s;
  std::lock_guard lock(mu_);
  s.committed_version = committed_version_;
  s.committed_model_id = committed_model_id_;
  s.committed_at = committed_at_;
  s.shutting_down = shutting_down_;
  for (size_t i = 0; i < reports_.size() && i < status_reports_; ++i) {
    s.last_reports.push_back(reports_[i]);
  }
  s.active = active_;
  s.queued = queued_;
  return s;
}

uint64_t PublicationLedger::committed_version() const {
  std::lock_guard lock(mu_);
  return committed_version_;
}

std::vector<PublicationReport> PublicationLedger::Recent(size_t n) const {
  std::lock_guard lock(mu_);
  const size_t k = std::min(n, reports_.size());
  return std::vector<PublicationReport>(reports_.begin(), reports_.begin() + k);
}

void PublicationLedger::BeginShutdown() {
  {
    std::lock_guard lock(mu_);
    shutting_down_ = true;
  }
  cv_.notify_all();
}

PublicationLedger::Active PublicationLedger::WaitUntilIdle(absl::Duration timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_until(lock, SteadyIn(timeout), [&] { return !active_; });
  return active_;
}

}  // namespace wpub::engine
