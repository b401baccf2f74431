// One group version on its leader: the two-phase commit of `members` publishers
// (docs/DESIGN.md, "Publication groups"). Pure state, no I/O: the leader's own session reaches
// it through LocalVote (coordinator.h), every other member through the gRPC Group service
// (server/service/group_service.h), which turns a member's stream into these calls.
//
//   Join (each member, once) -> Stage (each member: its tensors) -> the parts check
//     (no tensor twice, the declared manifest covered) -> transfer turns -> Prepared (each
//     member: its receivers hold everything) -> the receiver check -> commit | abort
//
// Decided once: the round commits only after every member prepared with the same receivers;
// it aborts at the first failure (a member's Fail, a member that left, a check that failed,
// no progress within the timeout) and never changes its decision afterwards. A prepared vote
// binds: once member m prepared, nothing m sends or does (Fail, its stream ending) aborts the
// round -- m holds the version in doubt and learns the decision from the leader
// (docs/DESIGN.md, "One decision per version"). The decision is recorded (the recorder, the
// coordinator's DecisionLog) before any waiter sees it; a commit that cannot be recorded
// becomes an abort.
//
// Transfer turns: when any member sends to NCCL engines (StagedParts::engines), members
// transfer one after another in member order -- an engine takes one update request at a time,
// so no member's broadcast waits on another's request -- and the leader (member 0) goes first,
// so the engines' lifecycle calls that precede the first bucket are its own. Otherwise every
// member transfers at once.
//
// Thread-safe: every method may be called from any thread. Await* block.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/engine/group_vote.h"
#include "core/engine/types.h"
#include "core/group/decision_log.h"

namespace wpub::group {

// A member joining: its membership (group, members, member, publisher) and publication.
struct MemberHello {
  engine::GroupMembership membership;
  uint64_t version = 0;
  std::string recipe;
};

// Tensor names one round holds in all, every member's together (each member is bounded by
// engine::kMaxGroupNameBytes too).
inline constexpr size_t kMaxRoundNameBytes = engine::kMaxGroupNameBytes;

// Records a round's decision before anyone hears of it; an error turns a commit into an abort.
using DecisionRecorder = std::function<absl::Status(const RoundDecision&)>;

class Round {
 public:
  // `timeout`: how long the round may go without progress before a waiter aborts it.
  // `max_name_bytes`: the tensor names the round holds in all (tests make it small).
  // `id`: unique among the rounds of the leader's decision log (the coordinator's); `record`:
  // called under the round's lock with its decision, once (may be null).
  Round(std::string group, uint32_t members, uint64_t version, absl::Duration timeout,
        size_t max_name_bytes = kMaxRoundNameBytes, uint64_t id = 0,
        DecisionRecorder record = nullptr);
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;

  // Refused (the round unchanged) with FAILED_PRECONDITION naming both values for another
  // group name, member count or version, or a recipe other than member 0's; ALREADY_EXISTS for
  // a member index joined already; FAILED_PRECONDITION once decided ("version V was already
  // aborted: ...").
  absl::Status Join(const MemberHello& hello);
  // Member `member` sends `bytes` more of tensor names (as its parts arrive, before Stage):
  // RESOURCE_EXHAUSTED naming it once the round's names would exceed max_name_bytes in all (its
  // stream then fails the member).
  absl::Status ReserveNameBytes(uint32_t member, size_t bytes);
  // Member `member` checked its inputs: its parts. When every member staged, runs the parts
  // check (a failure aborts the round with INVALID_ARGUMENT). Names beyond the round's bound
  // abort it (RESOURCE_EXHAUSTED naming the member). The names are released once checked or
  // once the round is decided: a round kept as the last one holds its counts only.
  void Stage(uint32_t member, engine::StagedParts parts);
  // Member `member`'s receivers hold every bucket. When every member prepared, runs the
  // receiver check and decides.
  void Prepared(uint32_t member, engine::PreparedParts parts);
  // Member `member` failed (or its stream to the leader broke): aborts the round naming it --
  // unless it prepared (its vote binds; nothing changes).
  void Fail(uint32_t member, const absl::Status& why);
  // Aborts the round (no-op once decided).
  void Abort(const absl::Status& why);
  // Calls `fn(why)` once if the round aborts (at once when it has aborted already), from the
  // thread that aborted it and with no lock held; nothing when it commits.
  void OnAbort(std::function<void(absl::Status)> fn);

