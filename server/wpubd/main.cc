// wpubd: the weight-publication daemon. Parses flags into validated option structs, serves
// metrics on their own port, hosts the gRPC services over one engine, and shuts down in order
// on SIGTERM/SIGINT: health NOT_SERVING, drain (finish or abort the active publication within
// --drain_deadline), stop the gRPC server, then the engine. Exits 0 after a clean shutdown.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cli/build_info.h"
#include "cli/command_line.h"
#include "core/engine/engine.h"
#include "core/metrics/collectors.h"
#include "core/metrics/metrics.h"
#include "server/common/log_escape.h"
#include "server/service/daemon_server.h"
#include "server/wpubd/metrics_server.h"
#include "server/wpubd/options.h"
#ifdef WPUB_WITH_GPU_PATH
#include "absl/strings/numbers.h"
#include "core/nccl/nccl_comm.h"
#include "core/rollout/gpu_path.h"
static_assert(wpub::wpubd::kMaxNcclCtas == wpub::nccl::kMaxCtas);
#endif

namespace {

// The engine: with --gpu_path (or --engines), the GPU backend and the NCCL weight-update
// group as its components (core/rollout/gpu_path.h), engines given now or later through
// ConnectEngines; otherwise the CPU backend and the pull transport.
absl::StatusOr<std::unique_ptr<wpub::engine::Engine>> CreateEngine(
    const wpub::wpubd::DaemonOptions& options, wpub::engine::EngineObserver* observer,
    wpub::engine::GroupJoiner* group_joiner) {
  if (!options.gpu_path) {
    wpub::engine::EngineComponents components;
    components.group_joiner = group_joiner;
    return wpub::engine::Engine::Create(options.engine, observer, std::move(components));
  }
#ifdef WPUB_WITH_GPU_PATH
  wpub::rollout::GpuPathOptions g = options.gpu;
  if (!options.engines.empty()) {
    absl::StatusOr<std::vector<wpub::rollout::EngineSpec>> specs =
        wpub::rollout::ParseEngineSpecs(options.engines);
    if (!specs.ok()) return specs.status();
    g.engines = *std::move(specs);
  }
  g.reject_non_finite_before_send = !options.server.service.allow_non_finite;
  g.retain = options.engine.retain.where;
  absl::StatusOr<wpub::engine::EngineComponents> components =
      wpub::rollout::MakeGpuPathComponents(g);
  if (!components.ok()) return components.status();
  components->group_joiner = group_joiner;
  return wpub::engine::Engine::Create(options.engine, observer, *std::move(components));
#else
  return absl::FailedPreconditionError(
      "--gpu_path/--engines need the GPU path: this wpubd was built without CUDA/NCCL");
#endif
}

// Blocks SIGTERM/SIGINT in this thread before any other thread exists, so every thread the
// process creates inherits the mask and only the main thread's sigwait receives them.
sigset_t BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Bounds glibc's malloc arenas before any thread exists (arenas are made as threads first
// contend): with the default of 8 per core, each RPC thread's arena keeps freed pages, and
// RSS grows with every publication. Fixes the mmap threshold: glibc's adaptive one rises to
// the size of the first large buffer freed, after which buffers of that size (chunks, small
// buckets) come from the heap and their pages may stay there (RSS of the soak test moved by up
// to 14 MiB over 100 publications with it, by at most 2 MiB with 1 MiB fixed). The
// environment's MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_, which glibc reads itself, win over
// the flags.
void ConfigureAllocator(int arena_max, uint64_t mmap_threshold) {
  if (const char* env = std::getenv("MALLOC_ARENA_MAX"); env != nullptr) {
    spdlog::info("malloc arenas: MALLOC_ARENA_MAX={} from the environment",
                 wpub::server::LogEscape(env));
  } else if (arena_max != 0 && mallopt(M_ARENA_MAX, arena_max) != 1) {
    spdlog::warn("mallopt(M_ARENA_MAX, {}) failed; glibc's default arena count stays", arena_max);
  }
  if (const char* env = std::getenv("MALLOC_MMAP_THRESHOLD_"); env != nullptr) {
    spdlog::info("malloc mmap threshold: MALLOC_MMAP_THRESHOLD_={} from the environment",
                 wpub::server::LogEscape(env));
  } else if (mmap_threshold != 0 &&
             mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) {
    spdlog::warn("mallopt(M_MMAP_THRESHOLD, {}) failed; glibc's adaptive threshold stays",
                 mmap_threshold);
  }
}

bool WriteReadyFile(const std::string& path, int grpc_port, int metrics_port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"grpc_port\": " << grpc_port << ", \"metrics_port\": " << metrics_port
        << ", \"pid\": " << getpid() << "}\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

int Run(const wpub::wpubd::DaemonOptions& options, const sigset_t& signals) {
  using wpub::server::LogEscape;
  auto registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<wpub::wpubd::MetricsServer> metrics;
  int metrics_port = 0;
  if (!options.metrics_listen.empty()) {
    wpub::wpubd::MetricsServerOptions m;
    m.listen = options.metrics_listen;
    m.threads = options.metrics_threads;
    m.auth_token = options.server.service.auth_token;
    absl::StatusOr<std::unique_ptr<wpub::wpubd::MetricsServer>> created =
        wpub::wpubd::MetricsServer::Create(m, registry);
    if (!created.ok()) {
      spdlog::critical("cannot serve metrics: {}", LogEscape(created.status().ToString()));
      return 1;
    }
    metrics = *std::move(created);
    metrics_port = metrics->port();
  }

  // Publication groups: the rounds this daemon leads, and how its publications join theirs.
  // Both outlive the engine and the server (declared before them).
  wpub::group::CoordinatorOptions group_options = options.group;
  if (!options.group_decision_log.empty()) {
    absl::StatusOr<std::unique_ptr<wpub::group::DecisionLog>> log =
        wpub::group::DecisionLog::Open(options.group_decision_log);
    if (!log.ok()) {
      spdlog::critical("--group_decision_log: {}", LogEscape(log.status().ToString()));
      return 1;
    }
    spdlog::info("group decisions recorded in {} ({} kept from before)",
                 LogEscape(options.group_decision_log), (*log)->size());
    group_options.decisions = *std::move(log);
  }
  wpub::group::Coordinator coordinator(group_options, registry.get());
  wpub::server::GroupJoinerImpl group_joiner(&coordinator, options.group_client);
  absl::StatusOr<std::unique_ptr<wpub::metrics::EngineMetrics>> engine_metrics =
      wpub::metrics::EngineMetrics::Create(registry.get());
  if (!engine_metrics.ok()) {
    spdlog::critical("cannot register the metrics: {}",
                     LogEscape(engine_metrics.status().ToString()));
    return 1;
  }
  absl::StatusOr<std::unique_ptr<wpub::engine::Engine>> engine =
      CreateEngine(options, engine_metrics->get(), &group_joiner);
  if (!engine.ok()) {
    spdlog::critical("cannot create the engine: {}", LogEscape(engine.status().ToString()));
    return 1;
  }
  absl::StatusOr<std::unique_ptr<wpub::server::DaemonServer>> server =
      wpub::server::DaemonServer::Create(options.server, engine->get(), &coordinator);
  if (!server.ok()) {
    // "cannot listen on '<address>': <reason>" when the address cannot be bound.
    spdlog::critical("cannot start the gRPC server: {}", LogEscape(server.status().ToString()));
    return 1;
  }
  // The scrape-time series: the build, the process, the live state (core/metrics/collectors.h).
  const wpub::cli::BuildInfo& build = wpub::cli::Build();
  prometheus::BuildGauge()
      .Name("wpub_build_info")
      .Help("1, labelled with the build's version and what it was built against")
      .Register(*registry)
      .Add({{"version", build.version},
            {"cuda", build.cuda},
            {"nccl", build.nccl},
            {"grpc", build.grpc},
            {"backend", (*engine)->GetStatus().backend}})
      .Set(1);
  auto status_collector = std::make_shared<wpub::metrics::StatusCollector>(
      [e = engine->get()] { return e->GetStatus(); });
  if (metrics != nullptr) {
    metrics->AddCollectable(std::make_shared<wpub::metrics::ProcessCollector>());
    metrics->AddCollectable(status_collector);
  }
  spdlog::info("wpubd serving gRPC on {} (port {}), metrics on {} (port {})", options.server.listen,
               (*server)->port(), options.metrics_listen, metrics_port);
  // systemd (Type=notify): ready once every listener is bound. No-op without NOTIFY_SOCKET.
  sd_notify(0, "READY=1");
  if (!options.ready_file.empty() &&
      !WriteReadyFile(options.ready_file, (*server)->port(), metrics_port)) {
    spdlog::critical("cannot write --ready_file '{}'", options.ready_file);
    return 1;
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}: shutting down (drain deadline {})", strsignal(signal_number),
               absl::FormatDuration(options.drain_deadline));
  sd_notify(0, "STOPPING=1");

  // Ordered shutdown: stop advertising, refuse new publications, let the active one finish or
  // abort it at the deadline (this also ends every receiver stream), then stop the gRPC server
  // and finally the engine.
  (*server)->SetServing(false);
  (*engine)->BeginShutdown();
  const absl::Time drain_deadline = absl::Now() + options.drain_deadline;
  // Let the active publication finish (or reach the deadline) before draining; the core
  // still delivers every event queued before the drain, so receivers see its commit or abort.
  while ((*engine)->GetStatus().active.has_value() && absl::Now() < drain_deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::Status drained = (*engine)->Drain(drain_deadline);
  if (!drained.ok()) spdlog::warn("drain: {}", LogEscape(drained.ToString()));
  group_joiner.Shutdown();  // a vote in doubt stops asking its leader
  (*server)->Shutdown(absl::Now() + options.shutdown_grace);
  spdlog::debug("gRPC server stopped");
  server->reset();
  status_collector->Detach();  // a scrape from now on reads no engine
  engine->reset();
  spdlog::info("wpubd stopped");
  // The metrics endpoint needs no orderly teardown (its pool would wait out an idle
  // connection's keep-alive): leave it to the process exit.
  spdlog::shutdown();
  std::fflush(nullptr);
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t signals = BlockShutdownSignals();
  // The daemon's own flags (declared in server/wpubd/), none of another binary's.
  wpub::cli::Command command;
  command.program = command.name = "wpubd";
  command.summary =
      "wpubd: publishes model weights from an RL trainer to its rollout engines (a sidecar per "
      "training node). Trainers publish over gRPC (--listen); receivers pull or engines receive "
      "over NCCL (--gpu_path, --engines); Prometheus scrapes --metrics_listen.\n"
      "--config=FILE reads flags from FILE, one per line (as --flagfile).";
  command.flags = wpub::cli::FlagsDefinedIn("server/wpubd/");
  std::vector<std::string> args = wpub::wpubd::RewriteConfigFlag(argc, argv);
  args.erase(args.begin());
  const wpub::cli::Parsed parsed = wpub::cli::Parse(command, args);
  if (parsed.exit_code >= 0) return parsed.exit_code;
  absl::StatusOr<wpub::wpubd::DaemonOptions> options = wpub::wpubd::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "wpubd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  wpub::wpubd::ConfigureLogging(*options);
  ConfigureAllocator(options->malloc_arena_max, options->malloc_mmap_threshold);
  return Run(*options, signals);
}
