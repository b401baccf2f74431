// wpub-recv: a native receiver process. Subscribes to a wpubd, pulls and verifies every
// bucket, keeps the last committed version in memory and optionally writes it as safetensors.
// SIGTERM/SIGINT stop it cleanly (exit 0).
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/bytes.h"
#include "cli/command_line.h"
#include "cli/logging.h"
#include "cli/secret_file.h"
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
ABSL_FLAG(wpub::cli::Bytes, chunk_bytes, 0, "PullBucket chunk size (0: the daemon's limit).");
ABSL_FLAG(bool, patches, true,
          "Accept bucket patches from a daemon that offers them (wpubd --patches): for a version "
          "after the one held in memory only the changed 16-bit units of each bucket are pulled, "
          "the bucket rebuilt and checked against the whole bucket's checksum (the buckets of "
          "the version before last are kept to build it in).");
ABSL_FLAG(int32_t, patch_threads, 8,
          "Threads that rebuild a bucket from a patch (the copy of the base, the result's "
          "checksum); <= 0: one per hardware thread.");
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
ABSL_FLAG(std::string, log_format, "text", "text or json (one JSON object per line).");
ABSL_FLAG(std::string, engine_listen, "",
          "NCCL data path: serve SGLang's weight-update routes on host:port and receive over the "
          "publisher's NCCL group (wpubd --engines=http://host:port) instead of pulling.");
ABSL_FLAG(std::string, engine_protocol, "sglang",
          "NCCL data path: the engine protocol --engine_listen serves: sglang (SGLang's "
          "weight-update routes; wpubd --engines=http://host:port) or vllm (vLLM's "
          "weight-transfer routes and rendezvous, v0.22+; wpubd --engines=vllm+http://host:port).");
ABSL_FLAG(bool, vllm_packing_in_init, true,
          "--engine_protocol=vllm: take the packing fields in init_info (vLLM v0.28+); false "
          "behaves as v0.22-v0.27 (refused at init, taken per update).");
ABSL_FLAG(bool, engine_patches, false,
          "NCCL data path, --engine_protocol=sglang: keep every bucket received on the GPU(s), as "
          "an engine keeps its weights, and take format 3 bucket patches against them from a "
          "daemon started with --patches (its probe reads \"wpub_bucket_patches\" from "
          "/server_info). Not with --output.");
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
#include "clients/recv/nccl/vllm_nccl_path.h"
#include "clients/recv/safetensors.h"
#include "clients/recv/vllm_engine.h"
#include "core/nccl/nccl_comm.h"

namespace {

// --engine_listen, --gpu_device(s), --nccl_ctas into *o; false (after saying why) when invalid.
bool EndpointOptions(wpub::recv::nccl::ReceiverEndpointOptions* o) {
  const std::string listen = absl::GetFlag(FLAGS_engine_listen);
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port)) {
    std::fprintf(stderr, "wpub-recv: --engine_listen '%s' is not host:port\n", listen.c_str());
    return false;
  }
  o->host = listen.substr(0, colon);
  o->port = port;
  o->devices = {absl::GetFlag(FLAGS_gpu_device)};
  if (const std::vector<std::string> list = absl::GetFlag(FLAGS_gpu_devices); !list.empty()) {
    o->devices.clear();
    for (const std::string& d : list) {
      int device = 0;
      if (!absl::SimpleAtoi(d, &device) || device < 0) {
        std::fprintf(stderr, "wpub-recv: --gpu_devices entry '%s' is not a device number\n",
                     d.c_str());
        return false;
      }
      o->devices.push_back(device);
    }
  }
  o->nccl_ctas = absl::GetFlag(FLAGS_nccl_ctas);
  if (absl::Status s = wpub::nccl::CheckCtas(o->nccl_ctas, "--nccl_ctas"); !s.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", std::string(s.message()).c_str());
    return false;
  }
  return true;
}

// The NCCL data path as a vLLM-protocol engine: every complete version (a finish with a
// weight_version) is written to --output when given.
int RunVllmEngine(const sigset_t& signals, wpub::recv::nccl::ReceiverEndpointOptions o) {
  const std::string output = absl::GetFlag(FLAGS_output);
  auto path = wpub::recv::nccl::VllmNcclPath::Create(o);
  if (!path.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", path.status().ToString().c_str());
    return 2;
  }
  wpub::recv::VllmEngineOptions eo;
  eo.host = o.host;
  eo.port = o.port;
  eo.packing_in_init = absl::GetFlag(FLAGS_vllm_packing_in_init);
  wpub::recv::VllmEngine::Callbacks cb;
  cb.on_update = [](uint64_t index, const wpub::recv::VllmUpdate& u) {
    spdlog::debug("update {}: {} tensors, {} bytes in {} chunks", index, u.tensors.size(), u.nbytes,
                  u.chunks.size());
  };
  cb.on_version = [&output](const wpub::recv::VllmEngineState& s) {
    spdlog::info("version {} applied ({} tensors)", s.weight_version, s.weights.size());
    if (output.empty()) return;
    std::vector<wpub::recv::SafetensorsEntry> entries;
    for (const auto& [name, t] : s.weights) entries.push_back({t.first, t.second});
    if (absl::Status st =
            wpub::recv::WriteSafetensors(output, entries, {{"version", s.weight_version}});
        !st.ok()) {
      spdlog::error("{}", st.ToString());
    }
  };
  auto engine = wpub::recv::VllmEngine::Start(eo, *std::move(path), std::move(cb));
  if (!engine.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", engine.status().ToString().c_str());
    return 2;
  }
  spdlog::info("serving vLLM's weight-transfer routes on {}:{} (GPUs {})", o.host,
               (*engine)->port(), absl::StrJoin(o.devices, ","));
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("received {}: stopping", strsignal(sig));
  return 0;
}

