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
  // Host buckets go to the members that accept them; a bucket with sent_direct set only to
  // those without device_buckets (the others got it from the backend's device sink).
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  // Members without participants in this publication are not waited on: a backend that sends
  // buckets directly emits none when no host-bucket member has participants.
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;

  // Whether a member that takes only host buckets has participants in the publication begun
  // last (ExecutionHooks::host_buckets_needed). Publication thread only.
  bool host_only_participants() const;

 private:
  const std::vector<Transport*> members_;
  std::vector<size_t> participants_;  // per member, fixed at Begin (publication thread)
};

}  // namespace wpub::engine
