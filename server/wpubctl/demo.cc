// `wpubctl demo`: the project's main job (`deploy/dev.sh demo`). Starts wpubd and two
// wpub-recv receivers as child processes on free loopback ports, publishes several versions of
// a synthetic GLM-like MoE through the whole path (policy, NVFP4 quantization on the CPU
// reference, buckets, gRPC-pull transport, checksummed acknowledgements, commit), shows that a
// bad publication is refused while the daemon keeps serving, prints a per-publication table and
// the daemon's metrics, then stops every process cleanly.
#include <signal.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <optional>

#include <httplib.h>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"
#include "server/client/child_process.h"
#include "server/wpubctl/model_flags.h"
#include "server/wpubctl/policy_flags.h"
#include "server/wpubctl/publish_common.h"
#include "server/wpubctl/subcommand.h"

ABSL_DECLARE_FLAG(std::optional<int>, num_layers);
ABSL_DECLARE_FLAG(std::optional<int>, first_k_dense);
ABSL_DECLARE_FLAG(std::optional<int>, num_experts);
ABSL_DECLARE_FLAG(std::optional<int64_t>, hidden_size);
ABSL_DECLARE_FLAG(std::optional<int64_t>, moe_intermediate_size);
ABSL_DECLARE_FLAG(std::optional<int64_t>, intermediate_size);
ABSL_DECLARE_FLAG(std::optional<int64_t>, vocab_size);

ABSL_FLAG(uint32_t, demo_versions, 3, "Versions the demo publishes.");
ABSL_FLAG(uint32_t, demo_receivers, 2, "wpub-recv processes the demo starts.");
ABSL_FLAG(std::string, wpubd_path, "",
          "wpubd binary (default: the build tree's, else the one beside wpubctl).");
ABSL_FLAG(std::string, recv_path, "",
          "wpub-recv binary (default: the build tree's, else the one beside wpubctl).");
ABSL_FLAG(std::string, demo_dir, "",
          "Directory for logs and the receivers' safetensors, kept afterwards (default: a fresh "
          "/tmp/wpub-demo-XXXXXX).");

