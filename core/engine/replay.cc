// Replayer: replays of the retained committed version through the transport group (replay.h).
#include "core/engine/replay.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"
#include "core/transport/retained_copy.h"

namespace wpub::engine {

// The replay in progress: its preemption is asked for from another thread (the ledger's
// caller, or Stop) and seen by the replay between its steps. The transports are aborted only
// while the replay may have something in flight on them (an idle abort would fail the engines'
// communicator for nothing); the replay checks `preempted` after its Begin, so a preemption
// between the two is never lost (both flags are sequentially consistent).
struct Replayer::Current {
  std::atomic<bool> preempted{false};
  std::atomic<bool> in_transfer{false};
  // Asks for the preemption; true when the caller must abort the transports.
  bool Preempt() {
    if (preempted.exchange(true)) return false;
    return in_transfer.load();
  }
};

Replayer::Replayer(Engine::Impl* engine, size_t history)
    : engine_(engine), history_(std::max<size_t>(history, 1)) {
  thread_ = std::thread([this] { Loop(); });
}

Replayer::~Replayer() { Stop(); }

void Replayer::Stop() {
  std::shared_ptr<Current> current;
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    pending_.reset();
    current = current_;
  }
  cv_.notify_all();
  if (current != nullptr && current->Preempt()) {
    engine_->transports().Abort("the engine is shutting down (a replay was in progress)");
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Replayer::Request(ReplayKind kind, std::string trigger) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    if (pending_.has_value()) {
      if (kind == ReplayKind::kRestore) pending_->kind = kind;
      absl::StrAppend(&pending_->trigger, "; ", trigger);
    } else {
      pending_ = Pending{kind, std::move(trigger)};
    }
  }
  cv_.notify_all();
}

std::vector<ReplayReport> Replayer::Recent(size_t n) const {
  std::lock_guard lock(mu_);
  const size_t k = std::min(n, reports_.size());
  return std::vector<ReplayReport>(reports_.begin(), reports_.begin() + k);
}

void Replayer::Record(const ReplayReport& report) {
  {
    std::lock_guard lock(mu_);
    reports_.push_front(report);
    while (reports_.size() > history_) reports_.pop_back();
  }
  engine_->OnReplay(report);
}

bool Replayer::SomethingBehind(std::string* who) const {
  const uint64_t committed = engine_->ledger().committed_version();
  std::vector<std::string> behind;
  for (const transport::ReceiverInfo& r : engine_->transports().Receivers()) {
    if (r.state == transport::ReceiverState::kDirty) {
      behind.push_back(absl::StrCat(r.name, " (dirty)"));
    } else if (r.state != transport::ReceiverState::kLeft && r.held_version < committed) {
      behind.push_back(absl::StrCat(r.name, " (holds v", r.held_version, ")"));
    }
  }
  *who = absl::StrJoin(behind, ", ");
  return !behind.empty();
}

void Replayer::Loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || pending_.has_value(); });
    if (stopping_) return;
    Pending p = *std::move(pending_);
    pending_.reset();
    lock.unlock();
    std::string who;
    if (SomethingBehind(&who)) {
      absl::StatusOr<ReplayReport> r = Run(p.kind, absl::StrCat(p.trigger, "; behind: ", who));
      if (!r.ok()) {
        // Nothing was sent: a publication holds the slot (it reaches them anyway), nothing is
        // retained, the engine shuts down.
        spdlog::info("{} not run ({}): {}", ReplayKindName(p.kind), p.trigger,
                     std::string(r.status().message()));
      }
    }
    lock.lock();
  }
}

absl::StatusOr<ReplayReport> Replayer::Run(ReplayKind kind, std::string trigger) {
  const std::shared_ptr<const transport::RetainedVersion> retained = engine_->retained().Retained();
  if (retained == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("nothing to replay: ", engine_->retained().Info().reason));
  }
  const uint64_t version = retained->manifest.version;
  if (!retained->manifest.group.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "v", version, " is a version of group ", retained->manifest.group,
        ": replays of group versions are not built; its engines and receivers converge at the "
        "group's next version"));
  }
  auto current = std::make_shared<Current>();
  const auto preempt = [this, current] {
    if (!current->Preempt()) return;
    engine_->transports().Abort("a publication preempted the replay of the committed version");
  };
  {
    std::lock_guard lock(mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
  }
  const auto t0 = std::chrono::steady_clock::now();
  ReplayReport report;
  report.kind = kind;
  report.version = version;
  report.trigger = std::move(trigger);
  report.started_at = absl::Now();
  WPUB_RETURN_IF_ERROR(engine_->ledger().BeginReplay(version, ReplayKindName(kind), preempt));
  {
    std::lock_guard lock(mu_);
    current_ = current;
    if (stopping_) current->preempted = true;
  }
  spdlog::info("{} of v{} begins ({})", ReplayKindName(kind), version, report.trigger);

  transport::TransportGroup& transports = engine_->transports();
  transport::PublicationManifest manifest = retained->manifest;
  manifest.replay = true;
  current->in_transfer = true;
  absl::StatusOr<std::vector<std::string>> participants =
      current->preempted ? absl::StatusOr<std::vector<std::string>>(
                               absl::AbortedError("preempted before it began"))
                         : transports.Begin(manifest);
  bool begun = participants.ok();
  absl::Status s = participants.status();
  for (size_t i = 0; s.ok() && i < retained->bucket_count(); ++i) {
    if (current->preempted) break;
    absl::StatusOr<std::shared_ptr<const transport::Bucket>> bucket = retained->BucketAt(i);
    s = bucket.ok() ? transports.Send(*bucket) : bucket.status();
    if (s.ok()) {
      report.bytes += retained->manifest.buckets[i].nbytes;
      ++report.buckets;
    }
  }
  if (s.ok() && !current->preempted) {
    s = transports.WaitAcknowledged(absl::Now() + engine_->options().ack_deadline);
  }
  bool committed = false;
  if (s.ok() && !current->preempted) {
    s = transports.Commit();
    begun = false;  // Commit ended it, whatever it returned
    committed = s.ok();
  }
  if (!committed && current->preempted) {
    report.preempted = true;
    s = absl::AbortedError(absl::StrCat("preempted by a publication of a newer version",
                                        s.ok() ? "" : absl::StrCat(" (", s.message(), ")")));
  }
  if (!s.ok()) {
    report.error = std::string(s.message());
    if (begun)
      transports.Abort(
          absl::StrCat(ReplayKindName(kind), " of v", version, " failed: ", s.message()));
  }
  current->in_transfer = false;
  report.completed = s.ok();
  if (participants.ok()) report.receivers = transports.Outcomes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard lock(mu_);
    current_.reset();
  }
  if (report.completed) {
    spdlog::info("{} of v{} completed in {:.3f} s: {} receivers, {} bytes", ReplayKindName(kind),
                 version, report.seconds, report.receivers.size(), report.bytes);
  } else {
    spdlog::warn("{} of v{} did not complete ({:.3f} s): {}", ReplayKindName(kind), version,
                 report.seconds, report.error);
  }
  // Recorded before the slot is freed: whoever takes it next (a preempting publication) sees
  // the replay's report.
  Record(report);
  engine_->ledger().EndReplay();
  return report;
}

}  // namespace wpub::engine
