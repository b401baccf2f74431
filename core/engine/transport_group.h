// A Transport over several transports driven together (the pull transport's receivers and, on
// the GPU path, the NCCL weight-update group): Begin/Send/Commit/Abort go to every member;
// WaitAcknowledged waits on each member in turn against the same deadline; outcomes and
// receivers are concatenated. Internal to core/engine. Same thread-safety as Transport.
#pragma once

#include <vector>

#include "core/engine/transport.h"

namespace wpub::engine {

class TransportGroup final : public Transport {
 public:
  // Members are borrowed and must outlive the group; at least one.
  explicit TransportGroup(std::vector<Transport*> members) : members_(std::move(members)) {}

  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  // Host buckets go to the members that accept them.
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;

 private:
  const std::vector<Transport*> members_;
};

}  // namespace wpub::engine
