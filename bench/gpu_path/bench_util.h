// Shared pieces of the GPU-path benchmarks (gpu_path_bench, fanout_bench): timed publications
// through a backend and transport, and plain NCCL broadcasts of the same bytes through a group
// formed the way engines join (the transfer limit). Programs, not tests: failures exit(1).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/gpu/gpu_backend.h"
#include "core/rendezvous/tcp_store_server.h"
#include "core/rollout/sglang_driver.h"
#include "core/transport/transport.h"
#include "nlohmann/json.hpp"
#include "tests/multi_gpu/moe_fixture.h"

#define BENCH_OK(expr)                                                                          \
  do {                                                                                          \
    const absl::Status s_ = (expr);                                                             \
    if (!s_.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, s_.ToString().c_str()); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace wpub::bench {

double Median(std::vector<double> v);

struct RunSettings {
  int iters = 3;  // timed runs after one warm-up
  uint64_t bucket_bytes = uint64_t{1} << 30;
  int nccl_ctas = 0;  // NcclCommOptions::ctas of the plain broadcasts' communicator
};

// One warm-up (group formation, buffer growth, NCCL lazy init) and `iters` timed publications of
// the model at `base` (device memory of this process, its parts marked so as ingestion marks
// CUDA IPC parts); the report row (median wall clock, device phases, GB/s, host syncs). The
// version counter advances by one per publication.
nlohmann::json RunWpub(const char* label, bool nvfp4, const RunSettings& run,
                       const testing::ModelLayout& layout, const uint8_t* base,
                       gpu::GpuBackend& backend, transport::Transport& transport, uint64_t* version,
                       uint64_t* bytes_out);

// Plain broadcasts of `bytes` in bucket-sized messages from GPU 0 through a group of its own:
// every engine joins through the SGLang driver (`/init_weights_update_group`), then each is
// asked to receive them with one request to `route` ({"group_name", "nbytes", "count"}) while
// rank 0 broadcasts back to back. The report row (median wall clock and device time, GB/s).
nlohmann::json RunPlainBroadcast(const char* label, uint64_t bytes, const RunSettings& run,
                                 const std::vector<rollout::EngineSpec>& engines,
                                 const std::string& route, rendezvous::TcpStoreServer& store,
                                 int generation);

}  // namespace wpub::bench
