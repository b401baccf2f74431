// The transports of one publication driven together (the pull transport's receivers and, on the
// GPU path, the rollout groups' engines), and the one place where a bucket meets them: Send hands
// each member with participants the bucket in a location that member accepts -- a device bucket
// to every member that reads device memory in this publication (up to the producer's
// DeviceBytes::reader_done events: each reader records its own `done`, so SGLang's and vLLM's
// groups broadcast from the same device bytes concurrently), and its host copy (made once, only
// when a member that takes host bytes has participants) to the others -- or, to a member that
// defers the bytes (Transport::DefersBytes: a pull transport whose receivers all take patches),
// the bucket's manifest and checksum alone (Bucket::bytes_deferred): then no host copy is made.
// Begin/Commit/Abort go to every member; WaitAcknowledged waits on each member with participants in
// turn against the same deadline; outcomes and receivers are concatenated. A retaining member (the
// retained copy: TransportCapabilities::retains) is handed the buckets of every publication it
// takes part in -- device bytes when it reads them (kept in device or pinned memory) and a reader
// event is left for it (it is the last member), the host copy otherwise -- and none of its
// names are participants. Internal to core/engine (and the benchmarks that drive a backend as
// the engine does). Same thread-safety as Transport.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/transport/transport.h"

namespace wpub::transport {

class TransportGroup final : public Transport {
 public:
  // Members are borrowed and must outlive the group; at least one. Several may take device
  // buckets: per publication the first of them with participants read the device bytes, as
  // many as the bucket has reader events, and any further one gets the host copy, so each of
  // them must take host buckets too (INVALID_ARGUMENT otherwise).
  static absl::StatusOr<std::unique_ptr<TransportGroup>> Create(std::vector<Transport*> members);

  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  // See the file comment. Members without participants in this publication get nothing. The
  // members that take the bucket where it lives get it first, then those that take host bytes
  // (so a member that defers them is asked after the retained copy staged the bucket).
  // INTERNAL when a member accepts neither the bucket's location nor host bytes.
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  // Every member's CommitDecided; a member's error is logged, never returned (the version is
  // committed: the members' outcomes say who applied it).
  absl::Status CommitDecided() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;
  void MarkParticipantsDirty() override;
  // Whether a member whose receivers apply on receipt (NCCL engines) has receivers connected.
  bool HasReceiversApplyingOnReceipt() const;

 private:
  TransportGroup(std::vector<Transport*> members, std::vector<TransportCapabilities> caps)
      : members_(std::move(members)), caps_(std::move(caps)) {}
  const std::vector<Transport*> members_;
  const std::vector<TransportCapabilities> caps_;  // per member, read once at Create
  std::vector<size_t> participants_;  // per member, fixed at Begin (publication thread)
  // The members reading device bytes in this publication, in member order (Begin's choice):
  // the k-th records DeviceBytes::reader_done[k].
  std::vector<size_t> device_readers_;
};

}  // namespace wpub::transport
