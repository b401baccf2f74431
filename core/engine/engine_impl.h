// Internal to core/engine: the Engine's parts and bookkeeping (Engine::Impl) and one
// publication (PublicationSession::State). Not part of the public API.
//
// Who owns what:
// - Engine::Impl's components (options, policy cache, backend, transports, CUDA IPC resolver,
//   connector, observer) are set once in Create and read-only afterwards; they are safe to use
//   from any thread as their own contracts say (the resolver only through ResolveFn /
//   EndCudaIpcPublication, which serialize it).
// - The PublicationLedger (ledger.h) owns the active slot, the committed version, the report
//   history and the shutdown flag; a publication reaches it only through Impl::Record.
// - A State's Lifecycle (lifecycle.h) owns the publication's stage, end status and abort
//   request; the producer/Commit thread owns the rest of the State.
//
// Locking: a Lifecycle's mutex may be held while calling into the transports; the ledger's
// mutex only while Engine::Open admits a publication (the pull transport's version check).
// Neither is held while taking the other.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/backend.h"
#include "core/engine/engine.h"
#include "core/engine/inputs.h"
#include "core/engine/ledger.h"
#include "core/engine/lifecycle.h"
#include "core/engine/recipe.h"
#include "core/engine/replay.h"
#include "core/policy/policy.h"
#include "core/transport/retained_copy.h"
#include "core/transport/transport_group.h"

namespace wpub::engine {

class Engine::Impl {
 public:
  // Validates `options`, builds the parts `components` does not replace (CPU backend, pull
  // transport, policy cache) and, with an observer, starts its refresher.
  static absl::StatusOr<std::shared_ptr<Impl>> Create(const EngineOptions& options,
                                                      EngineObserver* observer,
                                                      EngineComponents components);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  const EngineOptions& options() const { return options_; }
  policy::IgnoreSnapshotCache* cache() const { return cache_.get(); }
  transport::PullTransport& pull() const { return *pull_; }
  // Every transport of a publication: the extras, the pull transport, the retained copy.
  transport::TransportGroup& transports() const { return *transports_; }
  // The committed version's copy (off unless EngineOptions::retain says where).
  transport::RetainedCopy& retained() const { return *retained_; }
  // The pull transport's patches (EngineOptions::patches), made from the retained copy.
  static transport::PatchSource MakePatchSource(std::weak_ptr<Impl> weak,
                                                const EngineOptions& options);
  Replayer& replayer() const { return *replayer_; }
  Backend& backend() const { return *backend_; }
  RolloutConnector* connector() const { return connector_; }   // null on the CPU path
  GroupJoiner* group_joiner() const { return group_joiner_; }  // null: no groups
  PublicationLedger& ledger() { return ledger_; }
  const PublicationLedger& ledger() const { return ledger_; }

  // The input store's CUDA IPC hook: the resolver under its lock, or null without one.
  CudaIpcResolveFn ResolveFn();
  // Releases the previous publication's CUDA IPC mappings (no-op without a resolver).
  void EndCudaIpcPublication();

  // A publication ended: records its report in the ledger (freeing the slot `holder` holds)
  // and tells the observer.
  void Record(const PublicationSession::State* holder, const PublicationReport& report);
  // A replay ended (the Replayer recorded it): tells the observer.
  void OnReplay(const ReplayReport& report);
  void RefreshObserver();
  // Beyond the committed version (checked by the ledger): the versions the connected engines
  // reported serving, and at most max_version_step above all of them. `group` is the
  // connector's group (nullopt without one).
  absl::Status CheckVersionFloor(uint64_t version, uint64_t committed_version,
                                 const std::optional<RolloutGroupInfo>& group) const;

  // ~Engine: the ledger refuses new work, the refresher stops, the pull transport shuts down
  // and the CUDA IPC mappings are released. Sessions that outlive the Engine keep the parts.
  void Shutdown();

