// The NCCL weight-update group as an engine::Transport (lifecycle, outcomes) and a
// gpu::DeviceBucketSink (device buckets). wpubd is rank 0: it serves the TCPStore rendezvous
// (core/rendezvous), puts the ncclUniqueId under the key ProcessGroupNCCL reads, starts its
// nonblocking communicator and asks every engine to join through the SGLang driver
// (core/engines). Per bucket it posts the engine's update request, then enqueues the broadcast
// on its comm stream after the backend's ready event.
//
// Failure handling: while a publication is in flight a watchdog thread polls
// ncclCommGetAsyncError, the engines' HTTP outcomes and the publication deadline; on any
// failure it calls ncclCommAbort (which also terminates the broadcast kernels, so no host wait
// can hang), records why, and the publication fails with ABORTED naming the engines. The next
// Begin re-forms the group with the engines that answer their health check (a new group name
// generation, a new unique id), so wpubd keeps serving after a dead engine.
//
// Engine set (engine::EngineConnector): the initial set comes from the options (may be empty:
// a daemon started without engines); Connect replaces it. Connect first tears the current
// group down (its engines are asked to destroy it), then probes every engine's health
// endpoint, lays out the group, publishes the unique id, starts the communicator and waits for
// every join answer. On any failure whatever joined is torn down too and the transport is left
// with NO engines: never half-connected. Without engines the transport has no participants
// (Begin returns none; device buckets are only ordered after their ready event), so a
// publication reaches the other transports' receivers only. Connect and Begin are serialized by one
// mutex; Connect refuses while a publication is in flight. Group/Receivers read a snapshot and
// never block on a Connect.
//
// Dirty engines: SGLang loads each bucket into its live weights on receipt. When a publication
// aborts, the engines that were sent no bucket are resumed at once (continue_generation); the
// others are dirty: left paused, reported with state "dirty" (Receivers, Group, Outcomes) until
// a publication commits on them (the engine's retry of the same version, or the next one).
//
// Transport contract (core/engine/transport.h) with these specifics: participants are the
// engine URLs; acknowledgements are the engines' HTTP answers (SGLang reports no checksums, so
// acknowledges_checksums is false); Commit sends version/end/continue. Thread-safety: as the
// interface says (Abort from any thread; the rest from the publication thread).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/transport.h"
#include "core/engines/sglang_driver.h"
#include "core/gpu/device_sink.h"
#include "core/nccl/nccl_comm.h"
#include "core/rendezvous/tcp_store_server.h"

namespace wpub::nccl {

struct NcclTransportOptions {
  int device = 0;
  // The TCPStore the engines rendezvous on (master_port = its port).
  rendezvous::TcpStoreServerOptions store;
  // The address engines use to reach this host's TCPStore.
  std::string advertise_address = "127.0.0.1";
  // Initial engines (may be empty), base group name, endpoints; master_address/port are
  // filled in.
  engines::SglangDriverOptions sglang;
  // GET before (re-)forming a group; engines that fail it are left out. Empty: no probe.
  std::string health_endpoint = "/health";
  // GET after a group formed, for the "weight_version" each engine serves (SGLang's
  // /get_model_info); versions at or below the highest are refused. Empty: not asked.
  std::string model_info_endpoint = "/get_model_info";
  // Keys the ncclUniqueId is stored under (each template as rendezvous::UniqueIdKey takes it):
  // torch 2.11's layout first, then the one of torch versions without the device-type layer.
  std::vector<std::string> unique_id_key_templates = {
      std::string(rendezvous::kDefaultUniqueIdKeyTemplate), "/{group}/{group}/{index}"};
  // Every engine joins (HTTP answer) within this; the communicator is ready at the latest
  // when the first bucket's broadcast starts, within the same budget.
  absl::Duration join_timeout = absl::Seconds(120);
  // Watchdog: from Begin, every bucket must be transferred and answered within this.
  absl::Duration publication_deadline = absl::Seconds(120);
  absl::Duration watchdog_interval = absl::Milliseconds(2);
  // NcclCommOptions::ctas of wpub's rank (0: NCCL's choice). The engines' communicators must have
  // the same bounds (NCCL_MIN_CTAS = NCCL_MAX_CTAS = nccl_ctas in their environment), else every
  // broadcast fails and the publication is aborted (see NcclCommOptions::ctas).
  int nccl_ctas = 0;
};

class NcclTransport : public engine::Transport,
                      public gpu::DeviceBucketSink,
                      public engine::EngineConnector {
 public:
  // Starts the TCPStore server and the comm stream; forms no group yet (the first Begin or
  // Connect does).
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options);
  ~NcclTransport() override;

