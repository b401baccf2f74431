// SGLang and vLLM engines in one publication: one rollout group per engine family (each its own
// TCPStore, communicator and protocol), and the engine connector that splits a ConnectEngines
// request by family between them. The engine drives both groups as transports; the transport
// group hands both the device bucket, each with a `done` event of its own
// (core/transport/transport_group.h): a publication to both families costs no host copy more
// than one to a single family (only gRPC-pull receivers taking part ask for one).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/engine/engine.h"

namespace wpub::rollout {

// One family's group as the router drives it (RolloutGroup).
class FamilyConnector : public engine::RolloutConnector {
 public:
  // Tears the group down and forgets its engines; afterwards no engine of it is connected.
  // FAILED_PRECONDITION while a publication is in flight on it.
  virtual absl::Status Disconnect() = 0;
  // What Connect(request) would refuse before changing anything (INVALID_ARGUMENT), without
  // side effects: the router checks every family's part before it connects any.
  virtual absl::Status CheckConnect(const engine::RolloutConnectRequest& /*request*/) const {
    return absl::OkStatus();
  }
};

class FamilyRouter final : public engine::RolloutConnector {
 public:
  // (family, its group) pairs; the groups are borrowed and must outlive the router.
  explicit FamilyRouter(std::vector<std::pair<std::string, FamilyConnector*>> members)
      : members_(std::move(members)) {}

  // Validates the request, then connects each family's engines to that family's group and
  // disconnects the groups of the families the request does not name. Each family's part is
  // checked first (FamilyConnector::CheckConnect): a refusal changes nothing. On any later
  // failure every group is disconnected (never half-connected) and the first error is returned.
  // INVALID_ARGUMENT naming the engine for a family no group serves.
  absl::StatusOr<engine::RolloutGroupInfo> Connect(const engine::RolloutConnectRequest& r) override;
  // The groups' snapshots merged: their engines in member order, names and store addresses
  // joined with ",", healthy when every group with engines is.
  engine::RolloutGroupInfo Group() const override;

 private:
  const std::vector<std::pair<std::string, FamilyConnector*>> members_;
};

}  // namespace wpub::rollout