 private:
  // The parts, as Create assembles them.
  struct Parts {
    std::unique_ptr<policy::IgnoreSnapshotCache> cache;
    std::unique_ptr<transport::PullTransport> pull;
    std::unique_ptr<transport::RetainedCopy> retained;
    std::vector<std::unique_ptr<transport::Transport>> extra_transports;
    std::unique_ptr<transport::TransportGroup> transports;
    std::unique_ptr<CudaIpcResolver> cuda_ipc;
    RolloutConnector* connector = nullptr;
    std::unique_ptr<RolloutConnector> owned_connector;
    GroupJoiner* group_joiner = nullptr;
    std::unique_ptr<Backend> backend;
    EngineObserver* observer = nullptr;
  };
  Impl(const EngineOptions& options, Parts parts);
  void StartRefresher();  // only with an observer
  void StopRefresher();

  // Components: set in the constructor, read-only afterwards.
  const EngineOptions options_;
  const std::unique_ptr<policy::IgnoreSnapshotCache> cache_;
  const std::unique_ptr<transport::PullTransport> pull_;
  const std::unique_ptr<transport::RetainedCopy> retained_;
  const std::vector<std::unique_ptr<transport::Transport>>
      extra_transports_;  // owned for transports_
  const std::unique_ptr<transport::TransportGroup> transports_;
  const std::unique_ptr<CudaIpcResolver> cuda_ipc_;          // null on the CPU path
  const std::unique_ptr<RolloutConnector> owned_connector_;  // null unless given one
  RolloutConnector* const connector_;                        // owned by a component (or above)
  GroupJoiner* const group_joiner_;                          // owned by the caller
  const std::unique_ptr<Backend> backend_;
  EngineObserver* const observer_;  // owned by the caller; may be null
  std::mutex ipc_mu_;               // serializes cuda_ipc_ calls

  PublicationLedger ledger_;

  // The observer's upkeep: its live state (wpub_engines{state}) follows receivers that connect or
  // leave between publications.
  std::mutex refresher_mu_;
  std::condition_variable refresher_cv_;
  bool stop_refresher_ = false;  // guarded by refresher_mu_
  std::thread refresher_;

  // Last: its thread uses everything above, and it is stopped and destroyed first.
  const std::unique_ptr<Replayer> replayer_;
};

class PublicationSession::State {
 public:
  using Clock = std::chrono::steady_clock;

  State(std::shared_ptr<Engine::Impl> engine, PublicationHeader header, ParsedRecipe recipe,
        std::unique_ptr<policy::Policy> policy, uint64_t bucket_bytes);

  // The producer thread's calls (PublicationSession's contract).
  absl::Status AddBatch(BatchInput batch);
  absl::Status AppendInline(uint64_t batch, uint32_t tensor, uint32_t part, uint64_t offset,
                            absl::Span<const uint8_t> bytes);
  absl::StatusOr<PublicationReport> Commit();
  // From any thread: ends the publication reporting `outcome` (kAborted, or kFailed for bad
  // input the caller found) when no Commit runs; otherwise records the request for the Commit
  // thread, which ends it ABORTED promptly. No-op after the end and past the point of no return.
  void Stop(absl::Status why, PublicationStatus outcome);

  uint64_t version() const { return header_.version; }
  // A group member that voted prepared and waits for its leader's decision.
  bool prepared() const { return lifecycle_.stage() == LifecycleStage::kPrepared; }
  const std::string& model_id() const { return header_.model_id; }
  absl::Time opened_at() const { return opened_at_; }
  PublicationState state() const { return lifecycle_.public_state(); }
  uint64_t num_batches() const { return num_batches_.load(); }
  uint64_t num_tensors() const { return num_tensors_.load(); }
  uint64_t bytes_ingested() const { return bytes_in_.load(); }
  uint64_t bytes_sent() const { return bytes_out_.load(); }
  uint32_t buckets_sent() const { return buckets_out_.load(); }

  // A group publication: joins it (Engine::Open, before the session is handed out). The
  // leader's abort of the version stops this publication from the vote's thread.
  absl::Status JoinGroup(const std::shared_ptr<State>& self);
  absl::Status DeclareExpected(std::vector<std::string> names);

