#include "core/common/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace wpub {

void ParallelFor(size_t n, int threads, const std::function<void(size_t)>& fn) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const size_t used = std::min<size_t>(static_cast<size_t>(threads), n);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < used; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

absl::Status ParallelForStatus(size_t n, int threads,
                               const std::function<absl::Status(size_t)>& fn) {
  std::mutex mu;
  absl::Status first;
  ParallelFor(n, threads, [&](size_t i) {
    absl::Status s = fn(i);
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu);
    if (first.ok()) first = std::move(s);
  });
  return first;
}

}  // namespace wpub
