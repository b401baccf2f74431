// The engine's publication ledger: slot, committed version, reports, shutdown (ledger.h).
#include "core/engine/ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
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
  return active_ ? absl::StrCat("publication version ", active_->version())
                 : std::string("ConnectEngines (forming the engine group)");
}

absl::StatusOr<PublicationLedger::Active> PublicationLedger::Acquire(uint64_t version, bool queue,
                                                                     absl::Duration queue_timeout,
                                                                     Admit admit) {
  std::unique_lock lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  if (active_ || connecting_) {
    if (!queue) {
      return absl::FailedPreconditionError(
          absl::StrCat(HolderLocked(), " is active; version ", version, " must wait for it"));
    }
    const bool freed = cv_.wait_until(lock, SteadyIn(queue_timeout),
                                      [&] { return (!active_ && !connecting_) || shutting_down_; });
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
  std::lock_guard lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the engine is shutting down");
  if (active_) {
    return absl::FailedPreconditionError(
        absl::StrCat("publication version ", active_->version(),
                     " is active; ConnectEngines must wait until it ends"));
  }
  if (connecting_) return absl::FailedPreconditionError("another ConnectEngines is in progress");
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
  return s;
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