  // Block until member `member` may transfer (OK) / the round is decided (OK: commit), or
  // return why the round aborted. A wait that sees no progress for the timeout aborts the
  // round (DEADLINE_EXCEEDED naming the members waited for).
  absl::Status AwaitTransfer(uint32_t member);
  absl::Status AwaitDecision(uint32_t member);
  // The same without a thread waiting: calls `fn` once with what AwaitTransfer / AwaitDecision
  // would return, from the thread that made it so and with no lock held (from this call when
  // it is so already). These do not watch the progress timeout: whoever registers one calls
  // ExpireIfStalled when it says (the gRPC service's timer).
  void OnTransfer(uint32_t member, std::function<void(absl::Status)> fn);
  void OnDecision(uint32_t member, std::function<void(absl::Status)> fn);
  // Aborts the round (DEADLINE_EXCEEDED naming the members waited for) when it saw no progress
  // for its timeout. Returns how long until it should be called again: InfiniteDuration once
  // the round is decided.
  absl::Duration ExpireIfStalled();

  // True once a member other than `member` was let transfer while sending to engines.
  bool others_may_have_sent(uint32_t member) const;
  // Member `member` joined (whatever happened since).
  bool joined(uint32_t member) const;
  // Member `member` voted prepared (before the decision, or in the round that committed).
  bool prepared(uint32_t member) const;
  uint64_t id() const { return id_; }
  bool decided() const;
  // The abort status (OK while undecided or committed).
  absl::Status abort_status() const;
  uint64_t version() const { return version_; }
  const std::string& group() const { return group_; }
  uint32_t members() const { return members_; }
  engine::GroupSummary Summary() const;

 private:
  enum class MemberStage : uint8_t {
    kWaiting,
    kJoined,
    kStaged,
    kTransferring,
    kPrepared,
    kFailed
  };
  struct Member {
    MemberStage stage = MemberStage::kWaiting;
    size_t reserved_name_bytes = 0;  // ReserveNameBytes' share of name_bytes_
    size_t tensor_count = 0;         // parts.tensors.size() at Stage (the names are released)
    std::string publisher;
    std::string recipe;
    engine::StagedParts parts;
    engine::PreparedParts prepared;
    std::chrono::steady_clock::time_point joined_at;
    double seconds = 0;
    std::string error;
  };
  using Clock = std::chrono::steady_clock;

  // Require mu_.
  std::string Name(uint32_t member) const;
  void Progress();
  void AbortLocked(const absl::Status& why, int32_t failed_member);
  void CheckParts();
  void ReleaseNamesLocked();
  void GrantTurns();
  void Decide();
  bool Sequential() const;
  std::string MembersBelow(MemberStage stage) const;
  absl::Status Await(uint32_t member, bool decision);
  // Aborts with DEADLINE_EXCEEDED when no progress was seen for the timeout (true).
  bool ExpireLocked(bool decision);
  // Releases `lock` and runs the callbacks whose moment came meanwhile (OnTransfer's,
  // OnDecision's; OnAbort is a decision callback).
  void Unlock(std::unique_lock<std::mutex>& lock);

  const std::string group_;
  const uint32_t members_;
  const uint64_t version_;
  const absl::Duration timeout_;
  const size_t max_name_bytes_;
  const uint64_t id_;
  const DecisionRecorder record_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Member> m_;
  uint32_t staged_ = 0, prepared_ = 0;
  size_t name_bytes_ = 0;  // tensor names held (reserved or staged), every member together
  bool parts_checked_ = false;
  std::vector<bool> granted_;
  bool decided_ = false;
  absl::Status abort_;  // the decision when aborted
  int32_t failed_member_ = -1;
  int32_t slowest_member_ = -1;
  double coordination_seconds_ = 0;
  Clock::time_point last_progress_;
  struct Watch {
    uint32_t member = 0;
    bool decision = false;  // OnDecision's (else OnTransfer's)
    std::function<void(absl::Status)> fn;
  };
  std::vector<Watch> watches_;
};

}  // namespace wpub::group