  // ConnectEngines (see the file comment). Blocks for the health probes (at most
  // min(sglang.connect_timeout, timeout)) and the joins (at most timeout = request.timeout, or
  // options.join_timeout when 0), plus, on failure, the teardown (destroy requests, at most a
  // few seconds, or until an engine's pending request ends).
  // Errors: INVALID_ARGUMENT (engine::ValidateEngineConnectRequest); FAILED_PRECONDITION while
  // a publication is in flight; UNAVAILABLE naming an engine that failed its health probe or
  // its join; DEADLINE_EXCEEDED naming the engines that did not answer in time.
  absl::StatusOr<engine::EngineGroupInfo> Connect(
      const engine::EngineConnectRequest& request) override;
  engine::EngineGroupInfo Group() const override;
  uint16_t store_port() const { return store_->port(); }
  int generation() const { return generation_; }

  engine::TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const engine::PublicationManifest& m) override;
  // Host bucket: copied to a device buffer (one counted wait per bucket), then broadcast.
  absl::Status Send(std::shared_ptr<const engine::Bucket> bucket) override;
  absl::Status SendDevice(const engine::BucketManifest& manifest, const void* data, uint64_t nbytes,
                          cudaEvent_t ready, cudaEvent_t done) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<engine::ReceiverOutcome> Outcomes() const override;
  std::vector<engine::ReceiverInfo> Receivers() const override;

  cudaStream_t comm_stream() const { return comm_stream_; }
  // Engines left paused by an aborted publication (see the file comment).
  std::vector<std::string> dirty_engines() const;

  // Device time of the last publication's broadcasts, from CUDA events around each on the comm
  // stream (read once they completed, e.g. after WaitAcknowledged): busy[i] is broadcast i's
  // kernel (including any wait for the engines' receives), idle[i] the gap before it since the
  // previous one ended (the stream waiting for the bucket to be packed). Empty without engines.
  struct BroadcastTiming {
    std::vector<double> busy, idle;
  };
  BroadcastTiming last_broadcast_timing() const;

 private:
  explicit NcclTransport(NcclTransportOptions options);
  void StartWatchdog();
  void StopWatchdog();
  void Fail(absl::Status why);  // records the first failure, aborts the communicator
  absl::Status failure() const;
  // Forms a group of `want` (requires connect_mu_). strict: every engine must pass the health
  // probe (ConnectEngines); otherwise the ones that fail it are left out (re-formation).
  absl::Status Form(const std::vector<engines::EngineSpec>& want, const std::string& base_group,
                    absl::Duration timeout, bool strict);
  void TearDownGroup();
  void PublishInfo();  // refreshes info_ from the group state (requires connect_mu_)
  // After an abort: resumes the engines that got no bucket, records the others as dirty.
  void ResumeCleanEngines();

  NcclTransportOptions options_;
  // Serializes Connect and Begin; guards engines_ and base_group_.
  std::mutex connect_mu_;
  std::vector<engines::EngineSpec> engines_;  // the engine set; empty: none connected
  std::string base_group_;
  // What Group and Receivers show (written under connect_mu_ too).
  mutable std::mutex info_mu_;
  engine::EngineGroupInfo info_;                     // guarded by info_mu_
  std::set<std::string> dirty_;                      // guarded by info_mu_: engine URLs left dirty
  std::map<std::string, uint64_t> weight_versions_;  // guarded by info_mu_: by URL, at join
  std::unique_ptr<rendezvous::TcpStoreServer> store_;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t host_done_ = nullptr;
  // 2 per broadcast (start, end), grown on demand: the timing of last_broadcast_timing, and the
  // last end event is what WaitAcknowledged polls for rank 0's side to be complete.
  std::vector<cudaEvent_t> bcast_events_;
  size_t bcast_count_ = 0;        // broadcasts of the current publication
  void* host_staging_ = nullptr;  // device buffer for host buckets
  uint64_t host_staging_bytes_ = 0;

  // Group state (publication thread, or a Connect under connect_mu_).
  std::unique_ptr<engines::SglangDriver> driver_;
  std::unique_ptr<NcclComm> comm_;
  std::atomic<int> generation_{0};
  std::atomic<bool> group_healthy_{false};  // cleared by Abort/Fail from any thread
  std::atomic<bool> in_flight_{false};
  // Begin posted the lifecycle calls; the abort path still owes the clean engines a resume.
  std::atomic<bool> resume_pending_{false};
  uint64_t version_ = 0;
  absl::Time publication_deadline_ = absl::InfiniteFuture();
  std::vector<engine::ReceiverOutcome> last_outcomes_;

  // Watchdog.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool watchdog_stop_ = true;  // guarded by mu_
  absl::Status failure_;       // guarded by mu_: first failure of the publication
  std::thread watchdog_;
};

}  // namespace wpub::nccl
