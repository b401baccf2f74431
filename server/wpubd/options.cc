// wpubd flag definitions and their validation.
#include "server/wpubd/options.h"

#include <cstring>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/build_info.h"
#include "cli/bytes.h"
#include "cli/logging.h"
#include "cli/secret_file.h"
#include "core/common/status.h"
#include "core/engine/pause_policy.h"

ABSL_FLAG(std::string, config, "",
          "File of flags, one `--name=value` per line (absl flagfile syntax); flags given after "
          "it on the command line override it.");
ABSL_FLAG(std::string, listen, "127.0.0.1:50151",
          "gRPC listen address: host:port (port 0 picks a free one) or unix:/path.");
ABSL_FLAG(bool, insecure_listen, false,
          "Acknowledge binding the gRPC and metrics listeners to a non-loopback address "
          "without TLS.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM server certificate chain: the gRPC listener speaks TLS only (needs "
          "--tls_key_file). A non-loopback --listen needs TLS or --insecure_listen.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: clients must present a certificate it signed (mutual TLS).");
ABSL_FLAG(int32_t, max_concurrent_streams, 64,
          "Most concurrent gRPC streams (RPCs) one client connection may have open.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus metrics address host:port (port 0 picks one); empty disables metrics.");
ABSL_FLAG(int32_t, metrics_threads, 16,
          "Connections the metrics endpoint serves at once (a connection that sends nothing or "
          "half a request is dropped after about a second).");
ABSL_FLAG(wpub::cli::Bytes, grpc_memory_bytes, uint64_t{256} << 20,
          "Memory gRPC may hold for all connections together (read buffers and messages being "
          "received; a grpc::ResourceQuota): past it gRPC cancels the streams holding it. At "
          "least 4 x --max_message_bytes.");
ABSL_FLAG(int32_t, grpc_max_threads, 64,
          "Threads gRPC may run Publisher RPCs on (the same quota); past it an RPC is answered "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30),
          "How often the server pings every connection (HTTP/2 keepalive; see "
          "--keepalive_timeout).");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "A connection whose peer does not answer a keepalive ping within this is closed and "
          "its RPCs cancelled (a Publish aborts; a receiver's subscription ends, freeing its "
          "name): how a half-open connection or a stopped peer is found.");
ABSL_FLAG(absl::Duration, min_client_ping_interval, absl::Seconds(10),
          "Clients may send keepalive pings this often at most (GOAWAY too_many_pings after "
          "two faster ones).");
ABSL_FLAG(absl::Duration, handshake_timeout, absl::Seconds(20),
          "A connection that has not completed its (TLS and) HTTP/2 handshake within this is "
          "closed.");
ABSL_FLAG(absl::Duration, ingest_idle_timeout, absl::Minutes(2),
          "A Publish stream that sends no message for this long (an idle gap, not a total: "
          "any model size works while messages keep coming) is cancelled and its publication "
          "aborted, so a stalled trainer cannot hold the daemon.");
ABSL_FLAG(int32_t, malloc_arena_max, 2,
          "glibc malloc arenas (mallopt M_ARENA_MAX), set at startup unless the environment "
          "sets MALLOC_ARENA_MAX: bounds the fragmentation that otherwise grows RSS with every "
          "publication. 0 keeps glibc's default (8 per core).");
ABSL_FLAG(wpub::cli::Bytes, malloc_mmap_threshold, uint64_t{1} << 20,
          "Allocations of at least this many bytes are mapped and unmapped on their own "
          "(mallopt M_MMAP_THRESHOLD), set at startup unless the environment sets "
          "MALLOC_MMAP_THRESHOLD_: a fixed threshold keeps freed bucket and chunk buffers from "
          "staying in the heap, which glibc's adaptive one lets happen. In [64 KiB, 32 MiB]; 0 "
          "keeps glibc's adaptive threshold.");
ABSL_FLAG(wpub::cli::Bytes, bucket_bytes, uint64_t{256} << 20,
          "Default bucket size in bytes (a publication header may override it).");
