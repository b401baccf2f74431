// Internal to core/engine: the Engine's shared state (Engine::Impl) and one publication's state
// (PublicationSession::State). Not part of the public API.
//
// Locking: Impl::mu guards the engine's bookkeeping; State::mu guards a publication's
// lifecycle flags. Order: State::mu may be held while taking Impl::mu or the transport's lock;
// Impl::mu is never held while calling into a State or the transport.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/backend.h"
#include "core/engine/engine.h"
#include "core/engine/inputs.h"
#include "core/engine/recipe.h"
#include "core/engine/transport_group.h"
#include "core/metrics/metrics.h"
#include "core/policy/policy.h"

namespace wpub::engine {

class Engine::Impl {
 public:
  EngineOptions options;
  std::unique_ptr<policy::IgnoreSnapshotCache> cache;
  std::unique_ptr<PullTransport> transport;
  std::vector<std::unique_ptr<Transport>> extra_transports;
  // Every transport of a publication: the extras, then the pull transport.
  std::unique_ptr<TransportGroup> transports;
  std::unique_ptr<CudaIpcResolver> cuda_ipc;  // null on the CPU path
  EngineConnector* connector = nullptr;       // null on the CPU path; owned by a component
  std::mutex ipc_mu;                          // serializes cuda_ipc calls
  std::unique_ptr<Backend> backend;
  std::unique_ptr<metrics::EngineMetrics> metrics;  // null without a registry

  mutable std::mutex mu;
  std::condition_variable cv;  // signalled when the active publication ends, or on shutdown
  std::shared_ptr<PublicationSession::State> active;  // guarded by mu
  uint64_t committed_version = 0;                     // guarded by mu
  std::string committed_model_id;                     // guarded by mu
  absl::Time committed_at = absl::InfinitePast();     // guarded by mu
  std::deque<PublicationReport> reports;              // newest first; guarded by mu
  bool shutting_down = false;                         // guarded by mu
  // A ConnectEngines is forming the group: Open treats it like an active publication.
  bool connecting = false;      // guarded by mu
  bool stop_refresher = false;  // guarded by mu
  std::thread refresher;        // refreshes wpub_engines{state} while metrics are on

  // Records the final report of `state` (which must be the active publication), advances the
  // committed version on success, releases the active slot and updates metrics.
  void Finish(const PublicationSession::State* state, const PublicationReport& report);
  void RefreshMetrics();
  // Beyond the committed version (checked by the caller, under mu): the versions the
  // connected engines reported serving, and at most max_version_step above all of them.
  // `group` is the connector's group (nullopt without one). Requires mu.
  absl::Status CheckVersionFloor(uint64_t version,
                                 const std::optional<EngineGroupInfo>& group) const;
};

class PublicationSession::State {
 public:
  using Clock = std::chrono::steady_clock;

  State(std::shared_ptr<Engine::Impl> engine, PublicationHeader header, ParsedRecipe recipe,
        std::unique_ptr<policy::Policy> policy, uint64_t bucket_bytes);

  absl::Status AddBatch(BatchInput batch);
  absl::Status AppendInline(uint64_t batch, uint32_t tensor, uint32_t part, uint64_t offset,
                            absl::Span<const uint8_t> bytes);
  absl::StatusOr<PublicationReport> Commit();
  void Abort(absl::Status why);
  // Abort, reporting `outcome` (kFailed for bad input found by the caller).
  void Stop(absl::Status why, PublicationStatus outcome);

  uint64_t version() const { return header_.version; }
  const std::string& model_id() const { return header_.model_id; }
  absl::Time opened_at() const { return opened_at_; }
  PublicationState state() const { return state_.load(); }
  uint64_t num_batches() const { return num_batches_.load(); }
  uint64_t num_tensors() const { return num_tensors_.load(); }
  bool ended() const;

 private:
  // Ends the publication with `status`: FAILED for bad input, ABORTED otherwise. Tells the
  // transport to discard the version when it saw it. Returns `status`.
  absl::Status End(PublicationStatus outcome, absl::Status status);
  // The report as of now.
  PublicationReport MakeReport(PublicationStatus outcome, const absl::Status& status) const;
  absl::Status CheckOpen() const;  // requires mu_
  // The store's CUDA IPC hook: the engine's resolver under its lock, or null.
  static CudaIpcResolveFn ResolveFn(Engine::Impl* engine);
  absl::StatusOr<ExecutionPlan> BuildPlan(std::vector<uint32_t>* unit_sizes);
  // The ABORTED report after a transport/receiver failure or an abort request.
  PublicationReport AbortedReport(absl::Status why);
  // One attempt at the transfer: Begin on every transport, the backend's quantize/pack/emit,
  // every acknowledgement. OK when every participant holds every bucket; otherwise why not,
  // with *bad_input set when the backend found the trainer's input bad (non-finite weights).
  absl::Status Transfer(const ExecutionPlan& plan, const PublicationManifest& manifest,
                        bool* bad_input);

  // Shared so a session may outlive the Engine; Impl::active points back while this publication
  // is active (the cycle ends when Finish releases the slot).
  const std::shared_ptr<Engine::Impl> engine_;
  const PublicationHeader header_;
  const ParsedRecipe recipe_;
  const std::unique_ptr<policy::Policy> policy_;
  const uint64_t bucket_bytes_;
  const absl::Time opened_at_;
  const Clock::time_point t_open_;

  // Producer-thread state (AddBatch/AppendInline/Commit; never touched by Abort).
  InputStore store_;
  std::vector<policy::BatchPlan> plans_;
  PhaseSeconds phases_;
  double policy_seconds_in_ingest_ = 0;
  uint64_t non_finite_ = 0;
  uint64_t bytes_out_ = 0;
  std::map<std::string, uint64_t> bytes_by_format_;
  uint32_t num_buckets_ = 0;
  int attempts_ = 0;                       // transfers begun
  std::vector<std::string> retry_errors_;  // why each attempt before the last failed
  SyncCounter syncs_;

  mutable std::mutex mu_;
  bool ended_ = false;            // guarded by mu_: the report was recorded
  bool commit_called_ = false;    // guarded by mu_
  bool transport_begun_ = false;  // guarded by mu_
  bool committing_ = false;       // guarded by mu_: past the point of no return
  bool abort_requested_ = false;  // guarded by mu_
  absl::Status end_status_;       // guarded by mu_: why it ended / abort request
  std::atomic<PublicationState> state_{PublicationState::kOpen};
  std::atomic<uint64_t> num_batches_{0};
  std::atomic<uint64_t> num_tensors_{0};
  std::atomic<uint64_t> tensors_quantized_{0};
  std::atomic<uint64_t> tensors_passthrough_{0};
  std::atomic<uint64_t> tensors_ignored_{0};
  std::atomic<uint64_t> bytes_in_{0};
};

}  // namespace wpub::engine