namespace wpub::wpubctl {
namespace {

// Unless given, the demo uses a small GLM-like model (a few seconds on two CPU cores) rather
// than the full GLM-4.5 preset.
template <typename T, typename V>
void DefaultFlag(absl::Flag<std::optional<T>>* flag, V value) {
  if (!absl::GetFlag(*flag).has_value()) absl::SetFlag(flag, std::optional<T>(value));
}

// Returns true when the hidden size is the demo's (then attention is shrunk to match too, as
// the model flags have no head counts).
bool ApplyDemoModelDefaults() {
  const bool small = !absl::GetFlag(FLAGS_hidden_size).has_value();
  DefaultFlag(&FLAGS_num_layers, 4);
  DefaultFlag(&FLAGS_first_k_dense, 1);
  DefaultFlag(&FLAGS_num_experts, 16);
  DefaultFlag(&FLAGS_hidden_size, 512);
  DefaultFlag(&FLAGS_moe_intermediate_size, 256);
  DefaultFlag(&FLAGS_intermediate_size, 1024);
  DefaultFlag(&FLAGS_vocab_size, 8192);
  return small;
}

// The metric lines of interest from wpubd's Prometheus endpoint.
std::string ScrapeMetrics(int port) {
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(5);
  auto res = http.Get("/metrics");
  if (!res || res->status != 200) return "  (metrics endpoint unreachable)\n";
  std::string out;
  for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
    if (absl::StartsWith(line, "wpub_publications_total") ||
        absl::StartsWith(line, "wpub_last_committed_version") ||
        absl::StartsWith(line, "wpub_published_bytes_total") ||
        absl::StartsWith(line, "wpub_tensors_total") ||
        absl::StartsWith(line, "wpub_host_syncs_total") ||
        absl::StartsWith(line, "wpub_engines{")) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }
  return out;
}

absl::Status Demo() {
  const bool small = ApplyDemoModelDefaults();
  WPUB_ASSIGN_OR_RETURN(synthetic::ModelShape shape, ModelShapeFromFlags());
  if (small) {
    shape.num_attention_heads = 8;
    shape.num_key_value_heads = 2;
    shape.head_dim = 64;
  }
  WPUB_ASSIGN_OR_RETURN(synthetic::SyntheticModel model, synthetic::SyntheticModel::Create(shape));
  WPUB_ASSIGN_OR_RETURN(policy::PolicySettings settings, PolicySettingsFromFlags(model));
  WPUB_ASSIGN_OR_RETURN(client::StreamOptions stream, StreamOptionsFromFlags());

  // The build tree's layout, else beside wpubctl (`cmake --install`, the bundle's libexec/).
  const std::string exe_dir = client::ExecutableDir();
  const auto first_of = [](std::initializer_list<std::string> paths) {
    for (const std::string& p : paths) {
      if (std::filesystem::exists(p)) return p;
    }
    return *paths.begin();
  };
  std::string wpubd = absl::GetFlag(FLAGS_wpubd_path);
  if (wpubd.empty()) wpubd = first_of({exe_dir + "/../wpubd/wpubd", exe_dir + "/wpubd"});
  std::string recv = absl::GetFlag(FLAGS_recv_path);
  if (recv.empty()) {
    recv = first_of({exe_dir + "/../../clients/recv/wpub-recv", exe_dir + "/wpub-recv"});
  }
  for (const std::string& bin : {wpubd, recv}) {
    if (!std::filesystem::exists(bin)) {
      return absl::NotFoundError(absl::StrCat("binary '", bin,
                                              "' not found (build it, or pass "
                                              "--wpubd_path / --recv_path)"));
    }
  }
  std::string dir = absl::GetFlag(FLAGS_demo_dir);
  if (dir.empty()) {
    char tmpl[] = "/tmp/wpub-demo-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    dir = tmpl;
  } else {
    std::filesystem::create_directories(dir);
  }

  std::printf(
      "wpub demo: trainer -> wpubd -> policy -> NVFP4 (CPU reference) -> buckets -> %u "
      "receivers\n",
      absl::GetFlag(FLAGS_demo_receivers));
  std::printf(
      "model: %s, %d layers (%d dense), %d routed experts + %d shared, %d MTP; %lld "
      "tensors, %s per version\n",
      std::string(synthetic::NamingStyleName(shape.style)).c_str(), shape.num_layers,
      shape.first_k_dense, shape.num_experts, shape.num_shared_experts, shape.num_mtp_layers,
      static_cast<long long>(model.num_tensors()), HumanBytes(model.num_bytes()).c_str());
  std::printf("logs: %s\n\n", dir.c_str());

  const std::string ready = dir + "/wpubd.ready.json";
  WPUB_ASSIGN_OR_RETURN(auto daemon,
                        client::ChildProcess::Spawn(
                            {wpubd,
                             {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                              absl::StrCat("--ready_file=", ready),
                              absl::StrCat("--min_receivers=", absl::GetFlag(FLAGS_demo_receivers)),
                              "--commit_deadline=60s"},
                             dir + "/wpubd.log"}));
  WPUB_ASSIGN_OR_RETURN(client::DaemonPorts ports,
                        client::WaitForReadyFile(ready, daemon.get(), absl::Seconds(20)));
  const std::string target = absl::StrCat("127.0.0.1:", ports.grpc_port);
  std::printf("wpubd pid %d: gRPC %s, metrics http://127.0.0.1:%d/metrics\n", daemon->pid(),
              target.c_str(), ports.metrics_port);

  std::vector<std::unique_ptr<client::ChildProcess>> receivers;
  for (uint32_t i = 0; i < absl::GetFlag(FLAGS_demo_receivers); ++i) {
    const std::string name = absl::StrCat("recv-", i);
    WPUB_ASSIGN_OR_RETURN(auto proc,
                          client::ChildProcess::Spawn(
                              {recv,
                               {absl::StrCat("--target=", target), absl::StrCat("--name=", name),
                                absl::StrCat("--output=", dir, "/", name, ".safetensors")},
                               absl::StrCat(dir, "/", name, ".log")}));
    std::printf("wpub-recv '%s' pid %d\n", name.c_str(), proc->pid());
    receivers.push_back(std::move(proc));
  }

  client::ClientOptions client_options;
  client_options.target = target;
  WPUB_ASSIGN_OR_RETURN(auto client, client::PublisherClient::Create(client_options));
  // Wait until every receiver subscribed (they take part from the next publication on).
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (true) {
    WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse s, client->GetStatus());
    if (s.receivers_size() >= static_cast<int>(receivers.size())) break;
    if (absl::Now() > deadline) return absl::DeadlineExceededError("receivers did not subscribe");
    absl::SleepFor(absl::Milliseconds(50));
  }