// The NCCL data path: an SGLang-compatible endpoint; every version announced with
// /update_weight_version is kept in memory and written to --output when given.
int RunEngineEndpoint(const sigset_t& signals) {
  wpub::recv::nccl::ReceiverEndpointOptions o;
  if (!EndpointOptions(&o)) return 2;
  const std::string protocol = absl::GetFlag(FLAGS_engine_protocol);
  if (protocol == "vllm" && absl::GetFlag(FLAGS_engine_patches)) {
    std::fprintf(stderr,
                 "wpub-recv: --engine_patches is for --engine_protocol=sglang (vLLM's weight "
                 "transfer takes no wpub_patch requests)\n");
    return 2;
  }
  if (protocol == "vllm") return RunVllmEngine(signals, o);
  if (protocol != "sglang") {
    std::fprintf(stderr, "wpub-recv: --engine_protocol '%s' is not sglang or vllm\n",
                 protocol.c_str());
    return 2;
  }
  std::mutex mu;
  std::map<std::string, std::pair<wpub::TensorDesc, std::vector<uint8_t>>> tensors;
  const std::string output = absl::GetFlag(FLAGS_output);
  wpub::recv::nccl::ReceiverEndpoint::Callbacks cb;
  cb.on_bucket = [&](const wpub::recv::nccl::ReceivedBucket& b) {
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
  // Without --output the bytes are only verified: checksum on the device, nothing copied back.
  o.copy_to_host = !output.empty();
  o.keep_weights = absl::GetFlag(FLAGS_engine_patches);
  if (o.keep_weights && !output.empty()) {
    std::fprintf(stderr, "wpub-recv: --engine_patches keeps the weights on the GPU: no --output\n");
    return 2;
  }
  auto endpoint = wpub::recv::nccl::ReceiverEndpoint::Start(o, std::move(cb));
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

  wpub::cli::Command command;
  command.program = command.name = "wpub-recv";
  command.summary =
      "wpub-recv: receive publications from wpubd. By default it subscribes to --target (every "
      "member of a publication group, comma-separated), pulls and verifies every bucket and "
      "keeps the last committed version (in --output as safetensors when given).\n"
      "With --engine_listen=HOST:PORT (a build with CUDA and NCCL) it is an engine instead: it "
      "serves SGLang's (--engine_protocol=sglang) or vLLM's (vllm) weight-update routes and "
      "receives over the publisher's NCCL group on --gpu_device(s).";
  command.flags = wpub::cli::FlagsDefinedIn("clients/recv/");
  command.environment = wpub::cli::ClientEnvironment();        // as the Python client reads them
  command.hidden = {"leave_after_buckets", "corrupt_bucket"};  // the tests' fault injection
  const wpub::cli::Parsed parsed =
      wpub::cli::Parse(command, std::vector<std::string>(argv + 1, argv + argc));
  if (parsed.exit_code >= 0) return parsed.exit_code;
  if (absl::Status s = wpub::cli::ConfigureLogging("wpub-recv", absl::GetFlag(FLAGS_log_level),
                                                   absl::GetFlag(FLAGS_log_format));
      !s.ok()) {
    std::fprintf(stderr, "wpub-recv: %s\n", std::string(s.message()).c_str());
    return 2;
  }
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
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes).value;
  options.patches = absl::GetFlag(FLAGS_patches);
  options.patch_threads = absl::GetFlag(FLAGS_patch_threads);
  options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  options.resubscribe_timeout = absl::GetFlag(FLAGS_resubscribe_timeout);
  options.leave_after_buckets = absl::GetFlag(FLAGS_leave_after_buckets);
  options.corrupt_bucket = absl::GetFlag(FLAGS_corrupt_bucket);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = wpub::cli::ReadSecretFile(path, "--auth_token_file");
    if (!token.ok()) {
      std::fprintf(stderr, "wpub-recv: %s\n", std::string(token.status().message()).c_str());
      return 2;
    }
    options.auth_token = *std::move(token);
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
