// wpub-recv: a native receiver process. Subscribes to a wpubd, pulls and verifies every
// bucket, keeps the last committed version in memory and optionally writes it as safetensors.
// SIGTERM/SIGINT stop it cleanly (exit 0).
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "clients/recv/receiver.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50151",
          "wpubd gRPC address; for a publication group, every member's address, comma-separated "
          "(the receiver subscribes to each and applies a version once it holds every member's "
          "part).");
ABSL_FLAG(std::string, name, "recv-0", "Receiver name (unique per daemon).");
ABSL_FLAG(std::string, output, "",
          "Write every committed version to this safetensors file (atomically replaced; staged "
          "beside it and fsynced before the last bucket is acknowledged; its directory must be "
          "writable at start). A version in an existing file's metadata is the version held.");
ABSL_FLAG(uint64_t, exit_after_versions, 0, "Exit 0 after this many commits (0: run forever).");
ABSL_FLAG(uint64_t, chunk_bytes, 0, "PullBucket chunk size (0: the daemon's limit).");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(10), "How long to wait for wpubd.");
ABSL_FLAG(absl::Duration, resubscribe_timeout, absl::Minutes(5),
          "When wpubd goes away (restart, crash), how long to keep subscribing again, holding "
          "the last committed version (0: exit at once).");
ABSL_FLAG(std::string, auth_token_file, "", "File holding the daemon's bearer token.");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA certificate the daemon's TLS certificate must chain to (TLS; empty: plaintext).");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate for a daemon that verifies clients (with --tls_key_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(int64_t, leave_after_buckets, -1,
          "Testing: leave mid-publication after pulling this many buckets (-1: never).");
ABSL_FLAG(int64_t, corrupt_bucket, -1,
          "Testing: corrupt bucket N of every publication after pulling it (-1: never).");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or critical.");
ABSL_FLAG(std::string, engine_listen, "",
          "NCCL data path: serve SGLang's weight-update routes on host:port and receive over the "
          "publisher's NCCL group (wpubd --engines=http://host:port) instead of pulling.");
ABSL_FLAG(int32_t, gpu_device, 0, "NCCL data path: the CUDA device to receive on.");
ABSL_FLAG(std::vector<std::string>, gpu_devices, {},
          "NCCL data path: several CUDA devices, one group rank each (an engine with TP ranks: "
          "rank_offset + i); overrides --gpu_device.");

ABSL_FLAG(int32_t, nccl_ctas, 0,
          "NCCL data path: NCCL channels (CTAs) of every rank's communicator, in [0, 64]; 0: "
          "NCCL's choice. Must equal the publisher's (wpubd --nccl_ctas), else NCCL fails the "
          "broadcasts.");

#ifdef WPUB_WITH_GPU_PATH
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "clients/recv/nccl/receiver_endpoint.h"
#include "clients/recv/safetensors.h"
#include "core/nccl/nccl_comm.h"