ABSL_FLAG(absl::Duration, commit_deadline, absl::Seconds(60),
          "How long receivers have, after the last bucket was sent, to acknowledge every "
          "bucket before the publication aborts.");
ABSL_FLAG(bool, allow_non_finite, false,
          "Publish NaN/Inf weights instead of rejecting the publication (for every "
          "publication; a header may also ask for it).");
ABSL_FLAG(uint64_t, min_receivers, 0,
          "A publication aborts when fewer receivers are connected at its commit, or take part "
          "when its transfer begins.");
ABSL_FLAG(std::string, retain, "off",
          "Keep a copy of the last committed version's buckets, to restore engines an aborted "
          "publication left dirty and to catch up engines and receivers that join behind "
          "(wpubctl restore replays it on request): \"device\" (GPU path: device memory of "
          "--device, copied as each bucket is sent; a replay broadcasts from it in place), "
          "\"pinned\" (GPU path: pinned host memory, the same copies to the host; a replay "
          "copies each bucket back while the previous one is broadcast), \"host\" (host "
          "memory; on the GPU path one device-to-host copy and host synchronization per bucket) "
          "or \"off\". device and pinned hold two versions' worth once a second version is "
          "published.");
ABSL_FLAG(wpub::cli::Bytes, retain_max_bytes, uint64_t{64} << 30,
          "The most bytes one retained version may hold: a committed version larger than this is "
          "not retained (and the previous copy is dropped). 0: no bound.");
ABSL_FLAG(bool, patches, false,
          "Send pull receivers that hold the committed version and accept patches (wpub-recv "
          "does) only the 8-byte words of each bucket that changed since that version, made "
          "from the retained copy (needs --retain); the receiver rebuilds the bucket and checks "
          "it against the whole bucket's checksum. A bucket whose patch would exceed half its "
          "size, or whose layout changed, goes whole.");
ABSL_FLAG(uint32_t, patches_full_every, 8,
          "With --patches: every Nth publication goes whole to every receiver (1: never patch; "
          "0: never forced).");
ABSL_FLAG(wpub::cli::Bytes, max_chunk_bytes, uint64_t{4} << 20,
          "Largest inline payload chunk accepted, and the PullBucket chunk size.");
ABSL_FLAG(wpub::cli::Bytes, max_message_bytes, uint64_t{8} << 20,
          "Largest gRPC message accepted or sent (must exceed max_chunk_bytes plus framing).");
ABSL_FLAG(wpub::cli::Bytes, max_inline_bytes, uint64_t{64} << 30,
          "Most bytes one publication may stage from inline chunks.");
ABSL_FLAG(int32_t, cpu_threads, 1, "Worker threads of the CPU quantizer.");
ABSL_FLAG(absl::Duration, drain_deadline, absl::Seconds(30),
          "On SIGTERM/SIGINT: how long an active publication may still run before it is "
          "aborted.");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(1),
          "On shutdown: how long RPCs may still run after the drain before being cancelled. "
          "gRPC also waits this long for clients that keep idle channels open.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token every RPC must present ('authorization: Bearer <t>').");
ABSL_FLAG(bool, gpu_path, false,
          "Run the GPU path (GPU backend, CUDA IPC ingestion, NCCL weight-update group) even "
          "without --engines: a trainer connects engines later with ConnectEngines.");
ABSL_FLAG(std::string, engines, "",
          "GPU path: engines to publish to over NCCL, \"http://host:port=gpus,...\" (SGLang) or "
          "\"vllm+http://host:port=gpus,...\" (vLLM v0.22+, its weight-transfer API; one kind per "
          "group), or on this node through CUDA IPC (\"sglang-ipc+http://...\", "
          "\"vllm-ipc+http://...\") (implies --gpu_path; ConnectEngines replaces them).");
ABSL_FLAG(bool, release_gpu_memory, false,
          "GPU path: free the backend's staging buffers after every publication, so that an "
          "engine sharing the GPU (colocated) can use that memory between publications; the "
          "next publication allocates them again (counted host synchronizations).");
