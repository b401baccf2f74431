// The leader's side of publication groups: the rounds (round.h) of the versions this daemon
// leads, one at a time, and the vote of its own publication (member 0) in them. The gRPC Group
// service (server/service/group_service.h) joins the other members' streams to the same rounds.
//
// Which round a member joins: the active (undecided) round when its group, member count and
// version match; a new round when none is active. The leader's own publication (member 0) is
// authoritative: when it opens a version other than the active round's, that round aborts
// (naming both versions) and a new one starts. A member other than the leader that joins with
// another version is refused (FAILED_PRECONDITION naming both versions), and when the leader has
// joined the active round already that round aborts too: it cannot complete without the member.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/group_vote.h"
#include "core/group/round.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Counter;
class Gauge;
class Histogram;
}  // namespace prometheus

namespace wpub::group {

struct CoordinatorOptions {
  // A round's progress timeout when the leader's header gives none (GroupMembership::timeout).
  absl::Duration default_timeout = absl::Seconds(60);
};

class Coordinator {
 public:
  // Metrics on `registry` (may be null): wpub_group_rounds_total{outcome},
  // wpub_group_members (of the last round), wpub_group_coordination_seconds (histogram),
  // wpub_group_member_seconds{member,phase} and wpub_group_member_bytes{member} of the last
  // round (member label bounded by the group's size).
  Coordinator(CoordinatorOptions options, prometheus::Registry* registry);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Joins `hello` to its round (see above). On success the round is the member's.
  absl::StatusOr<std::shared_ptr<Round>> Join(const MemberHello& hello, absl::Duration timeout);
  // The active round, or the last decided one; nullopt before the first.
  std::optional<engine::GroupSummary> LastRound() const;
  // A round ended (called by the votes and the service once they saw the decision): records
  // metrics once per round.
  void Observe(const std::shared_ptr<Round>& round);

  // The leader's own publication as member 0: an engine::GroupJoiner for headers whose
  // group.member is 0.
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> JoinLocal(
      const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort);

 private:
  struct Metrics;
  const CoordinatorOptions options_;
  std::unique_ptr<Metrics> metrics_;
  mutable std::mutex mu_;
  std::shared_ptr<Round> active_;  // the latest round (decided or not)
  std::shared_ptr<Round> observed_;
};

}  // namespace wpub::group
