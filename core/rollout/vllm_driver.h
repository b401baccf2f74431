// The vLLM engine driver: the HTTP side of publishing to unmodified vLLM engines over their native
// weight-transfer API with the NCCL backend (`vllm serve ... --weight-transfer-config
// '{"backend":"nccl"}'` with VLLM_SERVER_DEV_MODE=1; docs/specs/engines.md, "vLLM").
//
// Supported releases: v0.22 and later (the four-phase lifecycle). The join is
// `/init_weight_transfer_engine` {"init_info": {master_address, master_port, rank_offset,
// world_size, packed, packed_buffer_size_bytes, packed_num_buffers}}; a release that takes the
// packing parameters per update instead (v0.22 to v0.27: its init answers HTTP 500, or 400,
// naming init_info) is asked again without them, and its update requests carry them. Per
// publication:
// `/pause?mode=<m>&clear_cache=<c>` (the engine's pause policy), `/start_weight_update` {}, one
// `/update_weights` {"update_info": {names, dtype_names, shapes}} per bucket,
// `/finish_weight_update` {"weight_version"},
// `/resume` (every engine's together, once every engine finished). A bucket is broadcast as vLLM's
// packed chunks (BroadcastChunks): its tensors lie back to back without padding in the bucket (the
// planner's layout), and vLLM closes a chunk after the tensor that takes it past
// packed_buffer_size_bytes. Releases before v0.22 (no
// `/start_weight_update`) and engines without dev mode (no `/init_weight_transfer_engine`) are
// refused with an error naming the engine and the route.
//
// The rendezvous is vLLM's StatelessProcessGroup on the publisher's TCPStore: the pickled
// ncclUniqueId at `broadcast_from/0/0` (VllmUniqueIdPickle), then every rank runs a one-element
// float32 sum all-reduce (EngineFamily::warmup_all_reduce) before its init request returns.
//
// After an abort: every engine is asked to finish the update (an engine that received nothing
// then restores its previous weights); only engines that were sent no bucket are resumed, the
// others stay paused (dirty) until a complete version reaches them. Threading and ordering as
// the SGLang driver (sglang_driver.h).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/rollout/engine_driver.h"

namespace wpub::rollout {

class EngineRequestQueue;  // engine_requests.h
struct EngineRequest;      // engine_requests.h
class ResumeBarrier;       // engine_requests.h

struct VllmDriverOptions {
  std::vector<EngineSpec> engines;
  std::string master_address = "127.0.0.1";  // the publisher's TCPStore
  uint16_t master_port = 0;
  std::string group_name = "wpub_weights";  // names the layout only (vLLM has no group names)
  // vLLM's packed receive: the chunk limit (each engine GPU holds packed_num_buffers of it) and
  // the buffers each side rotates.
  uint64_t packed_buffer_bytes = uint64_t{256} << 20;
  int packed_num_buffers = 2;
  // `/pause?mode=&clear_cache=` (each engine's pause policy, VllmPauseQuery) and `/resume`
  // around every publication; false: neither.
  bool pause_calls = true;
  absl::Duration connect_timeout = absl::Seconds(5);
  absl::Duration request_timeout = absl::Seconds(120);
  // Colocated engines (family "vllm-ipc", served with --weight-transfer-config
  // '{"backend": "ipc"}' and VLLM_ALLOW_INSECURE_SERIALIZATION=1): no rendezvous; init_info is
  // {"packed": true} (a release that takes packing per update refuses it and gets {}, then
  // "packed": true with every update); each bucket's /update_weights carries the bucket's IPC
  // handles (VllmPackedHandlesPickle, base64) and its tensors' byte sizes.
  bool colocated = false;
};

// The family's name for the colocated form.
inline constexpr std::string_view kVllmIpcFamily = "vllm-ipc";

class VllmDriver final : public EngineDriver {
 public:
  static absl::StatusOr<std::unique_ptr<VllmDriver>> Create(const VllmDriverOptions& options);
  ~VllmDriver() override;
  VllmDriver(const VllmDriver&) = delete;
  VllmDriver& operator=(const VllmDriver&) = delete;

  const GroupLayout& layout() const override { return layout_; }
  const std::vector<EngineSpec>& engines() const override { return options_.engines; }

  void StartJoin() override;
  absl::Status WaitIdle(absl::Time deadline) override;
  void BeginPublication(uint64_t version, bool lifecycle_calls) override;
  void PostBucket(const transport::BucketManifest& bucket,
                  const transport::SharedDeviceBytes* shared = nullptr) override;
  std::vector<uint64_t> BroadcastChunks(const transport::BucketManifest& bucket) const override;
  void EndPublication() override;
  std::vector<bool> ResumeAfterAbort(const std::set<std::string>& dirty = {}) override;
  void Leave() override;
  std::vector<EngineOutcome> outcomes() const override;
  bool any_failed() const override;

