#include "tests/multi_gpu/shared_gpu.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace wpub::testing {
namespace {

// A host identity unique to this call: the process, the call and the clock, so that children of
// two test processes (or two runs) never collide.
std::string NewHostId() {
  static std::atomic<int> counter{0};
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return absl::StrCat("wpub-test-", ::getpid(), "-", counter.fetch_add(1), "-", ts.tv_nsec);
}

}  // namespace

int EngineGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return -1;
  if (const char* v = std::getenv("WPUB_TEST_ENGINE_GPU"); v != nullptr && *v != '\0') {
    int gpu = -1;
    if (absl::SimpleAtoi(v, &gpu) && gpu >= 0 && gpu < n) return gpu;
    std::fprintf(stderr, "WPUB_TEST_ENGINE_GPU=%s is not a visible device (0..%d); ignored\n", v,
                 n - 1);
  }
  return n >= 2 ? 1 : 0;
}

std::vector<std::string> OwnNcclHostEnv(bool shared) {
  if (!shared) return {};
  return {absl::StrCat("NCCL_HOSTID=", NewHostId()), "NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1"};
}

void AdoptOwnNcclHost(bool shared) {
  if (!shared) return;
  ::setenv("NCCL_HOSTID", NewHostId().c_str(), /*overwrite=*/0);
  ::setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  ::setenv("NCCL_IB_DISABLE", "1", 1);
}

}  // namespace wpub::testing
