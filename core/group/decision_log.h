// The decisions of the group rounds a daemon led (docs/DESIGN.md, "One decision per version"):
// what a member that voted prepared and lost its link asks for (Group.Outcome), kept in memory
// and, with a path, in a file that survives the leader's restart.
//
// A commit is recorded -- appended and flushed to the file with fdatasync -- BEFORE any member
// hears of it (Round calls Record from its decision). So a leader that finds no record of a
// round it led never announced that round's commit: with a file it answers "aborted" for a
// round it does not know (presumed abort); without one, only for rounds of its own process.
//
// The file: one JSON object per line ({"group", "version", "round", "commit", "code",
// "reason"}), the newest last; rewritten (to a temporary file, fsynced, renamed) to the newest
// `capacity` entries when it holds twice that. A line that does not parse -- the torn tail of
// a write the daemon died in -- is skipped (it was never flushed, so never announced).
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wpub::group {

// One round's decision.
struct RoundDecision {
  std::string group;
  uint64_t version = 0;
  uint64_t round = 0;  // Round::id()
  bool commit = false;
  absl::StatusCode code = absl::StatusCode::kOk;  // the abort's
  std::string reason;                             // the abort's (bounded, 1 KiB)
};

// Decisions kept (in memory and, after compaction, in the file).
inline constexpr size_t kDecisionsKept = 1024;

class DecisionLog {
 public:
  // In memory only.
  DecisionLog();
  // Reads `path` (created when absent; its directory must exist) and appends to it from then
  // on. FAILED_PRECONDITION naming the path when it cannot be opened, read or written.
  static absl::StatusOr<std::unique_ptr<DecisionLog>> Open(const std::string& path,
                                                           size_t capacity = kDecisionsKept);
  ~DecisionLog();
  DecisionLog(const DecisionLog&) = delete;
  DecisionLog& operator=(const DecisionLog&) = delete;

  // Records `d`; with a file, returns once it is on disk (INTERNAL naming the path otherwise:
  // the caller must not announce a commit it could not record).
  absl::Status Record(RoundDecision d);
  // The decision of round `round`, when recorded and still kept.
  std::optional<RoundDecision> Find(uint64_t round) const;
  // Whether decisions survive a restart (a file backs the log).
  bool durable() const { return !path_.empty(); }
  size_t size() const;

 private:
  DecisionLog(std::string path, size_t capacity);
  void KeepLocked(RoundDecision d);
  absl::Status CompactLocked();

  const std::string path_;  // empty: in memory only
  const size_t capacity_ = kDecisionsKept;
  mutable std::mutex mu_;
  std::deque<RoundDecision> kept_;  // newest last, at most capacity_
  size_t lines_ = 0;                // lines in the file
  int fd_ = -1;                     // the file, open for appending (replaced by compaction)
};

}  // namespace wpub::group
