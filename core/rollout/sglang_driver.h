// The SGLang engine driver: the HTTP side of publishing to unmodified SGLang engines over their
// own weight-update API (docs/specs/engines.md). It lays out the weight-update group
// (publisher rank 0, engine i's TP ranks from rank_offset_i), asks every engine to join it
// (`/init_weights_update_group`), and per publication issues the configurable lifecycle calls
// (pause with the engine's pause policy's mode, begin, one update per bucket with load_format
// "flattened_bucket", end, version, a cache flush when the policy asks for one, continue -- the
// continues of all engines together, once every engine finished). The NCCL side (the broadcasts) is
// core/nccl's; the HTTP call of a bucket and its broadcast run concurrently (the engine posts its
// receive inside the request handler).
//
// Threading: each engine has a worker that sends that engine's requests in the order they were
// posted, strictly one after another by default (bucket k+1's request never overtakes bucket
// k's, since NCCL matches broadcasts by order; requests_in_flight is the exception). Engines
// proceed independently. Public methods are called by one thread (the publication thread),
// except ResumeAfterAbort, which may race with PostBucket/EndPublication from another thread
// (an abort): once it ran, nothing more of the publication is posted. outcomes() and layout()
// are thread-safe.
//
// Engines load each bucket into their live weights as its request is handled and cannot roll
// back ("partially updated ... discard the whole weights"). After an abort, an engine that was
// sent any bucket's request may serve a mix of two versions: it is dirty and must stay paused
// until a complete version is applied; ResumeAfterAbort resumes only the others. An engine whose
// request failed (HTTP error, success=false, timeout) is marked failed with the reason; its later
// requests of the same publication are skipped; it is never reported committed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/engine/types.h"
#include "core/rollout/engine_driver.h"

namespace wpub::rollout {

class EngineRequestQueue;  // engine_requests.h
struct EngineRequest;      // engine_requests.h
class ResumeBarrier;       // engine_requests.h

// Engine-specific strings (SGLang versions differ): an empty path skips that call.
struct SglangEndpoints {
  std::string init_group = "/init_weights_update_group";
  std::string update = "/update_weights_from_distributed";
  std::string destroy_group = "/destroy_weights_update_group";
  // Its body's "mode" is the engine's pause policy's (EngineSpec::pause, SglangPauseMode).
  std::string pause = "/pause_generation";
  std::string flush = "/flush_cache";  // GET, after the update, for a policy that flushes
  std::string begin = "/begin_weight_update";
  std::string version = "/update_weight_version";
  std::string end = "/end_weight_update";
  std::string resume = "/continue_generation";
  std::string load_format = "flattened_bucket";  // empty: per-tensor broadcasts, no field sent
  std::string backend = "nccl";
  // Colocated engines (SglangDriverOptions::colocated): each bucket handed over in GPU memory.
  std::string tensor_update = "/update_weights_from_tensor";
};

struct SglangDriverOptions {
  std::vector<EngineSpec> engines;
  // What engines connect to: the TCPStore served by the publisher (core/rendezvous).
  std::string master_address = "127.0.0.1";
  uint16_t master_port = 0;
  std::string group_name = "wpub_weights";
  SglangEndpoints endpoints;
  // `flush_cache` field of every update request.
  bool flush_cache_on_update = false;
  absl::Duration connect_timeout = absl::Seconds(5);
  // Per request (an update request lasts as long as its bucket's broadcast).
  absl::Duration request_timeout = absl::Seconds(120);
  // Update requests per engine in flight at once. 1 (the default) is what SGLang needs: it
  // posts a bucket's receive when it handles that bucket's request, in arrival order. With 2
  // or more, the engine decodes bucket k+1's request while bucket k's broadcast runs, and every
  // update body carries "wpub_sequence" (the bucket's index in the publication): only for
  // engines that receive in that order (nccl::ReceiverEndpoint, e.g. wpub-recv), since NCCL
  // matches broadcasts by order. Lifecycle calls never overlap anything.
  int requests_in_flight = 1;
  // Per engine (same order as `engines`), what the family's probe found (SglangFamily::Profile);
  // empty: every route of `endpoints` is served. An engine is never sent a route it lacks:
  // without the session routes (releases before the weight-update session) it gets no begin/end;
  // without /update_weight_version no version call. When any engine lacks "flattened_bucket"
  // (kFlattenedBucket: releases before it) the whole group receives one broadcast per tensor
  // (the engines of a group receive the same broadcasts). `weight_version` rides on update
  // requests only to engines whose profile says bucket_versions (SGLang adopts a bucket's
  // version as soon as it loads: the engine would report a version it does not wholly hold).
  std::vector<EngineProfile> profiles;
  // Colocated engines (family "sglang-ipc"): the engines run on this node and read each bucket
  // in wpub's GPU memory. There is no weight-update group to join or leave; each bucket's
  // request is `endpoints.tensor_update` with one pickled CUDA IPC tensor per TP rank
  // (TensorUpdateBody), in the same session of pause, begin, end, version and continue.
  bool colocated = false;
};

// The /pause_generation mode of an in-flight policy SGLang serves: "abort", "retract",
// "in_place" (kKeep); "" for kWait.
std::string SglangPauseMode(engine::PausePolicy::InFlight in_flight);

// EngineProfile::lacks of an SGLang release that predates the flattened bucket of mixed dtypes.
inline constexpr std::string_view kFlattenedBucket = "flattened_bucket";

class SglangDriver final : public EngineDriver {
 public:
  static absl::StatusOr<std::unique_ptr<SglangDriver>> Create(const SglangDriverOptions& options);
  // Drops queued requests, aborts those in flight and joins the worker threads (callers that
  // need a request delivered, e.g. Leave's, wait for it with WaitIdle first).
  ~SglangDriver() override;
  SglangDriver(const SglangDriver&) = delete;
  SglangDriver& operator=(const SglangDriver&) = delete;

