#include "core/group/stall_watch.h"

#include <algorithm>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace wpub::group {

StallWatch::~StallWatch() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status StallWatch::Watch(std::shared_ptr<Round> round) {
  std::lock_guard lock(mu_);
  if (!thread_.joinable()) {
    try {
      thread_ = std::thread([this] { Run(); });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no thread to watch group rounds' timeouts: ", e.what()));
    }
  }
  // Every member of a round registers it: it is checked once.
  if (std::find(rounds_.begin(), rounds_.end(), round) != rounds_.end()) return absl::OkStatus();
  rounds_.push_back(std::move(round));
  added_ = true;
  cv_.notify_all();
  return absl::OkStatus();
}

size_t StallWatch::size() const {
  std::lock_guard lock(mu_);
  return rounds_.size();
}

void StallWatch::Run() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    added_ = false;
    std::vector<std::shared_ptr<Round>> rounds = rounds_;
    lock.unlock();
    // Checked without the lock: an expiring round runs its callbacks (the members' reactors).
    absl::Duration next = absl::InfiniteDuration();
    std::vector<const Round*> decided;
    for (const std::shared_ptr<Round>& r : rounds) {
      const absl::Duration left = r->ExpireIfStalled();
      if (left == absl::InfiniteDuration()) {
        decided.push_back(r.get());
      } else {
        next = std::min(next, left);
      }
    }
    rounds.clear();
    lock.lock();
    std::erase_if(rounds_, [&](const std::shared_ptr<Round>& r) {
      return std::find(decided.begin(), decided.end(), r.get()) != decided.end();
    });
    // A round's progress moves its deadline later only, so waking at the earliest one found
    // is never late; a new round is checked at once.
    const auto woken = [&] { return stop_ || added_; };
    if (next == absl::InfiniteDuration()) {
      cv_.wait(lock, woken);
    } else {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(next + absl::Milliseconds(1)), woken);
    }
  }
}

}  // namespace wpub::group
