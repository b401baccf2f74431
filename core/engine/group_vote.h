// A publication's vote in its group (docs/DESIGN.md, "Publication groups"): what a session whose
// header names a group (PublicationHeader::group) tells the group's leader and waits for. The
// leader's side is core/group (the coordinator of a version); a member other than the leader
// reaches it over gRPC (server/service/group_client.cc, declared in group_service.h). The
// engine sees only this interface.
//
// One vote per publication, driven by its Commit thread:
//   Join (at Open) -> Stage (inputs checked, buckets planned; blocks until the leader lets this
//   member transfer) -> the transfer -> Prepare (every receiver holds every bucket; blocks until
//   the leader decides) -> commit or abort.
// Fail may come from any thread at any time (the member's own failure, a cancellation); it
// wakes a blocked Stage or Prepare and tells the leader, which aborts the version everywhere.
// When the leader decides to abort while this member is elsewhere (ingesting, transferring),
// the vote calls the `on_abort` it was joined with, from its own thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/types.h"

namespace wpub::engine {

// Bounds of the names a group handles (a member's parts at the leader, the leader's declared
// manifest): each 1 to kMaxGroupTensorNameBytes bytes, at most kMaxGroupTensors names and
// kMaxGroupNameBytes bytes of names in all.
inline constexpr size_t kMaxGroupTensors = size_t{1} << 22;
inline constexpr size_t kMaxGroupTensorNameBytes = 1024;
inline constexpr size_t kMaxGroupNameBytes = size_t{256} << 20;

// What a member publishes, told to the leader once its inputs are checked.
struct StagedParts {
  std::vector<std::string> tensors;  // the input tensors' names
  // Only on the leader (member 0): the model's declared manifest, every tensor name the group
  // must publish exactly once (empty: no declaration; only duplicates are refused).
  std::vector<std::string> expected;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint32_t buckets = 0;
  bool engines = false;  // it sends to NCCL engines
};

// A member whose receivers hold every bucket.
struct PreparedParts {
  std::vector<std::string> receivers;  // the participants that acknowledged everything
  uint64_t bytes_out = 0;
  PhaseSeconds phases;
};

class GroupVote {
 public:
  virtual ~GroupVote() = default;
  // Blocks until the leader lets this member begin its transfer (OK) or the version is
  // aborted: INVALID_ARGUMENT naming the tensor and both members for a tensor two members
  // publish, or what is missing from the declared manifest; ABORTED / DEADLINE_EXCEEDED naming
  // the member at fault otherwise.
  virtual absl::Status Stage(const StagedParts& parts) = 0;
  // Blocks until the leader decided: OK to commit, or why the version aborts.
  virtual absl::Status Prepare(const PreparedParts& parts) = 0;
  // This member failed (or its publication ended before committing): tells the leader. Wakes
  // a blocked Stage / Prepare. Idempotent; no-op after the decision.
  virtual void Fail(const absl::Status& why) = 0;
  // Whether a member other than this one may have sent bytes of the version to receivers it
  // shares with this one (NCCL engines): on an abort the leader then leaves every engine
  // paused (dirty) instead of resuming it.
  virtual bool others_may_have_sent() const = 0;
  // The group as this member knows it (the leader: every member's part).
  virtual GroupSummary Summary() const = 0;
};

// Joins a publication to its group. Thread-safe.
class GroupJoiner {
 public:
  virtual ~GroupJoiner() = default;
  // Called by Engine::Open for a header with a group. `on_abort(why)` is called (from the
  // vote's thread, at most once) when the leader aborts the version before this member's
  // Stage or Prepare waits for it. Errors refuse the Open: FAILED_PRECONDITION naming both
  // versions for a member joining with another version than the group's, ALREADY_EXISTS for a
  // member index taken, UNAVAILABLE when the leader cannot be reached.
  virtual absl::StatusOr<std::unique_ptr<GroupVote>> Join(
      const PublicationHeader& header, std::function<void(absl::Status)> on_abort) = 0;
};

// INVALID_ARGUMENT naming the field (`group.members`, ...) for a group name that is empty, longer
// than 100 bytes or holds other than letters, digits, '_', '-', '.'; members outside
// [1, kMaxGroupMembers]; member >= members; no leader address for a member > 0 (or one longer
// than 256 bytes); a negative timeout; a publisher name longer than 256 bytes.
absl::Status ValidateGroupMembership(const GroupMembership& membership);

}  // namespace wpub::engine