 private:
  // The one way a publication ends: the Lifecycle's terminal transition (which tells the
  // transports to discard a version that did not commit), then Conclude. Returns the report;
  // FAILED_PRECONDITION when it had ended already (nothing is recorded twice).
  absl::StatusOr<PublicationReport> End(PublicationStatus outcome, absl::Status status);
  // End(kFailed, status) for bad input; returns `status`.
  absl::Status Reject(absl::Status status);
  // Assembles the report of `ending` (which must have ended_now) and hands it to the engine.
  PublicationReport Conclude(const Lifecycle::Ending& ending);
  // The report from what the publication has: always its identity, timing, tensor counts and
  // attempts; with phases and non-finite count once Commit ran; with the transfer's figures
  // (bytes out, buckets, host syncs, receivers' outcomes, retry errors) when the commit path
  // ended it ABORTED or COMMITTED.
  PublicationReport MakeReport(const Lifecycle::Ending& ending) const;

  // The group vote (null outside a group): set once by JoinGroup, read from any thread.
  std::shared_ptr<GroupVote> vote() const;

  // Commit's steps (session_commit.cc).
  absl::Status CheckInputs() const;  // complete, not empty, quantizes what the recipe says
  absl::StatusOr<ExecutionPlan> BuildPlan(std::vector<uint32_t>* unit_sizes);
  transport::PublicationManifest MakeManifest(const ExecutionPlan& plan) const;
  // The transfer, retried while an aborted attempt left receivers that apply on receipt dirty
  // and attempts remain. OK when one attempt succeeded; otherwise why the last one failed,
  // with *bad_input set when the backend found the trainer's input bad.
  absl::Status TransferWithRetries(const ExecutionPlan& plan,
                                   transport::PublicationManifest& manifest, bool* bad_input);
  // One attempt at the transfer: Begin on every transport, the backend's quantize/pack/emit,
  // every acknowledgement. OK when every participant holds every bucket; otherwise why not,
  // with *bad_input set when the backend found the trainer's input bad (non-finite weights).
  absl::Status Transfer(const ExecutionPlan& plan, const transport::PublicationManifest& manifest,
                        bool* bad_input);
  // After bucket `index` (of `total`) went to the transports: a debug line per bucket, and for
  // a publication open longer than kProgressEvery an info line at most every kProgressEvery.
  void LogBucket(uint32_t index, uint64_t nbytes, size_t total, const absl::Status& sent);
  static constexpr absl::Duration kProgressEvery = absl::Seconds(5);
  absl::Time last_progress_ = absl::InfinitePast();  // the publication's thread only

  // Shared so a session may outlive the Engine; the ledger points back while this publication
  // is active (the cycle ends when Record frees the slot).
  const std::shared_ptr<Engine::Impl> engine_;
  const PublicationHeader header_;
  const ParsedRecipe recipe_;
  const std::unique_ptr<policy::Policy> policy_;
  const uint64_t bucket_bytes_;
  const absl::Time opened_at_;
  const Clock::time_point t_open_;
  Lifecycle lifecycle_;

  // Producer-thread state (AddBatch/AppendInline/Commit; never touched by Stop).
  InputStore store_;
  std::vector<policy::BatchPlan> plans_;
  PhaseSeconds phases_;
  double policy_seconds_in_ingest_ = 0;
  uint64_t non_finite_ = 0;
  // Written by the publication's thread, read by GetStatus.
  std::atomic<uint64_t> bytes_out_{0};
  std::atomic<uint32_t> buckets_out_{0};
  std::map<std::string, uint64_t> bytes_by_format_;
  uint32_t num_buckets_ = 0;
  int attempts_ = 0;                       // transfers begun
  std::vector<std::string> retry_errors_;  // why each attempt before the last failed
  SyncCounter syncs_;
  std::vector<std::string> expected_;  // the declared manifest (the leader of a group)
  size_t expected_bytes_ = 0;          // its names' bytes

  mutable std::mutex vote_mu_;
  std::shared_ptr<GroupVote> vote_;  // guarded by vote_mu_

  // Read by GetStatus and reports from any thread.
  std::atomic<uint64_t> num_batches_{0};
  std::atomic<uint64_t> num_tensors_{0};
  std::atomic<uint64_t> tensors_quantized_{0};
  std::atomic<uint64_t> tensors_passthrough_{0};
  std::atomic<uint64_t> tensors_ignored_{0};
  std::atomic<uint64_t> bytes_in_{0};
};

}  // namespace wpub::engine
