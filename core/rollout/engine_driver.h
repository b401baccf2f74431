// What the rollout group (rollout_group.h) needs from a family of rollout engines (SGLang today):
// the engine list and its rank layout, and a driver per weight-update group that speaks the
// family's HTTP protocol around the broadcasts -- join, the lifecycle calls of a publication
// (pause .. begin, one update request per bucket, version .. continue), the resume after an
// abort, leave. The NCCL side (rendezvous store, communicator, broadcasts) is the group's: a
// second family plugs in here without touching it. No CUDA, no NCCL.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/engine/rollout_connector.h"
#include "core/engine/types.h"
#include "core/rollout/update_request.h"
#include "core/transport/group_channel.h"

namespace wpub::rollout {

struct EngineSpec {
  std::string url;                // "http://host:port"
  int gpus = 1;                   // TP ranks that join the group
  std::string family = "sglang";  // the engine's protocol: "sglang" | "vllm" (EngineFamily::name)
  // Sent as "Authorization: Bearer <token>" with every request to this engine (an engine that
  // checks an API key on its weight routes answers 401 without it; vLLM's --api-key guards only
  // its /v1 routes, so sending it there is harmless); empty: none. Never logged or reported.
  std::string auth_token = "";
  // What the engine does with its requests and cache while paused (its engine set's policy).
  engine::PausePolicy pause = {};
};

// SplitEngineFamily ("vllm+http://..."): core/engine/rollout_connector.h.
using engine::SplitEngineFamily;

// "http://host:30000=2,vllm+http://other:8000" (wpubd --engines, wpubctl connect-engines) ->
// engines (GPU count after the last '=', default 1; the family from the URL's "vllm+" or
// "sglang+" prefix, default sglang; spaces around entries dropped).
// INVALID_ARGUMENT naming the entry for an empty URL or a GPU count that is not a positive
// integer, or for no entry at all. URLs are not checked further here (ConnectEngines validates
// them).
absl::StatusOr<std::vector<EngineSpec>> ParseEngineSpecs(absl::string_view text);

// The group as the engines see it.
struct GroupLayout {
  std::string group_name;
  int world_size = 1;             // 1 + sum of engine GPUs
  std::vector<int> rank_offsets;  // per engine; the publisher is rank 0
};

// ConnectEngines' pure part: ranks and world size. INVALID_ARGUMENT for no engines, a
// non-positive GPU count, an empty URL or group name.
absl::StatusOr<GroupLayout> LayoutGroup(const std::vector<EngineSpec>& engines,
                                        const std::string& group_name);

// When one engine stopped and started serving around a publication attempt, as wpub saw the
// answers (EngineRequest::pauses / resumes / update). InfinitePast: not (yet) seen.
struct PauseTimes {
  absl::Time paused = absl::InfinitePast();        // the pause's answer arrived
  absl::Time first_update = absl::InfinitePast();  // the first bucket's update request was sent
  absl::Time last_update = absl::InfinitePast();   // the last update request's answer arrived
  absl::Time resumed = absl::InfinitePast();       // the resume's answer arrived
};

// The engine's pause window of an attempt from its answer times (`now` closes a window whose
// resume was not answered). Not paused: all zero.
transport::PauseWindow PauseWindowOf(const PauseTimes& t, absl::Time now);

struct EngineOutcome {
  std::string url;
  PauseTimes pause;
  bool failed = false;
  std::string error;      // the first failure of the current publication (or join)
  uint64_t requests = 0;  // requests answered successfully in the current publication
  // Bucket update requests sent to the engine (answered or not) in the current publication:
  // more than 0 means it may hold bytes of it.
  uint64_t updates_sent = 0;
  // Bucket update requests the engine answered successfully in the current publication (a
  // colocated channel whose engines copy a bucket before answering releases it on this).
  uint64_t updates_answered = 0;
  // The last refusal of a call that may fail without failing the engine (e.g. a cache flush
  // the engine could not do), for the logs; "" when none.
  std::string warning;
};

// What one engine offers, as its family's probe found it at join (EngineFamily::Profile) with
// requests that change nothing on the engine. Drivers speak to each engine accordingly.
struct EngineProfile {
  // The engine's release as it reports it ("0.5.16"); "" when it does not say.
  std::string release;
  // What the engine lacks: the optional routes it answered 404 for ("/begin_weight_update"), and
  // named features its release predates ("flattened_bucket").
  std::set<std::string, std::less<>> lacks;
  // The engine takes "weight_version" on each bucket's update request without serving it before
  // the publication ends (wpub's own receivers declare it in their server info). SGLang adopts a
  // bucket's version as soon as that bucket loads, so it is told the version only at the end.
  bool bucket_versions = false;
  // The engine takes format 3 bucket patches in place of a bucket's broadcast (update requests
  // with "wpub_patch", core/rollout/update_request.h): its server info lists 3 in
  // "wpub_bucket_patches" (wpub's own receivers, nccl::ReceiverEndpoint with patches on).
  bool bucket_patches = false;
  bool Lacks(std::string_view what) const { return lacks.find(what) != lacks.end(); }
};

// Where the engines of one group rendezvous: the TCPStore the rollout group serves.
struct GroupAddress {
  std::vector<EngineSpec> engines;  // in rank order
  // Per engine (same order), what its probe found; empty: nothing probed (every route assumed).
  std::vector<EngineProfile> profiles;
  std::string master_address = "127.0.0.1";
  uint16_t master_port = 0;
  std::string group_name;
};

// One weight-update group's HTTP side. Contract (every family): methods are called by one
// thread (the publication thread) except ResumeAfterAbort, which may race with PostBucket /
// EndPublication from another thread (an abort) and after which nothing more of the publication
// is posted; outcomes(), any_failed(), layout() and engines() are thread-safe. Requests to one
// engine go in the order they were posted (NCCL matches broadcasts by order); engines proceed
// independently. An engine whose request failed is never reported committed.
class EngineDriver {
 public:
  virtual ~EngineDriver() = default;
  virtual const GroupLayout& layout() const = 0;
  virtual const std::vector<EngineSpec>& engines() const = 0;
  // Asks every engine to join (non-blocking). The publisher must have put the NCCL unique id in
  // its store and started its own nonblocking communicator init before or concurrently.
  virtual void StartJoin() = 0;
  // Waits for every request posted so far: ABORTED naming the failed engines,
  // DEADLINE_EXCEEDED naming the silent ones.
  virtual absl::Status WaitIdle(absl::Time deadline) = 0;
  // Resets outcomes for publication `version`. The calls that precede the first bucket (the
  // pause, the family's begin) are queued with the first bucket (PostBucket), not here: the
  // engines serve until wpub has a bucket ready to send, and an abort before it leaves them
  // untouched (no resume owed). Without `lifecycle_calls` (a member of a publication group
  // other than its leader; the leader makes them once per engine per version) the publication
  // posts update requests only: nothing before the first bucket, nothing at EndPublication, no
  // resume after an abort.
  virtual void BeginPublication(uint64_t version, bool lifecycle_calls) = 0;
  // Queues the update request of one bucket (non-blocking; the engine posts its receive in the
  // request's handler, so the caller issues it before the bucket's broadcast); the first one of
  // a publication is preceded by the pause and begin calls. `shared`: the bucket as a colocated
  // channel hands it over in GPU memory (GroupChannel::Share), which the request carries; null
  // for a channel that broadcasts it.
  virtual void PostBucket(const transport::BucketManifest& bucket,
                          const transport::SharedDeviceBytes* shared = nullptr) = 0;
  // Whether every engine of the group takes bucket patches (EngineProfile::bucket_patches) over
  // this driver's broadcasts; only then is PostPatchedBucket called.
  virtual bool TakesPatches() const { return false; }
  // Queues the update request of one bucket whose broadcast (one, of patch.bytes) carries its
  // format 3 patch instead of its bytes, as PostBucket does otherwise. Called only when
  // TakesPatches(); the default posts nothing.
  virtual void PostPatchedBucket(const transport::BucketManifest& bucket,
                                 const UpdatePatch& patch) {
    (void)bucket, (void)patch;
  }
  // The broadcasts one bucket is sent as, by byte size in order (the engines receive it in
  // these pieces): the whole bucket for SGLang's flattened bucket, vLLM's packed chunks.
  virtual std::vector<uint64_t> BroadcastChunks(const transport::BucketManifest& bucket) const {
    return {bucket.nbytes};
  }
  // Queues the calls that apply the version and resume generation.
  virtual void EndPublication() = 0;
  // After an aborted publication: drops what was not sent, resumes every engine that holds
  // nothing of it and is not in `dirty`; returns per engine whether it is dirty now (those stay
  // paused).
  virtual std::vector<bool> ResumeAfterAbort(const std::set<std::string>& dirty) = 0;
  // Drops what was not sent, then asks every engine to leave the group.
  virtual void Leave() = 0;
  virtual std::vector<EngineOutcome> outcomes() const = 0;
  virtual bool any_failed() const = 0;
};

// A family of engines: how to probe them, what version they serve, and their driver. Shared by
// the rollout group for its lifetime; thread-safe (const).
class EngineFamily {
 public:
  virtual ~EngineFamily() = default;
  virtual std::string_view name() const = 0;  // "sglang"
  // Per engine, whether it is up (answered its health check within `timeout`).
  virtual std::vector<bool> Probe(const std::vector<EngineSpec>& engines,
                                  absl::Duration timeout) const = 0;
  // Per engine, the weight version it serves (0: none or unknown).
  virtual std::vector<uint64_t> WeightVersions(const std::vector<EngineSpec>& engines,
                                               absl::Duration timeout) const = 0;
  // Per engine, what it offers (its release, the optional routes it lacks), probed with requests
  // that change nothing on the engine, within `timeout`; or an error naming the engine and why
  // it cannot take publications (it requires an API key wpubd was not given, it lacks a route
  // wpub needs, its release is too old). Called on engines that passed Probe, before the join.
  // Default: nothing probed.
  virtual std::vector<absl::StatusOr<EngineProfile>> Profile(const std::vector<EngineSpec>& engines,
                                                             absl::Duration /*timeout*/) const {
    return std::vector<absl::StatusOr<EngineProfile>>(engines.size(), EngineProfile{});
  }
  // A driver for the group at `address` (address.profiles: Profile's answers, or empty).
  virtual absl::StatusOr<std::unique_ptr<EngineDriver>> CreateDriver(
      const GroupAddress& address) const = 0;
  // The TCPStore entries from which the family's engines read the NCCL unique id (`id`, 128
  // bytes); nullopt: the rollout group's unique-id key templates (torch.distributed's
  // rendezvous, SGLang).
  using StoreEntry = std::pair<std::string, std::string>;  // key, value
  virtual std::optional<std::vector<StoreEntry>> UniqueIdEntries(
      absl::Span<const uint8_t> /*id*/) const {
    return std::nullopt;
  }
  // The engines' ranks run a one-element float32 sum all-reduce right after their communicator
  // is initialized (vLLM's PyNcclCommunicator): the publisher must match it before they answer
  // their join.
  virtual bool warmup_all_reduce() const { return false; }
  // Bound of one request (an update request lasts as long as its bucket's broadcast), and of a
  // health probe.
  virtual absl::Duration request_timeout() const = 0;
  virtual absl::Duration connect_timeout() const = 0;
  // `policy` as the family's engines carry it out with their own pause routes (its
  // Cache::kDefault resolved to what the family can do), or INVALID_ARGUMENT saying what the
  // family lacks (e.g. SGLang has no mode that lets in-flight requests finish). Checked before
  // any engine of a set is contacted.
  virtual absl::StatusOr<engine::PausePolicy> ResolvePause(
      const engine::PausePolicy& policy) const = 0;
};

// Family-neutral HTTP reads of every engine, concurrently (engine_requests.cc).
// GETs `path` on every engine concurrently; true where the engine answered 2xx within
// `timeout`. Used to leave dead engines out when (re-)forming a group.
std::vector<bool> ProbeEngines(const std::vector<EngineSpec>& engines, const std::string& path,
                               absl::Duration timeout);

// One engine's answer to a GET of one of its routes in a capability probe (ProbeRoutes).
struct RouteAnswer {
  int status = 0;          // the HTTP status; 0: no answer (error says why)
  std::string body;        // bounded as every engine answer
  std::string error;       // the transport error when there was no answer
  bool timed_out = false;  // no answer because the probe's time ran out (a silent engine)
};
// GETs each of `paths` on `engine`, one after another over one connection, all of them within
// `timeout`; stops at the first that gets no answer in the time left (the rest get none either). A
// FastAPI server answers 405 for a route it serves for another method and 404 for one it lacks.
std::vector<RouteAnswer> ProbeRoutes(const EngineSpec& engine,
                                     const std::vector<std::string>& paths, absl::Duration timeout);

// Probes every engine concurrently (one thread each): ProbeRoutes of `paths` within `timeout`,
// then `read` turns the answers into the engine's profile, or the error that refuses it.
std::vector<absl::StatusOr<EngineProfile>> ProfileEngines(
    const std::vector<EngineSpec>& engines, const std::vector<std::string>& paths,
    absl::Duration timeout,
    const std::function<absl::StatusOr<EngineProfile>(const EngineSpec&,
                                                      const std::vector<RouteAnswer>&)>& read);

// The error for a probe answer that says the engine cannot be used (nullopt: it can): no
// answer; HTTP 401/403 (the engine requires an API key: wpubd's --engine_api_key_file). `what`
// names the engine and route ("engine URL GET /path").
std::optional<absl::Status> ProbeRefusal(const std::string& what, const RouteAnswer& answer);

// Reads an engine's server info answer (SGLang's /server_info, vLLM's /version) into `profile`:
// its "version" (the release, at most 64 bytes) and wpub's own receivers' "wpub_bucket_versions"
// and "wpub_bucket_patches" (a list of patch formats: 3 sets bucket_patches).
// False when the answer is not a 2xx JSON object (`profile` unchanged).
bool ReadServerInfo(const RouteAnswer& answer, EngineProfile* profile);

// The largest version an engine's claim is believed up to (EngineOptions::max_version).
inline constexpr uint64_t kMaxEngineVersion = uint64_t{1} << 53;

// GETs `path` (SGLang's /get_model_info, vLLM's /weight_info) on every engine concurrently and
// reads the "weight_version" field of each answer: the version the engine serves, as wpub set it
// with update_weight_version. 0 where the engine did not answer in time, answered without the field
// (SGLang before weight versions), with something that is not a decimal version (a checkpoint's
// own name) or with one above kMaxEngineVersion. Answers are bounded like every engine answer.
std::vector<uint64_t> FetchWeightVersions(const std::vector<EngineSpec>& engines,
                                          const std::string& path, absl::Duration timeout);

}  // namespace wpub::rollout
