// An SGLang-like rollout engine for CPU tests (see fake_rollout_engine.h).
#include "core/transport/testing/fake_rollout_engine.h"

#include "absl/strings/str_cat.h"

namespace wpub::transport::testing {

void FakeRolloutEngine::FailRequests() {
  std::lock_guard lock(mu_);
  failing_ = true;
}

bool FakeRolloutEngine::MixedLocked() const {
  if (live_.size() != model_.size()) return true;
  for (const auto& [name, version] : live_version_) {
    if (version != complete_version_ || !model_.count(name)) return true;
  }
  return false;
}

bool FakeRolloutEngine::Generate() {
  std::lock_guard lock(mu_);
  if (!serving_) return false;
  ++generations_;
  if (MixedLocked()) ++mixed_;
  return true;
}

uint64_t FakeRolloutEngine::generations() const {
  std::lock_guard lock(mu_);
  return generations_;
}
uint64_t FakeRolloutEngine::mixed_generations() const {
  std::lock_guard lock(mu_);
  return mixed_;
}
bool FakeRolloutEngine::serving() const {
  std::lock_guard lock(mu_);
  return serving_;
}
bool FakeRolloutEngine::dirty() const {
  std::lock_guard lock(mu_);
  return dirty_;
}
uint64_t FakeRolloutEngine::complete_version() const {
  std::lock_guard lock(mu_);
  return MixedLocked() ? 0 : complete_version_;
}
std::map<std::string, std::vector<uint8_t>> FakeRolloutEngine::weights() const {
  std::lock_guard lock(mu_);
  return live_;
}

TransportCapabilities FakeRolloutEngine::capabilities() const {
  TransportCapabilities c;
  c.name = "fake-rollout";
  c.accepts = kHostOnly;
  c.acknowledges_checksums = false;
  c.applies_on_receipt = true;
  return c;
}

absl::StatusOr<std::vector<std::string>> FakeRolloutEngine::Begin(
    const PublicationManifest& manifest) {
  std::lock_guard lock(mu_);
  if (in_flight_) return absl::FailedPreconditionError("fake engine: a publication is in flight");
  serving_ = false;  // pause_generation
  in_flight_ = true;
  failing_ = false;
  committed_ = false;
  error_.clear();
  manifest_ = manifest;
  received_ = 0;
  return std::vector<std::string>{name_};
}

absl::Status FakeRolloutEngine::Send(std::shared_ptr<const Bucket> bucket) {
  std::lock_guard lock(mu_);
  if (!in_flight_) return absl::FailedPreconditionError("fake engine: nothing in flight");
  if (failing_) {
    error_ = absl::StrCat("engine ", name_, ": update request of bucket ", bucket->manifest.index,
                          " failed");
    return absl::UnavailableError(error_);
  }
  // Loaded into the live parameters at once, as SGLang's update handler does.
  for (const ManifestTensor& t : bucket->manifest.tensors) {
    const uint8_t* p = bucket->bytes.data() + t.offset;
    live_[t.name].assign(p, p + t.nbytes);
    live_version_[t.name] = bucket->version;
  }
  ++received_;
  return absl::OkStatus();
}

absl::Status FakeRolloutEngine::WaitAcknowledged(absl::Time /*deadline*/) {
  std::lock_guard lock(mu_);
  if (!error_.empty()) return absl::AbortedError(error_);
  if (received_ != manifest_.buckets.size()) {
    error_ = absl::StrCat("engine ", name_, " received ", received_, " of ",
                          manifest_.buckets.size(), " buckets");
    return absl::DeadlineExceededError(error_);
  }
  return absl::OkStatus();
}

absl::Status FakeRolloutEngine::Commit() {
  std::lock_guard lock(mu_);
  if (!in_flight_) return absl::FailedPreconditionError("fake engine: nothing in flight");
  // update_weight_version, end_weight_update, continue_generation.
  model_.clear();
  for (const BucketManifest& b : manifest_.buckets) {
    for (const ManifestTensor& t : b.tensors) model_.insert(t.name);
  }
  // Tensors of older versions that this one no longer has are not served.
  for (auto it = live_.begin(); it != live_.end();) {
    if (model_.count(it->first)) {
      ++it;
    } else {
      live_version_.erase(it->first);
      it = live_.erase(it);
    }
  }
  complete_version_ = manifest_.version;
  dirty_ = false;
  committed_ = true;
  in_flight_ = false;
  serving_ = true;
  return absl::OkStatus();
}

void FakeRolloutEngine::Abort(absl::string_view reason) {
  std::lock_guard lock(mu_);
  if (!in_flight_) return;
  in_flight_ = false;
  if (error_.empty()) error_ = std::string(reason);
  if (received_ > 0) dirty_ = true;
  // Resumes only with the weights it had: an engine dirty from an earlier abort stays paused.
  serving_ = !dirty_;
}

std::vector<ReceiverOutcome> FakeRolloutEngine::Outcomes() const {
  std::lock_guard lock(mu_);
  ReceiverOutcome o;
  o.name = name_;
  // Holds part of a version that has not committed: left dirty by an abort, or (in flight) it
  // would be if this attempt ended now.
  o.dirty = dirty_ || (in_flight_ && received_ > 0);
  if (committed_) {
    o.state = ReceiverState::kStaged;
    o.committed = true;
  } else if (!error_.empty()) {
    o.state = o.dirty ? ReceiverState::kDirty : ReceiverState::kFailed;
    o.error = error_;
    o.failure = ReceiverFailure::kProtocol;
  } else {
    o.state = in_flight_ ? ReceiverState::kReceiving : ReceiverState::kIdle;
  }
  return {o};
}

std::vector<ReceiverInfo> FakeRolloutEngine::Receivers() const {
  std::lock_guard lock(mu_);
  ReceiverInfo r;
  r.name = name_;
  r.state = dirty_ ? ReceiverState::kDirty
                   : (in_flight_ ? ReceiverState::kReceiving : ReceiverState::kIdle);
  r.last_committed_version = complete_version_;
  r.held_version = dirty_ ? 0 : complete_version_;
  return {r};
}

}  // namespace wpub::transport::testing