  const GroupLayout& layout() const override { return layout_; }
  const std::vector<EngineSpec>& engines() const override { return options_.engines; }
  const SglangDriverOptions& options() const { return options_; }

  // Posts /init_weights_update_group to every engine (non-blocking). The publisher must set
  // the NCCL unique id in its TCPStore and start its own (nonblocking) communicator init before
  // or concurrently: an engine that initializes eagerly answers only once rank 0 joined.
  void StartJoin() override;
  // Waits for every join answer. ABORTED naming the failed engines, DEADLINE_EXCEEDED naming
  // the silent ones.
  absl::Status WaitIdle(absl::Time deadline) override;

  // Starts a publication: resets outcomes (the pause is queued with the first bucket).
  void BeginPublication(uint64_t version, bool lifecycle_calls) override;
  // Queues the update request of one bucket (non-blocking; in order per engine).
  void PostBucket(const transport::BucketManifest& bucket,
                  const transport::SharedDeviceBytes* shared = nullptr) override;
  // Broadcast engines whose every profile says bucket_patches (wpub's own receivers).
  bool TakesPatches() const override;
  // PostBucket's request with "wpub_patch" (core/rollout/update_request.h).
  void PostPatchedBucket(const transport::BucketManifest& bucket,
                         const UpdatePatch& patch) override;
  // Queues end, version, the flush (policies that flush), and continue: every engine's
  // continue waits until every engine answered the calls before it (ResumeBarrier).
  void EndPublication() override;
  // After an aborted publication: drops the requests not yet sent and ends the publication
  // (later PostBucket/EndPublication calls are ignored), queues end_weight_update for every
  // engine that was asked to begin (dirty ones too: SGLang kills itself at the next begin on a
  // session left open), then continue for every engine that is clean: sent no bucket request of
  // this publication and not in `dirty` (engine URLs left dirty by earlier aborts, which the caller
  // keeps across groups). Returns, per engine, whether it is dirty now: those stay paused. No-op
  // returning `dirty`'s verdicts after EndPublication or a first call. Thread-safe against the
  // publication thread's calls.
  std::vector<bool> ResumeAfterAbort(const std::set<std::string>& dirty = {}) override;
  // Drops the requests not yet sent, then queues destroy_weights_update_group.
  void Leave() override;

  // Per engine, for the current publication (or join).
  std::vector<EngineOutcome> outcomes() const override;
  bool any_failed() const override;
  // One broadcast per tensor when the group receives per-tensor broadcasts (an engine lacks the
  // flattened bucket, or the endpoints' load_format is empty); else the whole bucket.
  std::vector<uint64_t> BroadcastChunks(const transport::BucketManifest& bucket) const override;
  // The load_format update requests carry ("" : per-tensor broadcasts).
  const std::string& load_format() const { return load_format_; }

 private:
  SglangDriver(SglangDriverOptions options, GroupLayout layout);
  // Queues one request per engine (none when `path` is empty); `customize` sets its optional
  // fields.
  // POST or GET `path` on every engine with the body `body_of` gives it (nullopt: that engine
  // is skipped).
  void PostEach(const std::string& method, const std::string& path,
                const std::function<std::optional<std::string>(size_t)>& body_of,
                void (*customize)(EngineRequest&) = nullptr);
  void PostAll(const std::string& method, const std::string& path, const std::string& body_json,
               void (*customize)(EngineRequest&) = nullptr);
  // Engine `engine`'s profile says it lacks `path`.
  bool Lacks(size_t engine, const std::string& path) const;
  // Queues POST `path` {} to engine `engine` to be sent even after the engine failed and past a
  // teardown (EngineRequest::always): an abort's end and resume. Nothing for an empty path or
  // one the engine lacks.
  void PostClosing(size_t engine, const std::string& path);
  // Queues the calls that precede a publication's first bucket (pause, begin), once per
  // publication, at its first bucket (or its end): the engines keep serving while wpub checks
  // the inputs and packs the first bucket. post_mu_ held.
  void PauseLocked();
  // PostBucket of a broadcast engine set (patch: PostPatchedBucket's). The update requests of
  // each engine whose profile says bucket_patches carry wpub_sequence, by which it keeps its
  // buckets.
  void PostUpdate(const transport::BucketManifest& bucket, const UpdatePatch* patch);
  // PostBucket of a colocated engine set: each engine's /update_weights_from_tensor request.
  void PostSharedBucket(const transport::BucketManifest& bucket,
                        const transport::SharedDeviceBytes* shared);