ABSL_FLAG(std::string, pause, "abort",
          "GPU path: what engines do with their requests and cache while paused for a "
          "publication, \"<in_flight>[:<cache>]\": in_flight abort (the default: no request's "
          "tokens from two versions), wait (vLLM), retract (SGLang; vLLM's keep with its cache "
          "cleared) or keep; cache flush or keep (default: flush, but keep after keep, and after "
          "retract on SGLang). ConnectEngines may give its own. docs/specs/engines.md, \"Pause "
          "policies\".");
ABSL_FLAG(absl::Duration, engine_watch_interval,
          wpub::rollout::GpuPathOptions{}.engine_watch_interval,
          "GPU path: how often, between publications, the engines are asked for their health and "
          "weight version; one back from a restart (healthy, holding less than it was given) is "
          "caught up from the retained copy (--retain). 0: never.");
ABSL_FLAG(int32_t, gpu_device, wpub::rollout::GpuPathOptions{}.device,
          "GPU path: the CUDA device of the GPU backend and NCCL rank 0.");
ABSL_FLAG(std::string, nccl_group, wpub::rollout::GpuPathOptions{}.group_name,
          "GPU path: weight-update group name (the daemon's incarnation and a generation are "
          "added: <name>_<incarnation>_<generation>).");
ABSL_FLAG(std::string, nccl_store_listen, "127.0.0.1:0",
          "GPU path: ip:port of the TCPStore rendezvous the engines join.");
ABSL_FLAG(std::string, nccl_advertise_address, wpub::rollout::GpuPathOptions{}.advertise_address,
          "GPU path: the address engines use to reach the TCPStore.");
ABSL_FLAG(absl::Duration, group_timeout, absl::Seconds(60),
          "Publication groups: how long a group version this daemon leads (member 0) may go "
          "without progress (a member joining, staging, preparing) before it aborts naming the "
          "members it waits for; a header's group.timeout_seconds overrides it.");
ABSL_FLAG(std::string, group_decision_log, "",
          "Publication groups: a file where this daemon records the decision of every group "
          "version it leads before announcing it (JSON lines, the last 1024 kept). A member that "
          "prepared and lost its stream asks the leader for the decision; with this file a "
          "restarted leader still answers (one without a record answers aborted: a commit is "
          "always recorded first). Empty: in memory only, and a member in doubt about a round of "
          "a leader that restarted waits until an operator resolves it.");
ABSL_FLAG(absl::Duration, group_join_timeout, absl::Seconds(30),
          "Publication groups: how long a member waits for its leader to accept its join.");
ABSL_FLAG(std::string, group_tls_ca_file, "",
          "Publication groups: PEM CA the leader's TLS certificate must chain to (empty: "
          "plaintext to the leader). The bearer token sent is --auth_token_file's.");
ABSL_FLAG(std::string, engine_api_key_file, "",
          "GPU path: file holding the API key the engines check on their weight routes (an "
          "engine started with one answers 401 without it), sent as a bearer token with every "
          "engine request; "
          "never logged.");
ABSL_FLAG(absl::Duration, engine_deadline, wpub::rollout::GpuPathOptions{}.request_timeout,
          "GPU path: every engine must receive a publication within this (else NCCL abort).");
ABSL_FLAG(int32_t, engine_requests_in_flight, wpub::rollout::GpuPathOptions{}.requests_in_flight,
          "GPU path: update requests per engine in flight at once. 1 for SGLang; 2 lets an "
          "engine that orders requests by wpub_sequence (wpub-recv --engine_listen) decode the "
          "next bucket's request while this one's broadcast runs.");
ABSL_FLAG(int32_t, gpu_compute_sms, wpub::rollout::GpuPathOptions{}.compute_sms,
          "GPU path: run quantize/pack on this many SMs (a CUDA green context), leaving the "
          "others to the bucket broadcasts; 0: every SM. On H200 112-120 of 132 shortened a "
          "publication by about 5%.");
ABSL_FLAG(int32_t, gpu_overlap_ctas_per_sm, wpub::rollout::GpuPathOptions{}.overlap_ctas_per_sm,
          "GPU path: at most this many CTAs per SM for the quantize (and pipelined amax) kernels "
          "that run while the previous bucket is broadcast, so that NCCL keeps its pace; 0: no "
          "cap. On 2 x H200, 3 shortened a publication by 5-12%.");
