// Fault-injecting transport decorator (see fault_injection.h).
#include "core/transport/testing/fault_injection.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace wpub::transport::testing {

const char* FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone:
      return "none";
    case FaultKind::kDrop:
      return "drop";
    case FaultKind::kDelay:
      return "delay";
    case FaultKind::kCorrupt:
      return "corrupt";
    case FaultKind::kDisconnect:
      return "disconnect";
    case FaultKind::kCommit:
      return "commit";
  }
  return "unknown";
}

FaultInjectingTransport::FaultInjectingTransport(Transport* inner,
                                                 std::function<void()> on_disconnect)
    : inner_(inner), on_disconnect_(std::move(on_disconnect)) {}

void FaultInjectingTransport::Arm(Fault fault) {
  std::lock_guard lock(mu_);
  armed_ = fault;
}

TransportCapabilities FaultInjectingTransport::capabilities() const {
  return inner_->capabilities();
}

absl::StatusOr<std::vector<std::string>> FaultInjectingTransport::Begin(
    const PublicationManifest& manifest) {
  {
    std::lock_guard lock(mu_);
    active_ = armed_;
    if (--armed_.attempts <= 0) armed_ = Fault{};
  }
  return inner_->Begin(manifest);
}

absl::Status FaultInjectingTransport::Send(std::shared_ptr<const Bucket> bucket) {
  if (active_.kind == FaultKind::kNone || active_.kind == FaultKind::kCommit ||
      bucket->manifest.index != active_.bucket) {
    return inner_->Send(std::move(bucket));
  }
  ++injected_;
  switch (active_.kind) {
    case FaultKind::kDrop:
      return absl::OkStatus();
    case FaultKind::kDelay:
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(active_.delay));
      return inner_->Send(std::move(bucket));
    case FaultKind::kCorrupt: {
      auto copy = std::make_shared<Bucket>(*bucket);
      if (!copy->bytes.empty()) copy->bytes[copy->bytes.size() / 2] ^= 0x10;
      return inner_->Send(std::move(copy));
    }
    case FaultKind::kDisconnect:
      if (on_disconnect_) on_disconnect_();
      return inner_->Send(std::move(bucket));
    default:
      return inner_->Send(std::move(bucket));
  }
}

absl::Status FaultInjectingTransport::WaitAcknowledged(absl::Time deadline) {
  return inner_->WaitAcknowledged(deadline);
}

absl::Status FaultInjectingTransport::Commit() {
  if (active_.kind == FaultKind::kCommit) {
    ++injected_;
    active_ = Fault{};
    return absl::UnavailableError("fault injection: the commit was lost");
  }
  return inner_->Commit();
}

void FaultInjectingTransport::Abort(absl::string_view reason) { inner_->Abort(reason); }

std::vector<ReceiverOutcome> FaultInjectingTransport::Outcomes() const {
  return inner_->Outcomes();
}

std::vector<ReceiverInfo> FaultInjectingTransport::Receivers() const { return inner_->Receivers(); }

}  // namespace wpub::transport::testing