 private:
  VllmDriver(VllmDriverOptions options, GroupLayout layout);
  // POST `body` to `path` on every engine; `customize` (when given) sets the request's other
  // fields first.
  void PostAll(const std::string& path, const std::string& body,
               void (*customize)(EngineRequest&) = nullptr);
  // Queues the calls that precede a publication's first bucket (pause, start), once per
  // publication, at its first bucket (or its end): the engines keep serving while wpub checks
  // the inputs and packs the first bucket. post_mu_ held.
  void PauseLocked();

  const VllmDriverOptions options_;
  const GroupLayout layout_;
  std::mutex post_mu_;
  uint64_t version_ = 0;         // guarded by post_mu_
  bool closed_ = true;           // guarded by post_mu_
  bool lifecycle_calls_ = true;  // guarded by post_mu_
  bool paused_ = false;          // guarded by post_mu_: this publication's pause was posted
  // The resumes of the publication in progress (released at teardown); guarded by post_mu_.
  std::shared_ptr<ResumeBarrier> resumes_;
  std::vector<std::unique_ptr<EngineRequestQueue>> workers_;
};

// vLLM's packed chunks of a bucket (its tensors in offset order, back to back): byte sizes, in
// order, summing to the bucket's size. A chunk closes after the tensor that takes it past
// `limit`; what remains is the last chunk.
std::vector<uint64_t> VllmPackedChunks(const transport::BucketManifest& bucket, uint64_t limit);

// The pickle (protocol 3) of vLLM's ctypes `ncclUniqueId` holding `id`: what
// StatelessProcessGroup.broadcast_obj stores for the workers to unpickle.
std::string VllmUniqueIdPickle(absl::Span<const uint8_t> id);
// The TCPStore key it is stored under (the first broadcast from rank 0, with torch's "/").
inline constexpr char kVllmUniqueIdKey[] = "/broadcast_from/0/0";

// JSON bodies (exposed for tests). `packing`: the packing fields are sent.
std::string VllmInitBody(const VllmDriverOptions& options, const GroupLayout& layout, size_t engine,
                         bool packing);
std::string VllmUpdateBody(const VllmDriverOptions& options,
                           const transport::BucketManifest& bucket, bool packing);
// A colocated engine's bodies: init {"init_info": {"packed": true}} (`packing`) or
// {"init_info": {}}; update {"update_info": {names, dtype_names, shapes (0-d as [1]),
// ipc_handles_pickled, tensor_sizes[, "packed": true when not `packing` at init]}} with the
// handles' reference-counter slot `slot`.
std::string VllmIpcInitBody(bool packing);
// INVALID_ARGUMENT naming the tensor that does not follow the previous one (vLLM splits the
// bucket by tensor_sizes: its tensors must lie back to back from byte 0).
absl::StatusOr<std::string> VllmIpcUpdateBody(const transport::BucketManifest& bucket,
                                              const transport::SharedDeviceBytes& shared,
                                              uint64_t slot, bool packed_per_update);

struct VllmFamilyOptions {
  VllmDriverOptions driver;
  std::string health_endpoint = "/health";
  std::string weight_info_endpoint = "/weight_info";
};

// The /pause query of a pause policy vLLM serves: "mode=abort&clear_cache=true", ...
// (kRetract: mode keep with clear_cache=true, which preempts the frozen requests).
std::string VllmPauseQuery(const engine::PausePolicy& policy);

class VllmFamily final : public EngineFamily {
 public:
  explicit VllmFamily(VllmFamilyOptions options) : options_(std::move(options)) {}
  std::string_view name() const override {
    return options_.driver.colocated ? kVllmIpcFamily : std::string_view("vllm");
  }
  std::vector<bool> Probe(const std::vector<EngineSpec>& engines,
                          absl::Duration timeout) const override;
  std::vector<uint64_t> WeightVersions(const std::vector<EngineSpec>& engines,
                                       absl::Duration timeout) const override;
  // GETs of the weight-transfer routes (each POST-only: 405 when served, 404 when not) and of
  // /version (the release). An engine without /init_weight_transfer_engine (no dev mode, or a
  // release before v0.16) or without /start_weight_update (a release before the four-phase
  // update) is refused at join, naming the route and what it means.
  std::vector<absl::StatusOr<EngineProfile>> Profile(const std::vector<EngineSpec>& engines,
                                                     absl::Duration timeout) const override;
  absl::StatusOr<std::unique_ptr<EngineDriver>> CreateDriver(
      const GroupAddress& address) const override;
  std::optional<std::vector<StoreEntry>> UniqueIdEntries(
      absl::Span<const uint8_t> id) const override;
  bool warmup_all_reduce() const override { return !options_.driver.colocated; }
  absl::Duration request_timeout() const override { return options_.driver.request_timeout; }
  // abort:flush|keep, wait:flush|keep, retract:flush, keep:keep (vLLM clears its cache in mode
  // keep by preempting the frozen requests: keep:flush is retract, and a retract without the
  // clear does not exist).
  absl::StatusOr<engine::PausePolicy> ResolvePause(
      const engine::PausePolicy& policy) const override;
  absl::Duration connect_timeout() const override { return options_.driver.connect_timeout; }

 private:
  const VllmFamilyOptions options_;
};

}  // namespace wpub::rollout
