// The publication engine: the daemon's core behind the gRPC server. It owns the publication
// state machine (OPEN -> STAGED -> COMMITTED | ABORTED; lifecycle.h), applies the precision
// policy, plans buckets, quantizes and packs them through a backend (the CPU reference, or the
// GPU backend given as a component), hands every bucket to its transports through the transport
// group (transport_group.h) and commits only when every receiver acknowledged every bucket.
// What it does is told to the caller's EngineObserver (observer.h; the daemon's metrics).
//
// Error contract: bad input ends the publication with INVALID_ARGUMENT / FAILED_PRECONDITION /
// NOT_FOUND / UNIMPLEMENTED / OUT_OF_RANGE and a message naming the tensor, part or header
// field; the engine keeps serving and the previous committed version stays current.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/engine/backend.h"
#include "core/engine/group_vote.h"
#include "core/engine/observer.h"
#include "core/engine/rollout_connector.h"
#include "core/engine/types.h"
#include "core/transport/pull_transport.h"
#include "core/transport/retained_copy.h"
#include "core/transport/transport.h"

namespace wpub::engine {

struct EngineOptions {
  // Default bucket size (PublicationHeader::bucket_bytes overrides it per publication). A
  // tensor larger than a bucket gets a bucket of its own.
  uint64_t bucket_bytes = uint64_t{256} << 20;
  // Smallest and largest bucket size a header may ask for.
  uint64_t min_bucket_bytes = uint64_t{1} << 10;
  uint64_t max_bucket_bytes = uint64_t{4} << 30;
  // After the last bucket was sent, how long receivers have to acknowledge everything before
  // the publication aborts (reason "timeout").
  absl::Duration ack_deadline = absl::Seconds(60);
  // Fewer connected receivers than this at Commit, or fewer taking part when a transfer attempt
  // begins (a receiver may leave in between): the publication aborts (FAILED_PRECONDITION in
  // the report). 0 lets a publication commit with nobody listening.
  size_t min_receivers = 0;
  // Upper bound of the bytes one publication may stage in inline buffers (OUT_OF_RANGE beyond).
  uint64_t max_inline_bytes = uint64_t{64} << 30;
  // Versions: a header's version must be at most max_version (2^53 by default, exact in every
  // JSON, Python and Prometheus consumer) and at most max_version_step above the version the
  // engine must exceed, so that no single publication can use up the version space.
  uint64_t max_version = uint64_t{1} << 53;
  uint64_t max_version_step = uint64_t{1} << 32;
  // Reports kept for RecentReports / EngineStatus::last_reports.
  size_t report_history = 64;
  size_t status_reports = 8;
  // Worker threads of the CPU backend's quantizer (>= 1).
  int cpu_threads = 1;
  // Transfers of one version within one Commit (>= 1). An attempt that fails after receivers
  // that apply on receipt (TransportCapabilities::applies_on_receipt) got some of its bytes
  // leaves them dirty; while attempts remain, the engine transfers the version again from the
  // inputs it still holds (the transports re-form what failed) so they end with a complete
  // version. Failures that left nobody dirty, bad input and abort requests are not retried.
  int max_attempts = 3;
  // Free the backend's memory after every publication (Backend::ReleaseMemory; wpubd
  // --release_gpu_memory): a trainer and a colocated engine sharing one GPU get wpub's staging
  // buffers back between publications, at the price of allocating them again (host
  // synchronizations, counted) at the next. A publication can ask for it alone
  // (PublicationHeader::release_backend_memory).
  bool release_backend_memory = false;
  transport::PullTransportOptions pull;
  // The retained copy of the committed version (core/transport/retained_copy.h): where it lives
  // and its bound. With one, engines an abort left dirty are restored and engines and pull
  // receivers that join behind are caught up (core/engine/replay.h); off by default.
  transport::RetainedCopyOptions retain;
  // Bucket patches to pull receivers that hold the committed version and accept them
  // (transport::PatchSource, core/delta/bucket_patch.h), made from the retained copy: needs
  // `retain` on (INVALID_ARGUMENT otherwise).
  struct Patches {
    bool enabled = false;
    uint32_t full_every = 8;  // PatchSource::full_every
    // delta::BucketPatchOptions::max_patch_fraction, in (0, 1] (INVALID_ARGUMENT otherwise);
    // a device copy's diff keeps a buffer of this fraction of the largest bucket.
    double max_patch_fraction = 0.5;
  } patches;
};

// Parts an engine may be given instead of its defaults (the GPU path). Everything is optional.
struct EngineComponents {
  // Replaces the CPU backend (e.g. the GPU backend).
  std::unique_ptr<Backend> backend;
  // Transports driven for every publication before the pull transport (e.g. the NCCL
  // weight-update group), in order. Begin/Send/Commit/Abort reach every one; the engine waits
  // for each one's acknowledgements in turn against the same deadline.
  std::vector<std::unique_ptr<transport::Transport>> transports;
  // Accepts CUDA IPC parts (without one they are UNIMPLEMENTED). The backend must read the
  // device pointers it returns.
  std::unique_ptr<CudaIpcResolver> cuda_ipc;
  // Serves Engine::ConnectEngines (the NCCL transport). Not owned: it must be one of the
  // components above (e.g. the transport in `transports`), so it lives as long as the engine.
  RolloutConnector* connector = nullptr;
  // A connector that is not one of the transports (e.g. one that routes a request between
  // several of them): owned by the engine, and used when `connector` is null.
  std::unique_ptr<RolloutConnector> owned_connector;
  // Joins publications whose header names a group (PublicationHeader::group) to it. Not owned;
  // it must outlive the engine. Without one such headers are FAILED_PRECONDITION.
  GroupJoiner* group_joiner = nullptr;
  // Holds the retained copy's bytes for EngineOptions::retain.where kDevice / kPinned (the GPU
  // path's, core/gpu/retained_memory.h); without one those are INVALID_ARGUMENT.
  std::shared_ptr<transport::RetainedMemory> retained_memory;
};

class PublicationSession;

// Thread-safe: every method may be called from any thread. Destroy sessions before the Engine
// (the gRPC server shuts down before the core); a session that outlives it keeps the engine's
// internals alive, and its Commit then ends ABORTED (the transports are shut down).
class Engine {
 public:
  // `observer` may be null; when given it must outlive the Engine and its sessions.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        EngineObserver* observer);
  // As above, with a custom backend and/or additional transports (owned by the engine).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        EngineObserver* observer,
                                                        EngineComponents components);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Opens publication `header.version`. Errors (the engine state is unchanged by them):
  // - FAILED_PRECONDITION naming the active version when one is open (header.queue == false);
  //   with header.queue, blocks until it ends (DEADLINE_EXCEEDED after header.queue_timeout);
  // - FAILED_PRECONDITION for a version <= the committed version (naming both), or <= the
  //   version a connected pull receiver holds (PullTransport::CheckVersionAhead), or <= the
  //   highest version a connected engine reported serving when it joined (naming it): a
  //   restarted daemon never publishes backwards;
  // - for a header with a group: INVALID_ARGUMENT from ValidateGroupMembership,
  //   FAILED_PRECONDITION without a group joiner, and the joiner's errors (a member joining
  //   with another version than the group's, a member index taken, the leader unreachable);
  // - INVALID_ARGUMENT naming the field for version 0, a version above
  //   EngineOptions::max_version or more than max_version_step above that floor, an unknown
  //   recipe, a bucket size out of
  //   range, invalid quantization_config_json / policy_json (e.g. an invalid regex rule);
  // - UNAVAILABLE after BeginShutdown.
  absl::StatusOr<std::unique_ptr<PublicationSession>> Open(const PublicationHeader& header);

