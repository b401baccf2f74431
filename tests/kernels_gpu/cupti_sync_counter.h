// An independent count of CUDA runtime calls made by the code under test, observed through a
// CUPTI callback subscriber (libcupti is loaded with dlopen so the test binary links and skips
// cleanly on machines without it). Used to prove that a launcher never synchronizes the host.
//
// Not thread-safe across instances: CUPTI allows one subscriber per process, so at most one
// SyncCounter may be Started at a time. Counting itself is thread-safe (atomic counters and a
// mutex-guarded name list).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>

namespace wpub::kernels::cuda::testing {

class SyncCounter {
 public:
  SyncCounter() = default;
  ~SyncCounter();
  SyncCounter(const SyncCounter&) = delete;
  SyncCounter& operator=(const SyncCounter&) = delete;

  // Loads libcupti and subscribes to the runtime API domain. Returns false with *error set when
  // CUPTI is unavailable or refuses the subscription.
  bool Start(std::string* error);
  // Unsubscribes; counts stay readable.
  void Stop();

  // Calls whose name is on the synchronizing list (device/stream/event synchronize, blocking
  // copies and memsets, allocation and free, which synchronize implicitly).
  int synchronizing_calls() const { return sync_calls_.load(); }
  int total_calls() const { return total_calls_.load(); }
  // Every runtime API function seen, with its call count ("cudaLaunchKernel" -> 3).
  std::map<std::string, int> calls_by_name() const;
  // Names of the synchronizing calls seen, comma-separated (for failure messages).
  std::string SynchronizingCallNames() const;

  static bool IsSynchronizing(const std::string& function_name);

  // Called from the CUPTI callback on every runtime API entry.
  void RecordCall(const char* function_name);

 private:
  void* lib_ = nullptr;
  void* subscriber_ = nullptr;
  std::atomic<int> sync_calls_{0};
  std::atomic<int> total_calls_{0};
  mutable std::mutex mu_;
  std::map<std::string, int> by_name_;
};

}  // namespace wpub::kernels::cuda::testing
