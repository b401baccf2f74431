// A fault-injecting transport for tests: a decorator over any transport::Transport that, per
// publication attempt, can drop, delay or corrupt the bytes of bucket k, cut a receiver off at
// bucket k, or fail at the commit, so the engine's all-or-nothing contract is tested against
// every kind of failure without hardware. A fault is armed for the next Begin(s); each Begin
// consumes one of its attempts. Thread-safety: as transport::Transport (Abort from any thread).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/transport/transport.h"

namespace wpub::transport::testing {

enum class FaultKind : uint8_t {
  kNone,
  kDrop,        // bucket k never reaches the receivers (they time out)
  kDelay,       // bucket k is handed on after `delay` (the publication still commits)
  kCorrupt,     // bucket k's bytes are handed on with one bit flipped (checksums disagree)
  kDisconnect,  // `on_disconnect` runs just before bucket k is handed on (a receiver leaves)
  kCommit,      // Commit fails before it reaches the receivers (the daemon dies at the commit)
};
const char* FaultKindName(FaultKind kind);

struct Fault {
  FaultKind kind = FaultKind::kNone;
  uint32_t bucket = 0;
  absl::Duration delay = absl::Milliseconds(5);
  int attempts = 1;  // consecutive Begins it applies to (a persistent fault: > 1)
};

class FaultInjectingTransport final : public Transport {
 public:
  // `inner` must outlive this decorator. `on_disconnect` is called from the publication thread.
  FaultInjectingTransport(Transport* inner, std::function<void()> on_disconnect);

  // The fault of the next Begin (kNone clears it).
  void Arm(Fault fault);
  // Faults that took effect (a bucket fault whose bucket was reached, a commit fault).
  uint64_t injected() const { return injected_.load(); }

  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;

 private:
  Transport* const inner_;
  const std::function<void()> on_disconnect_;
  std::mutex mu_;
  Fault armed_;   // guarded by mu_
  Fault active_;  // the current attempt's fault (publication thread)
  std::atomic<uint64_t> injected_{0};
};

}  // namespace wpub::transport::testing