  // Replaces the engine set of the GPU path and forms its weight-update group (blocks for the
  // connector's health probes and joins; no engine lock is held meanwhile). Errors, in order:
  // - INVALID_ARGUMENT from ValidateRolloutConnectRequest (on every daemon);
  // - FAILED_PRECONDITION "this daemon has no GPU path ..." without a connector;
  // - UNAVAILABLE after BeginShutdown;
  // - FAILED_PRECONDITION naming the active version while a publication is open, or when
  //   another ConnectEngines is in progress (nothing changes then);
  // - the connector's errors (UNAVAILABLE / DEADLINE_EXCEEDED naming the engines).
  // While it runs, Open refuses (or, with header.queue, waits) as for an active publication.
  absl::StatusOr<RolloutGroupInfo> ConnectEngines(const RolloutConnectRequest& request);
  // The weight-update group; nullopt without a connector. Never blocks on a ConnectEngines.
  std::optional<RolloutGroupInfo> EngineGroup() const;

  // Replays the retained committed version to every engine (restoring the dirty ones) and to
  // every pull receiver behind it, on the calling thread (an operator's restore: `wpubctl
  // restore`). Errors, nothing sent: FAILED_PRECONDITION naming why nothing is retained, for a
  // group version, or naming what holds the slot (a publication, a ConnectEngines, another
  // replay); UNAVAILABLE after BeginShutdown. Otherwise the replay's report: `completed`, or
  // why not (a receiver failed, a publication preempted it).
  absl::StatusOr<ReplayReport> Restore(std::string trigger);

  // Snapshot; never blocks on a publication in progress.
  EngineStatus GetStatus() const;
  // The last `n` reports (all outcomes), newest first.
  std::vector<PublicationReport> RecentReports(size_t n) const;

