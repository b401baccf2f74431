// wpubd's command-line flags, parsed once into validated option structs (flags live in
// server/ only; the core sees option structs).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/group/coordinator.h"
#include "core/rollout/gpu_path.h"
#include "server/service/daemon_server.h"
#include "server/service/group_service.h"

namespace wpub::wpubd {

inline constexpr int kMaxNcclCtas = 64;  // equals nccl::kMaxCtas

struct DaemonOptions {
  engine::EngineOptions engine;
  server::DaemonServerOptions server;
  // "host:port" of the Prometheus endpoint (port 0 picks one); empty disables it. Loopback
  // unless --insecure_listen.
  std::string metrics_listen = "127.0.0.1:9464";
  // Connections the metrics endpoint serves at once (MetricsServerOptions::threads).
  int metrics_threads = 16;
  // glibc malloc arenas, applied at startup (mallopt M_ARENA_MAX) unless MALLOC_ARENA_MAX is
  // in the environment; 0 keeps glibc's default of 8 per core, whose fragmentation grows RSS
  // with every publication.
  int malloc_arena_max = 2;
  // glibc's mmap threshold, fixed at startup (mallopt M_MMAP_THRESHOLD) unless
  // MALLOC_MMAP_THRESHOLD_ is in the environment; 0 keeps glibc's adaptive threshold, which
  // rises after the first large frees and leaves later buffers of that size in the heap.
  uint64_t malloc_mmap_threshold = uint64_t{1} << 20;
  // How long shutdown waits for an active publication before aborting it.
  absl::Duration drain_deadline = absl::Seconds(30);
  // How long the gRPC server then waits for RPCs to finish before cancelling them (gRPC also
  // waits this long for clients that keep idle channels open).
  absl::Duration shutdown_grace = absl::Seconds(1);
  // Written (atomically) once serving: {"grpc_port": N, "metrics_port": M, "pid": P}.
  std::string ready_file;
  std::string log_level = "info";
  std::string log_format = "text";  // text | json (cli/logging.h)
  // GPU path (wpubd built with CUDA and NCCL): the GPU backend, CUDA IPC ingestion and the
  // NCCL weight-update group. On with --gpu_path or --engines; off: the CPU backend and the
  // gRPC-pull transport only (ConnectEngines answers FAILED_PRECONDITION).
  bool gpu_path = false;
  // The initial SGLang engines, "http://host:port=gpus,..." (gpus defaults to 1); empty: none
  // until a trainer calls ConnectEngines.
  std::string engines;
  // Where the TCPStore rendezvous listens ("ip:port", port 0 picks one; loopback unless
  // --insecure_listen); parsed into gpu.store_bind_address and gpu.store_port.
  std::string nccl_store_listen = "127.0.0.1:0";
  // The GPU path's settings, declared (and defaulted) once in rollout::GpuPathOptions: the
  // device, the group name, the rendezvous addresses, the engines' deadline (request_timeout and
  // publication_deadline), their API key (engine_auth_token), requests in flight, compute SMs,
  // the overlap cap, NCCL CTAs. main fills in the parsed engine set and the non-finite check.
  rollout::GpuPathOptions gpu;
  // Publication groups: how long a round this daemon leads may go without progress, and how
  // this daemon reaches a leader when it is another member (token: --auth_token_file's, the
  // group's daemons share one; TLS to the leader when a CA is given).
  group::CoordinatorOptions group;
  std::string group_decision_log;  // opened by main into group.decisions
  server::GroupClientOptions group_client;
};

// Reads the parsed absl flags. INVALID_ARGUMENT naming the flag for a bad value;
// PERMISSION_DENIED for a non-loopback metrics address without --insecure_listen.
absl::StatusOr<DaemonOptions> OptionsFromFlags();

// Rewrites `--config=FILE` / `--config FILE` into absl's `--flagfile=FILE` (one flag per line,
// `--name=value`), keeping its position so later command-line flags override the file.
std::vector<std::string> RewriteConfigFlag(int argc, char** argv);

// Sets spdlog's level and pattern.
void ConfigureLogging(const DaemonOptions& options);

}  // namespace wpub::wpubd