  std::printf("\n%s", ReportTableHeader().c_str());
  uint64_t last = 0;
  for (uint32_t v = 1; v <= absl::GetFlag(FLAGS_demo_versions); ++v) {
    absl::StatusOr<wpub::v1::PublicationReport> report =
        client->Publish(HeaderFromSettings(model, settings, v), model.batches(),
                        client::SyntheticFiller(DataSeed(v)), stream);
    if (!report.ok()) return report.status();
    std::printf("%s", ReportTableRow(*report).c_str());
    std::fflush(stdout);
    if (report->status() == wpub::v1::PUBLICATION_STATUS_COMMITTED) last = v;
  }

  // A bad publication: a version that does not increase. Refused, nothing changes.
  absl::StatusOr<wpub::v1::PublicationReport> stale =
      client->Publish(HeaderFromSettings(model, settings, 1), model.batches(),
                      client::SyntheticFiller(DataSeed(1)), stream);
  std::printf("\nre-publishing v1: %s\n",
              stale.ok() ? "unexpectedly accepted" : stale.status().ToString().c_str());

  WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse status, client->GetStatus());
  std::printf("daemon still serving: committed v%llu, %d receivers\n",
              static_cast<unsigned long long>(status.committed_version()), status.receivers_size());
  for (const auto& r : status.receivers()) {
    std::printf("  %-8s %-9s last committed v%llu\n", r.name().c_str(), r.state().c_str(),
                static_cast<unsigned long long>(r.last_committed_version()));
  }
  std::printf("\nmetrics:\n%s", ScrapeMetrics(ports.metrics_port).c_str());

  // Stop the receivers, then the daemon (SIGTERM: graceful shutdown, exit 0).
  std::printf("\nreceivers' files:\n");
  for (size_t i = 0; i < receivers.size(); ++i) {
    const int code = receivers[i]->Stop();
    const std::string path = absl::StrCat(dir, "/recv-", i, ".safetensors");
    absl::StatusOr<std::unique_ptr<safetensors::Reader>> file = safetensors::Reader::Open(path);
    if (file.ok()) {
      const auto version = (*file)->metadata().find("version");
      std::printf("  %s: version %s, %zu tensors (exit %d)\n", path.c_str(),
                  version == (*file)->metadata().end() ? "?" : version->second.c_str(),
                  (*file)->tensors().size(), code);
    } else {
      std::printf("  %s: %s (exit %d)\n", path.c_str(), file.status().ToString().c_str(), code);
    }
  }
  const int daemon_code = daemon->Stop(absl::Seconds(40));
  std::printf("wpubd stopped (exit %d)\n", daemon_code);
  // The files stay: the receivers' versions, wpubd's and the receivers' logs.
  std::printf(
      "\nthe demo's files are kept in %s (`wpubctl inspect %s/recv-0.safetensors` lists "
      "what a receiver holds)\n",
      dir.c_str(), dir.c_str());
  if (daemon_code != 0) return absl::InternalError("wpubd did not exit cleanly");
  if (last != absl::GetFlag(FLAGS_demo_versions) || status.committed_version() != last) {
    return absl::InternalError("not every version committed");
  }
  return absl::OkStatus();
}

}  // namespace

int RunDemo(const std::vector<std::string>& /*args*/) {
  absl::Status status = Demo();
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl demo: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace wpub::wpubctl