ABSL_FLAG(int32_t, nccl_ctas, wpub::rollout::GpuPathOptions{}.nccl_ctas,
          "GPU path: NCCL channels (CTAs) of wpub's rank in the weight-update group, in [0, 64]; "
          "0: NCCL's choice. Every engine rank must use the same count (NCCL_MIN_CTAS and "
          "NCCL_MAX_CTAS in its environment; wpub-recv --nccl_ctas), else NCCL fails every "
          "broadcast and publications abort. On 2 x H200, 32 shortened a publication by 5-7%.");
ABSL_FLAG(std::string, ready_file, "",
          "Written once serving: JSON with the bound grpc_port, metrics_port and pid.");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or critical.");
ABSL_FLAG(std::string, log_format, "text",
          "text (one line per event, UTC timestamps with offset) or json (one JSON object per "
          "line: ts, level, logger, msg, thread, and the event's version, phase, engine or "
          "bucket where it has them).");

namespace wpub::wpubd {
namespace {

// INVALID_ARGUMENT naming --flag and its value unless lo <= value <= hi ("must be in [lo, hi]",
// or "must be >= lo" without an upper bound).
absl::Status IntFlagInRange(absl::string_view flag, int value, int lo,
                            int hi = std::numeric_limits<int>::max()) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  const std::string range = hi == std::numeric_limits<int>::max()
                                ? absl::StrCat(">= ", lo)
                                : absl::StrCat("in [", lo, ", ", hi, "]");
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be ", range, ", not ", value));
}

}  // namespace

