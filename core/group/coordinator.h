// The leader's side of publication groups: the rounds (round.h) of the versions this daemon
// leads, one at a time, and the vote of its own publication (member 0) in them. The gRPC Group
// service (server/service/group_service.h) joins the other members' streams to the same rounds.
//
// Which round a member joins: the leader's round (the active one, which the leader joined) when
// its group, member count and version match; before the leader joined, a pending round of its
// group, member count and version (at most kMaxPendingRounds of them wait at once). The leader's
// own publication (member 0) is authoritative: when it opens a version, the pending round of
// that version becomes the active one and every other round (an undecided active round, the
// other pending ones) aborts naming the leader's version. A member other than the leader that
// joins with another group, member count or version than the leader's active round is refused
// (FAILED_PRECONDITION naming both), and the round is not disturbed: a Join nobody expected
// changes nothing, and a member really missing makes the round time out. A version outside
// [1, max_version] is refused (INVALID_ARGUMENT).
//
// Timeouts are the leader's: a round's progress timeout is the leader's header's when the
// leader opens it, else CoordinatorOptions::default_timeout (wpubd --group_timeout); a member's
// requested timeout is never used.
//
// Decisions: every round's decision is recorded in the decision log (CoordinatorOptions::
// decisions) before anyone hears it, and OutcomeOf answers a member that voted prepared and
// lost its stream before the decision reached it (Group.Outcome).
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/group_vote.h"
#include "core/group/decision_log.h"
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
  // A round's progress timeout when the leader's header gives none (GroupMembership::timeout),
  // and of every round a member opens before the leader.
  absl::Duration default_timeout = absl::Seconds(60);
  // The largest version a member may join with (EngineOptions::max_version).
  uint64_t max_version = uint64_t{1} << 53;
  // Where decisions are recorded (wpubd --group_decision_log). Null: in memory only.
  std::shared_ptr<DecisionLog> decisions;
};

// What the leader knows of one round (Coordinator::OutcomeOf).
struct RoundOutcome {
  enum class State : uint8_t {
    kUnknown,    // no record, and the leader cannot presume (see OutcomeOf)
    kUndecided,  // the round is still open: ask again
    kCommitted,
    kAborted,
  };
  State state = State::kUnknown;
  absl::Status why;  // kAborted: the abort; kUnknown: what the leader does not know
};

// Versions waiting for their leader at once (members that joined first).
inline constexpr size_t kMaxPendingRounds = 4;

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

  // Joins `hello` to its round (see above). On success the round is the member's. `timeout`:
  // the leader's (member 0) progress timeout; ignored for other members.
  absl::StatusOr<std::shared_ptr<Round>> Join(const MemberHello& hello, absl::Duration timeout);
  // The active round, or the last decided one; nullopt before the first.
  std::optional<engine::GroupSummary> LastRound() const;
  // The decision of round `round` (Round::id) of `group` version `version`: recorded, or the
  // round still open, or -- no record of it -- kAborted when the log is durable or the round is
  // this process's (a commit is always recorded before it is announced, so a round without a
  // record never committed), kUnknown otherwise (a leader restarted without a decision log).
  RoundOutcome OutcomeOf(const std::string& group, uint64_t version, uint64_t round) const;
  // A round ended (called by the votes and the service once they saw the decision): records
  // metrics once per round.
  void Observe(const std::shared_ptr<Round>& round);

  // The leader's own publication as member 0: an engine::GroupJoiner for headers whose
  // group.member is 0.
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> JoinLocal(
      const engine::PublicationHeader& header, std::function<void(absl::Status)> on_abort);

 private:
  struct Metrics;
  // A new round with the next id, recording its decision in the log.
  std::shared_ptr<Round> NewRound(const engine::GroupMembership& gm, uint64_t version,
                                  absl::Duration timeout);

  const CoordinatorOptions options_;
  const std::shared_ptr<DecisionLog> decisions_;
  const uint64_t boot_;  // this process's round ids: boot_ << 32 | a counter
  std::atomic<uint32_t> next_round_{0};
  std::unique_ptr<Metrics> metrics_;
  mutable std::mutex mu_;
  std::shared_ptr<Round> active_;  // the latest round the leader joined (decided or not)
  std::vector<std::shared_ptr<Round>> pending_;  // joined by members before their leader
  std::shared_ptr<Round> observed_;
};

}  // namespace wpub::group