  // The receiver side of the gRPC-pull transport (owned by the Engine).
  transport::PullTransport* pull_transport();

  // Open fails with UNAVAILABLE from now on; a publication in progress continues.
  void BeginShutdown();
  // Waits until no publication is active. If one is still active at `deadline` it is aborted
  // (its Commit returns an ABORTED report) and DEADLINE_EXCEEDED is returned; otherwise OK --
  // except a group version in doubt here (voted prepared, the leader's decision unknown): it is
  // not aborted, its receivers are told nothing, and UNAVAILABLE says so (the group joiner's
  // shutdown then ends its wait). Then closes every subscription. Implies BeginShutdown.
  absl::Status Drain(absl::Time deadline);

 private:
  friend class PublicationSession;
  friend class Replayer;
  class Impl;
  explicit Engine(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with live sessions
};

// One publication, driven by a single producer thread (the Publish RPC handler): AddBatch and
// AppendInline in any interleaving, then Commit. Abort may also be called from another thread
// (e.g. on client cancellation or shutdown). Any non-OK return from AddBatch, AppendInline or
// Commit ends the publication (FAILED report, previous version current); later calls return
// FAILED_PRECONDITION. Destroying a session that was not committed aborts it ("cancelled").
class PublicationSession {
 public:
  ~PublicationSession();
  PublicationSession(const PublicationSession&) = delete;
  PublicationSession& operator=(const PublicationSession&) = delete;

  uint64_t version() const { return version_; }

  // Adds conversion batch number num_batches() (0-based, in call order). Validates every tensor
  // (known dtype, shape vs parts, concat_dim, part byte counts, shm segment names, shm ranges
  // vs the segment size (OUT_OF_RANGE), duplicate names within the publication, CUDA IPC parts
  // (UNIMPLEMENTED unless EngineComponents::cuda_ipc resolves them)) and applies the policy
  // (K % 16, gate/up pairs). Shared-memory parts are mapped here; inline parts get buffers.
  // Non-blocking apart from shm_open/mmap (and the CUDA IPC resolver).
  absl::Status AddBatch(BatchInput batch);
  uint64_t num_batches() const;

  // Copies `bytes` to [offset, offset + bytes.size()) of the inline part `part_index` of tensor
  // `tensor_index` of batch `batch_index`. INVALID_ARGUMENT naming the tensor for an unknown
  // index, a non-inline part, or a range beyond the part ("chunk overflow"). Overlapping
  // chunks are allowed (the last write wins); completeness is checked by Commit.
  absl::Status AppendInline(uint64_t batch_index, uint32_t tensor_index, uint32_t part_index,
                            uint64_t offset, absl::Span<const uint8_t> bytes);

  // The leader of a group (group.member 0) only: adds names to the model's declared manifest,
  // the tensors the group must publish, each exactly once (checked before any byte moves). Any
  // number of calls before Commit. FAILED_PRECONDITION naming the member on another member or
  // outside a group; INVALID_ARGUMENT past kMaxGroupTensors names or kMaxGroupNameBytes
  // bytes of names, or for a name that is empty or longer than kMaxGroupTensorNameBytes
  // (group_vote.h).
  absl::Status DeclareExpected(std::vector<std::string> names);

  // Blocks: checks completeness (a missing inline chunk is INVALID_ARGUMENT naming the
  // tensor), quantizes, packs, transfers, waits for every receiver's acknowledgement, commits.
  // - Bad input (incomplete data, empty publication, non-finite weights when rejected):
  //   returns that Status (the report, status FAILED, is in RecentReports).
  // - Receiver/transport failure, Abort or Drain deadline: returns a report with status
  //   ABORTED naming the failed receivers; every receiver was told to discard the version.
  // - Success: a COMMITTED report; the version is current.
  // Callable once; FAILED_PRECONDITION afterwards or after the publication ended.
  absl::StatusOr<PublicationReport> Commit();

  // Ends the publication (ABORTED, code of `why`) from any thread; a Commit in progress returns
  // an ABORTED report promptly unless it has begun committing (it then commits). No-op after.
  void Abort(absl::Status why);
  // As Abort, but the report (and wpub_publications_total) says FAILED: the caller found the
  // publication's input bad (e.g. a malformed stream the server rejects), as the engine reports
  // bad input it finds itself. A Commit already in progress still ends ABORTED.
  void Fail(absl::Status why);

 private:
  friend class Engine;
  friend class PublicationLedger;  // holds the active publication's State (ledger.h)
  // The publication itself (engine_impl.h); its lifecycle is a Lifecycle (lifecycle.h).
  class State;
  PublicationSession(uint64_t version, std::shared_ptr<State> state);
  uint64_t version_;
  std::shared_ptr<State> state_;
};

}  // namespace wpub::engine