absl::StatusOr<DaemonOptions> OptionsFromFlags() {
  DaemonOptions o;
  o.server.listen = absl::GetFlag(FLAGS_listen);
  o.server.insecure_listen = absl::GetFlag(FLAGS_insecure_listen);
  o.server.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.server.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  o.server.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  if (o.server.tls.cert_file.empty() != o.server.tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file go together: give both or neither");
  }
  if (!o.server.tls.client_ca_file.empty() && !o.server.tls.enabled()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca_file needs --tls_cert_file and --tls_key_file");
  }
  o.server.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  if (o.server.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError("--max_concurrent_streams must be >= 1");
  }
  o.server.grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes).value;
  o.server.grpc_max_threads = absl::GetFlag(FLAGS_grpc_max_threads);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("grpc_max_threads", o.server.grpc_max_threads, 8));
  o.server.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  o.server.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o.server.min_client_ping_interval = absl::GetFlag(FLAGS_min_client_ping_interval);
  o.server.handshake_timeout = absl::GetFlag(FLAGS_handshake_timeout);
  o.server.service.ingest_idle_timeout = absl::GetFlag(FLAGS_ingest_idle_timeout);
  for (const auto& [flag, d] : {std::pair{"keepalive_time", o.server.keepalive_time},
                                {"keepalive_timeout", o.server.keepalive_timeout},
                                {"min_client_ping_interval", o.server.min_client_ping_interval},
                                {"handshake_timeout", o.server.handshake_timeout},
                                {"ingest_idle_timeout", o.server.service.ingest_idle_timeout}}) {
    if (d < absl::Milliseconds(1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be at least 1ms, not ", absl::FormatDuration(d)));
    }
  }
  o.malloc_arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("malloc_arena_max", o.malloc_arena_max, 0, 1024));
  o.malloc_mmap_threshold = absl::GetFlag(FLAGS_malloc_mmap_threshold).value;
  if (o.malloc_mmap_threshold != 0 && (o.malloc_mmap_threshold < (uint64_t{64} << 10) ||
                                       o.malloc_mmap_threshold > (uint64_t{32} << 20))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--malloc_mmap_threshold must be 0 or in [64 KiB, 32 MiB], not ", o.malloc_mmap_threshold));
  }
  o.metrics_threads = absl::GetFlag(FLAGS_metrics_threads);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("metrics_threads", o.metrics_threads, 1, 1024));
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!o.metrics_listen.empty() && !o.server.insecure_listen &&
      !server::IsLoopbackAddress(o.metrics_listen)) {
    return absl::PermissionDeniedError(
        absl::StrCat("--metrics_listen '", o.metrics_listen,
                     "' is not loopback: pass --insecure_listen to acknowledge"));
  }
  o.engine.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes).value;
  if (o.engine.bucket_bytes < o.engine.min_bucket_bytes ||
      o.engine.bucket_bytes > o.engine.max_bucket_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("--bucket_bytes=", o.engine.bucket_bytes,
                                                   " is outside [", o.engine.min_bucket_bytes, ", ",
                                                   o.engine.max_bucket_bytes, "]"));
  }
  o.engine.ack_deadline = absl::GetFlag(FLAGS_commit_deadline);
  if (o.engine.ack_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--commit_deadline must be positive");
  }
  o.engine.min_receivers = absl::GetFlag(FLAGS_min_receivers);
  {
    absl::StatusOr<transport::RetainWhere> where =
        transport::ParseRetainWhere(absl::GetFlag(FLAGS_retain));
    if (!where.ok())
      return absl::InvalidArgumentError(absl::StrCat("--", where.status().message()));
    o.engine.retain.where = *where;
    o.engine.retain.max_bytes = absl::GetFlag(FLAGS_retain_max_bytes).value;
  }
  o.engine.patches.enabled = absl::GetFlag(FLAGS_patches);
  o.engine.patches.full_every = absl::GetFlag(FLAGS_patches_full_every);
  o.engine.max_inline_bytes = absl::GetFlag(FLAGS_max_inline_bytes).value;
  o.engine.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  if (o.engine.cpu_threads < 1) {
    return absl::InvalidArgumentError("--cpu_threads must be >= 1");
  }
  o.server.service.max_chunk_bytes = absl::GetFlag(FLAGS_max_chunk_bytes).value;
  if (o.server.service.max_chunk_bytes < 1024) {
    return absl::InvalidArgumentError("--max_chunk_bytes must be >= 1024");
  }
  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).value;
  if (max_message > uint64_t{1} << 30) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes=", max_message, " is more than 1GiB"));
  }
  o.server.max_message_bytes = static_cast<int32_t>(max_message);
  if (o.server.max_message_bytes < 0 ||
      o.server.grpc_memory_bytes < 4 * static_cast<uint64_t>(o.server.max_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--grpc_memory_bytes (", o.server.grpc_memory_bytes,
        ") must be at least 4 x --max_message_bytes (", o.server.max_message_bytes, ")"));
  }
  o.server.service.allow_non_finite = absl::GetFlag(FLAGS_allow_non_finite);
  o.server.service.daemon_version = absl::StrCat("wpubd ", cli::Build().version);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    WPUB_ASSIGN_OR_RETURN(o.server.service.auth_token,
                          cli::ReadSecretFile(path, "--auth_token_file"));
    o.group_client.auth_token = o.server.service.auth_token;
  }
  if (const std::string path = absl::GetFlag(FLAGS_engine_api_key_file); !path.empty()) {
    WPUB_ASSIGN_OR_RETURN(o.gpu.engine_auth_token,
                          cli::ReadSecretFile(path, "--engine_api_key_file"));
  }
  o.drain_deadline = absl::GetFlag(FLAGS_drain_deadline);
  o.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  o.ready_file = absl::GetFlag(FLAGS_ready_file);
  o.engines = absl::GetFlag(FLAGS_engines);
  o.gpu_path = absl::GetFlag(FLAGS_gpu_path) || !o.engines.empty();
  o.engine.release_backend_memory = absl::GetFlag(FLAGS_release_gpu_memory);
  o.gpu.device = absl::GetFlag(FLAGS_gpu_device);
  o.gpu.engine_watch_interval = absl::GetFlag(FLAGS_engine_watch_interval);
  if (o.gpu.engine_watch_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--engine_watch_interval must not be negative");
  }
  {
    absl::StatusOr<engine::PausePolicy> pause =
        engine::ParsePausePolicy(absl::GetFlag(FLAGS_pause));
    if (!pause.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--pause: ", pause.status().message()));
    }
    o.gpu.pause = *pause;
  }
  o.gpu.group_name = absl::GetFlag(FLAGS_nccl_group);
  o.nccl_store_listen = absl::GetFlag(FLAGS_nccl_store_listen);
  {
    const size_t colon = o.nccl_store_listen.rfind(':');
    int port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(o.nccl_store_listen.substr(colon + 1), &port) || port < 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--nccl_store_listen '", o.nccl_store_listen, "' is not ip:port"));
    }
    o.gpu.store_bind_address = o.nccl_store_listen.substr(0, colon);
    o.gpu.store_port = static_cast<uint16_t>(port);
  }
  o.gpu.advertise_address = absl::GetFlag(FLAGS_nccl_advertise_address);
  o.gpu.request_timeout = o.gpu.publication_deadline = absl::GetFlag(FLAGS_engine_deadline);
  o.gpu.requests_in_flight = absl::GetFlag(FLAGS_engine_requests_in_flight);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("engine_requests_in_flight", o.gpu.requests_in_flight, 1, 8));
  o.gpu.compute_sms = absl::GetFlag(FLAGS_gpu_compute_sms);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("gpu_compute_sms", o.gpu.compute_sms, 0));
  o.gpu.overlap_ctas_per_sm = absl::GetFlag(FLAGS_gpu_overlap_ctas_per_sm);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("gpu_overlap_ctas_per_sm", o.gpu.overlap_ctas_per_sm, 0));
  o.gpu.nccl_ctas = absl::GetFlag(FLAGS_nccl_ctas);
  WPUB_RETURN_IF_ERROR(IntFlagInRange("nccl_ctas", o.gpu.nccl_ctas, 0, kMaxNcclCtas));
  if (o.gpu_path && !o.server.insecure_listen && !server::IsLoopbackAddress(o.nccl_store_listen)) {
    return absl::PermissionDeniedError(
        absl::StrCat("--nccl_store_listen '", o.nccl_store_listen,
                     "' is not loopback: pass --insecure_listen to acknowledge"));
  }
  if (o.gpu.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--engine_deadline must be positive");
  }
  o.log_level = absl::GetFlag(FLAGS_log_level);
  o.log_format = absl::GetFlag(FLAGS_log_format);
  if (spdlog::level::from_str(o.log_level) == spdlog::level::off && o.log_level != "off") {
    return absl::InvalidArgumentError(absl::StrCat("--log_level '", o.log_level, "' is unknown"));
  }
  if (o.log_format != "text" && o.log_format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format '", o.log_format, "' is not text or json"));
  }
  o.group.default_timeout = absl::GetFlag(FLAGS_group_timeout);
  o.group_decision_log = absl::GetFlag(FLAGS_group_decision_log);
  o.group_client.join_timeout = absl::GetFlag(FLAGS_group_join_timeout);
  o.group_client.tls.ca_file = absl::GetFlag(FLAGS_group_tls_ca_file);
  // Finite too: a round's deadline is its last progress plus the timeout.
  if (o.group.default_timeout <= absl::ZeroDuration() ||
      o.group.default_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("--group_timeout must be positive and finite");
  }
  if (o.group_client.join_timeout <= absl::ZeroDuration() ||
      o.group_client.join_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("--group_join_timeout must be positive and finite");
  }
  return o;
}

std::vector<std::string> RewriteConfigFlag(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (i > 0 && arg.rfind("--config=", 0) == 0) {
      args.push_back(
          absl::StrCat("--flagfile=", std::string(arg.substr(std::strlen("--config=")))));
    } else if (i > 0 && arg == "--config" && i + 1 < argc) {
      args.push_back(absl::StrCat("--flagfile=", argv[++i]));
    } else {
      args.emplace_back(arg);
    }
  }
  return args;
}

void ConfigureLogging(const DaemonOptions& options) {
  // Validated by OptionsFromFlags.
  (void)cli::ConfigureLogging("wpubd", options.log_level, options.log_format);
}

}  // namespace wpub::wpubd