  const SglangDriverOptions options_;
  const GroupLayout layout_;
  std::string load_format_;  // options_.endpoints.load_format, or "" (see profiles)
  // Orders the posts of a publication against an abort's ResumeAfterAbort.
  std::mutex post_mu_;
  uint64_t version_ = 0;         // guarded by post_mu_
  bool closed_ = true;           // guarded by post_mu_: the publication ended (or none began)
  bool lifecycle_calls_ = true;  // guarded by post_mu_: BeginPublication's
  bool paused_ = false;          // guarded by post_mu_: this publication's pause was posted
  // The resumes of the publication in progress (released at teardown); guarded by post_mu_.
  std::shared_ptr<ResumeBarrier> resumes_;
  std::vector<std::unique_ptr<EngineRequestQueue>> workers_;
};

// The SGLang family (engine_driver.h): drivers from `options` (its engines, master address/port
// and group name replaced by each group's address), probes at `health_endpoint`, versions from
// `model_info_endpoint` (either empty: not asked; every engine is up, serving version 0).
struct SglangFamilyOptions {
  SglangDriverOptions driver;
  std::string health_endpoint = "/health";
  std::string model_info_endpoint = "/get_model_info";
  // The first release whose update route takes a flattened bucket of mixed dtypes (SGLang PRs
  // #13413 and #13824, November 2025): engines reporting an older release get one broadcast per
  // tensor. Empty: never.
  std::string flattened_bucket_since = "0.5.6";
};

// The family's name for the colocated form ("sglang-ipc").
inline constexpr std::string_view kSglangIpcFamily = "sglang-ipc";

class SglangFamily final : public EngineFamily {
 public:
  explicit SglangFamily(SglangFamilyOptions options) : options_(std::move(options)) {}
  std::string_view name() const override {
    return options_.driver.colocated ? kSglangIpcFamily : std::string_view("sglang");
  }
  std::vector<bool> Probe(const std::vector<EngineSpec>& engines,
                          absl::Duration timeout) const override;
  std::vector<uint64_t> WeightVersions(const std::vector<EngineSpec>& engines,
                                       absl::Duration timeout) const override;
  // GETs of the weight-update routes (404: the engine lacks it; 401/403: an API key is needed)
  // and of /server_info or /get_server_info (the release); see SglangDriverOptions::profiles.
  std::vector<absl::StatusOr<EngineProfile>> Profile(const std::vector<EngineSpec>& engines,
                                                     absl::Duration timeout) const override;
  absl::StatusOr<std::unique_ptr<EngineDriver>> CreateDriver(
      const GroupAddress& address) const override;
  absl::Duration request_timeout() const override { return options_.driver.request_timeout; }
  absl::Duration connect_timeout() const override { return options_.driver.connect_timeout; }
  // abort:flush|keep, retract:keep, keep:keep (wait: no SGLang mode lets in-flight requests
  // finish; a flush after retract or keep: SGLang refuses /flush_cache while requests wait or
  // run).
  absl::StatusOr<engine::PausePolicy> ResolvePause(
      const engine::PausePolicy& policy) const override;

 private:
  const SglangFamilyOptions options_;
};

// JSON bodies (exposed for tests). UpdateBody: `load_format` as the group receives;
// `version` empty: no weight_version field.
std::string InitGroupBody(const SglangDriverOptions& options, const GroupLayout& layout,
                          size_t engine);
std::string UpdateBody(const SglangDriverOptions& options, const transport::BucketManifest& bucket,
                       const std::string& load_format, const std::string& version);
// A colocated engine's /update_weights_from_tensor body for one bucket shared in GPU memory:
// {"serialized_named_tensors": [base64 of SglangFlattenedBucketPickle per TP rank, rank r's
// tensor decrementing reference-counter slot shared.ref_counter_offset + first_slot + r],
// "load_format": "flattened_bucket", "flush_cache": false} (the cache is flushed once, after the
// update, as the pause policy says). INVALID_ARGUMENT naming the tensor that does not fit.
absl::StatusOr<std::string> TensorUpdateBody(const transport::BucketManifest& bucket,
                                             const transport::SharedDeviceBytes& shared,
                                             int tp_ranks, uint64_t first_slot);

// An SGLang release ("0.5.5.post3", "v0.5.16") before `minimum` ("0.5.6"), compared by their
// leading numeric components; false when either has none (unknown: assumed current).
bool ReleaseBefore(absl::string_view release, absl::string_view minimum);

}  // namespace wpub::rollout