namespace {

// The NCCL data path: an SGLang-compatible endpoint; every version announced with
// /update_weight_version is kept in memory and written to --output when given.
int RunEngineEndpoint(const sigset_t& signals) {
  const std::string listen = absl::GetFlag(FLAGS_engine_listen);
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port)) {
    std::fprintf(stderr, "wpub-recv: --engine_listen '%s' is not host:port\n", listen.c_str());
    return 2;
  }
  std::mutex mu;
  std::map<std::string, std::pair<wpub::TensorDesc, std::vector<uint8_t>>> tensors;
  const std::string output = absl::GetFlag(FLAGS_output);
  wpub::nccl::ReceiverEndpoint::Callbacks cb;
  cb.on_bucket = [&](const wpub::nccl::ReceivedBucket& b) {
    std::lock_guard lock(mu);
    for (const auto& t : b.tensors) {
      if (b.bytes.empty()) break;  // checksummed on the device only (no --output)
      tensors[t.name] = {
          wpub::TensorDesc{t.name, t.dtype, t.shape},
          std::vector<uint8_t>(b.bytes.begin() + t.offset, b.bytes.begin() + t.offset + t.nbytes)};
    }
    spdlog::info("version {} bucket {}: {} tensors, checksum {:016x}", b.version, b.index,
                 b.tensors.size(), b.checksum);
  };
  cb.on_version = [&](const std::string& v) {
    std::lock_guard lock(mu);
    spdlog::info("version {} applied ({} tensors)", v, tensors.size());
    if (output.empty()) return;
    std::vector<wpub::recv::SafetensorsEntry> entries;
    for (const auto& [name, t] : tensors) entries.push_back({t.first, t.second});
    if (absl::Status s = wpub::recv::WriteSafetensors(output, entries, {{"version", v}}); !s.ok()) {
      spdlog::error("{}", s.ToString());
    }
  };
  wpub::nccl::ReceiverEndpointOptions o;
  o.host = listen.substr(0, colon);
  o.port = port;
  o.devices = {absl::GetFlag(FLAGS_gpu_device)};
  if (const std::vector<std::string> list = absl::GetFlag(FLAGS_gpu_devices); !list.empty()) {
    o.devices.clear();
    for (const std::string& d : list) {
      int device = 0;
      if (!absl::SimpleAtoi(d, &device) || device < 0) {
        std::fprintf(stderr, "wpub-recv: --gpu_devices entry '%s' is not a device number\n",
                     d.c_str());
        return 2;
      }
      o.devices.push_back(device);
    }
  }
  // Without --output the bytes are only verified: checksum on the device, nothing copied back.
  o.copy_to_host = !output.empty();
  o.nccl_ctas = absl::GetFlag(FLAGS_nccl_ctas);
  if (absl::Status s = wpub::nccl::CheckCtas(o.nccl_ctas, "--nccl_ctas"); !s.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  auto endpoint = wpub::nccl::ReceiverEndpoint::Start(o, std::move(cb));
  if (!endpoint.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", endpoint.status().ToString().c_str());
    return 2;
  }
  spdlog::info("serving the weight-update routes on {}:{} (GPUs {})", o.host, (*endpoint)->port(),
               absl::StrJoin(o.devices, ","));
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("received {}: stopping", strsignal(sig));
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A file-size limit (RLIMIT_FSIZE) then fails the write with EFBIG, which is reported, instead
  // of killing the process.
  signal(SIGXFSZ, SIG_IGN);

  absl::SetProgramUsageMessage(
      "wpub-recv: receive publications from wpubd.\n"
      "Usage: wpub-recv --target=127.0.0.1:50151 --name=recv-0 "
      "[--output=model.safetensors]");
  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [wpub-recv] %v");
  if (!absl::GetFlag(FLAGS_engine_listen).empty()) {
#ifdef WPUB_WITH_GPU_PATH
    return RunEngineEndpoint(signals);
#else
    std::fprintf(stderr, "wpub-recv: --engine_listen needs a build with CUDA and NCCL\n");
    return 2;
#endif
  }

  wpub::recv::ReceiverOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  if (options.target.find(',') != std::string::npos) {
    for (absl::string_view t : absl::StrSplit(options.target, ',', absl::SkipWhitespace())) {
      options.targets.emplace_back(absl::StripAsciiWhitespace(t));
    }
  }
  options.name = absl::GetFlag(FLAGS_name);
  options.output_path = absl::GetFlag(FLAGS_output);
  options.exit_after_versions = absl::GetFlag(FLAGS_exit_after_versions);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  options.resubscribe_timeout = absl::GetFlag(FLAGS_resubscribe_timeout);
  options.leave_after_buckets = absl::GetFlag(FLAGS_leave_after_buckets);
  options.corrupt_bucket = absl::GetFlag(FLAGS_corrupt_bucket);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    options.auth_token = std::string(absl::StripAsciiWhitespace(ss.str()));
    if (!in || options.auth_token.empty()) {
      std::fprintf(stderr, "wpub-recv: --auth_token_file '%s' is unreadable or empty\n",
                   path.c_str());
      return 2;
    }
  }
  absl::StatusOr<std::unique_ptr<wpub::recv::Receiver>> receiver =
      wpub::recv::Receiver::Create(options);
  if (!receiver.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", receiver.status().ToString().c_str());
    return 2;
  }
  // The signal thread only calls Stop; it is detached because it may still be waiting in
  // sigwait when Run returns on its own, and the process then simply exits.
  std::thread([&signals, r = receiver->get()] {
    int sig = 0;
    sigwait(&signals, &sig);
    spdlog::info("received {}: stopping", strsignal(sig));
    r->Stop();
  }).detach();
  absl::Status status = (*receiver)->Run();
  const wpub::recv::ReceiverStats stats = (*receiver)->stats();
  spdlog::info("done: {} commits, {} aborts, {} buckets, {} checksum mismatches, last v{}",
               stats.commits, stats.aborts, stats.buckets, stats.checksum_mismatches,
               stats.last_committed_version);
  if (!status.ok()) {
    spdlog::error("{}", status.ToString());
    return absl::IsAborted(status) ? 3 : 1;
  }
  return 0;
}
