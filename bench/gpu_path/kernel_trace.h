// Kernel activity of this process, through CUPTI's activity API (libcupti is loaded with dlopen,
// so the benchmark links and runs where it is missing): every kernel's device, stream, grid,
// registers and device timestamps while a trace is on. Used by gpu_path_bench --kernel_trace to
// see what the publisher's GPU runs while a bucket is broadcast.
//
// One trace at a time per process (CUPTI's buffer callbacks carry no user data); Start and Stop
// from one thread. Tracing adds a little launch overhead: traced publications are extra ones,
// never the timed ones.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace wpub::bench {

struct TracedKernel {
  std::string name;
  uint32_t device = 0;
  uint32_t stream = 0;
  uint64_t start_ns = 0;  // device timestamps (CUPTI clock)
  uint64_t end_ns = 0;
  int32_t grid = 0;        // CTAs (x * y * z)
  int32_t block = 0;       // threads per CTA
  uint16_t registers = 0;  // per thread
  int32_t cluster = 0;     // CTAs per cluster (0: no clusters)
};

class KernelTrace {
 public:
  KernelTrace() = default;
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // Loads libcupti and enables concurrent-kernel records. False with *error when CUPTI is
  // missing or refuses, or another trace is on.
  bool Start(std::string* error);
  // Flushes and disables; returns the kernels seen since Start, by start time.
  std::vector<TracedKernel> Stop();

 private:
  bool on_ = false;
};

// What ran beside each broadcast: for every kernel whose name contains "nccl" on `device`, its
// duration and, per other kernel class (the first of "quantize", "amax", "checksum", "copy",
// "count" the kernel's name contains, else "other"), the summed time those kernels overlapped it.
struct BroadcastNeighbours {
  int broadcasts = 0;
  double mean_seconds = 0, min_seconds = 0, max_seconds = 0;
  int32_t grid = 0, block = 0, cluster = 0;
  uint16_t registers = 0;
  std::vector<std::pair<std::string, double>> overlap_seconds;  // per class, summed
};
BroadcastNeighbours SummarizeBroadcasts(const std::vector<TracedKernel>& kernels, uint32_t device);

}  // namespace wpub::bench
