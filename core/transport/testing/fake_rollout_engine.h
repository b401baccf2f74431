// A rollout engine that behaves as SGLang does towards wpub, behind the Transport interface,
// for CPU tests of the engine's all-or-nothing contract: it is paused when a publication
// begins, loads every bucket into its live weights the moment it arrives (no staging, no roll
// back), applies the version and resumes at the commit. After an abort it does what the NCCL
// transport does for SGLang engines: resumes if it received nothing, otherwise stays paused and
// dirty until a complete version reaches it. Generate() is a request served with whatever the
// live weights hold, so a test can prove no generation ever ran on a mix of versions.
// Thread-safe: Generate may run on any thread concurrently with a publication.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/transport/transport.h"

namespace wpub::transport::testing {

class FakeRolloutEngine final : public Transport {
 public:
  explicit FakeRolloutEngine(std::string name) : name_(std::move(name)) {}

  // From now until the next Begin, every Send fails (the engine's update request errors)
  // without loading anything.
  void FailRequests();

  // One generation: counted as mixed when the engine serves while its live weights are not
  // exactly one complete version. Returns false when it is paused (nothing served).
  bool Generate();

  uint64_t generations() const;
  uint64_t mixed_generations() const;
  bool serving() const;
  bool dirty() const;
  // The version whose every tensor the live weights hold (0: none).
  uint64_t complete_version() const;
  // The live weights: tensor name -> bytes.
  std::map<std::string, std::vector<uint8_t>> weights() const;

  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;

 private:
  bool MixedLocked() const;

  const std::string name_;
  mutable std::mutex mu_;
  bool serving_ = true;
  bool dirty_ = false;
  bool in_flight_ = false;
  bool failing_ = false;
  bool committed_ = false;  // the last publication committed here
  std::string error_;
  PublicationManifest manifest_;
  uint32_t received_ = 0;
  std::map<std::string, uint64_t> live_version_;  // tensor -> version of its bytes
  std::map<std::string, std::vector<uint8_t>> live_;
  std::set<std::string> model_;  // the tensor names of the last committed manifest
  uint64_t complete_version_ = 0;
  uint64_t generations_ = 0;
  uint64_t mixed_ = 0;
};

}  // namespace wpub::transport::testing
