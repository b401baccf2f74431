// Enforces the progress timeout of rounds no thread waits on. Round::AwaitTransfer and
// AwaitDecision abort a stalled round themselves; a member served by callbacks (the Group
// service's Join reactors: no thread per member stream) registers its round here instead, and
// one thread per watch calls Round::ExpireIfStalled when each round's time runs out.
//
// Thread-safe. The thread starts with the first round watched and stops in the destructor; a
// decided round is forgotten at its next check.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/group/round.h"

namespace wpub::group {

class StallWatch {
 public:
  StallWatch() = default;
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  // Checks `round` until it is decided (at once, then whenever its timeout says); a round
  // watched already is not added twice. Returns
  // RESOURCE_EXHAUSTED when the watch's thread cannot be started (the caller fails the member;
  // nothing is left behind).
  absl::Status Watch(std::shared_ptr<Round> round);
  // Rounds watched and not yet seen decided.
  size_t size() const;

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Round>> rounds_;
  bool added_ = false;  // a round came since the thread last looked
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace wpub::group
