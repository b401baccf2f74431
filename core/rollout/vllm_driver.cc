// vLLM driver (vllm_driver.h): the weight-transfer routes over the shared engine request queues.
#include "core/rollout/vllm_driver.h"

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/json_bounds.h"
#include "core/rollout/engine_requests.h"
#include "core/rollout/torch_ipc.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

constexpr char kInit[] = "/init_weight_transfer_engine";
constexpr char kStart[] = "/start_weight_update";
constexpr char kUpdate[] = "/update_weights";
constexpr char kFinish[] = "/finish_weight_update";
constexpr char kResume[] = "/resume";
constexpr char kServerInfo[] = "/server_info?config_format=json";
// Bounds the probe of kServerInfo, whose first answer may wait for the engine's environment.
constexpr absl::Duration kServerInfoTimeout = absl::Seconds(20);

// What a 404 on the routes wpub needs means (the join's probe and the driver say the same).
constexpr char kNoTransferRoutes[] =
    "the engine serves no weight-transfer routes: start vLLM (v0.22 or later) with "
    "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\":\"nccl\"}'";
constexpr char kBeforeFourPhases[] =
    "a release before v0.22 (no four-phase weight update); wpub needs v0.22 or later";

// What vLLM's server info says of the engine's weight transfer (below).
constexpr char kNotConfigured[] = "(none)";

// The weight-transfer backend an engine was started with, as vLLM's dev-mode
// GET /server_info?config_format=json answers it: {"vllm_config": {..., "weight_transfer_config":
// {"backend": B} or null}, "vllm_env", "system_env"} (serve/dev/server_info/api_router.py and
// config/vllm.py at vllm-project/vllm c67fe497a25d5af10a6ca0be9d18bcdd42cac4f1). null means the
// engine was started without --weight-transfer-config: its workers build no transfer engine and
// every weight route fails "Weight transfer not configured" (v1/worker/gpu_worker.py, same
// commit) -- kNotConfigured. "" when the answer does not say: an older release, no answer in
// time, not a JSON object.
std::string WeightTransferBackend(const RouteAnswer& answer) {
  if (answer.status < 200 || answer.status >= 300) return "";
  json j = json::parse(answer.body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return "";
  auto config = j.find("vllm_config");
  if (config == j.end() || !config->is_object()) return "";
  auto transfer = config->find("weight_transfer_config");
  if (transfer == config->end()) return "";
  if (transfer->is_null()) return kNotConfigured;
  if (!transfer->is_object()) return "";
  auto backend = transfer->find("backend");
  if (backend == transfer->end() || !backend->is_string()) return "";
  return backend->get<std::string>().substr(0, 64);
}

// The join's refusal of an engine whose weight-transfer backend is not the one its kind speaks.
// vLLM's sparse backend cannot carry NVFP4 tensors: its checkpoint patches must be floating point
// (NaN marks an element a patch leaves unchanged: model_executor/model_loader/
// checkpoint_weight_patch.py), and in v0.25 it scattered into the runtime parameters at TP=1
// (distributed/weight_transfer/sparse_nccl_engine.py at 58d3918e3ea0a544ffedadad2ba84559e9c51d8f),
// whose NVFP4 layout is not the checkpoint's -- wpub sends vLLM engines whole versions.
std::optional<absl::Status> BackendRefusal(const std::string& url, const std::string& backend,
                                           bool colocated) {
  const std::string want = colocated ? "ipc" : "nccl";
  if (backend.empty() || backend == want) return std::nullopt;
  const std::string fix =
      absl::StrCat("start it with --weight-transfer-config '{\"backend\":\"", want, "\"}'");
  if (backend == kNotConfigured) {
    return absl::FailedPreconditionError(absl::StrCat(
        "engine ", url,
        " was started without --weight-transfer-config (GET /server_info: weight_transfer_config "
        "null), so its weight routes answer \"Weight transfer not configured\"; ",
        fix));
  }
  std::string why;
  if (backend == "sparse_nccl") {
    why =
        "its patches carry floating-point elements only, so the NVFP4 codes (uint8) of a "
        "publication cannot reach it; wpub sends vLLM engines whole versions";
  } else {
    why = absl::StrCat(
        "the engine kind `", std::string(colocated ? kVllmIpcFamily : std::string_view("vllm")),
        "` speaks \"", want, "\"",
        backend == "ipc" && !colocated   ? " (declare a colocated engine as vllm-ipc+http://...)"
        : backend == "nccl" && colocated ? " (declare an NCCL engine as vllm+http://...)"
                                         : "");
  }
  return absl::FailedPreconditionError(absl::StrCat("engine ", url,
                                                    " was started with the weight-transfer "
                                                    "backend \"",
                                                    backend, "\" (GET /server_info): ", why, "; ",
                                                    fix));
}

// vLLM answers 2xx {"message": ...} on success and a non-2xx status with {"error": ...}
// otherwise (the queue reports those); a 2xx answer with an "error" object is a failure too.
std::string VllmAnswer(const std::string& what, const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error")) {
    return absl::StrCat(what, ": error: ", j["error"].dump().substr(0, 300));
  }
  return "";
}

}  // namespace

std::vector<uint64_t> VllmPackedChunks(const transport::BucketManifest& bucket, uint64_t limit) {
  std::vector<uint64_t> chunks;
  uint64_t total = 0;
  for (const transport::ManifestTensor& t : bucket.tensors) {
    total += t.nbytes;
    if (total > limit) {
      chunks.push_back(total);
      total = 0;
    }
  }
  if (total > 0 || chunks.empty()) chunks.push_back(total);
  return chunks;
}

std::string VllmUniqueIdPickle(absl::Span<const uint8_t> id) {
  // _ctypes._unpickle(ncclUniqueId, ({}, <128 bytes>)): how pickle rebuilds a ctypes Structure.
  std::string p = "\x80\x03";
  p += "c_ctypes\n_unpickle\n";
  p += "cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n";
  p += "}";
  p += "C";  // SHORT_BINBYTES
  p += static_cast<char>(id.size());
  p.append(reinterpret_cast<const char*>(id.data()), id.size());
  p += "\x86\x86R.";
  return p;
}

std::string VllmInitBody(const VllmDriverOptions& o, const GroupLayout& g, size_t engine,
                         bool packing) {
  json info = {{"master_address", o.master_address},
               {"master_port", o.master_port},
               {"rank_offset", g.rank_offsets.at(engine)},
               {"world_size", g.world_size}};
  if (packing) {
    info["packed"] = true;
    info["packed_buffer_size_bytes"] = o.packed_buffer_bytes;
    info["packed_num_buffers"] = o.packed_num_buffers;
  }
  return json{{"init_info", info}}.dump();
}

std::string VllmUpdateBody(const VllmDriverOptions& o, const transport::BucketManifest& bucket,
                           bool packing) {
  json names = json::array(), dtypes = json::array(), shapes = json::array();
  for (const transport::ManifestTensor& t : bucket.tensors) {
    names.push_back(t.name);
    dtypes.push_back(std::string(DTypeName(t.dtype)));
    json shape = json::array();
    for (int64_t d : t.shape) shape.push_back(d);
    // vLLM's packed unpack cannot view a 0-d tensor; its per-tensor scale loaders take [1].
    if (shape.empty()) shape.push_back(1);
    shapes.push_back(std::move(shape));
  }
  json info = {{"names", names}, {"dtype_names", dtypes}, {"shapes", shapes}};
  if (packing) {
    info["packed"] = true;
    info["packed_buffer_size_bytes"] = o.packed_buffer_bytes;
    info["packed_num_buffers"] = o.packed_num_buffers;
  }
  return json{{"update_info", info}}.dump();
}

std::string VllmIpcInitBody(bool packing) {
  json info = json::object();
  if (packing) info["packed"] = true;
  return json{{"init_info", info}}.dump();
}

absl::StatusOr<std::string> VllmIpcUpdateBody(const transport::BucketManifest& bucket,
                                              const transport::SharedDeviceBytes& shared,
                                              uint64_t slot, bool packed_per_update) {
  json names = json::array(), dtypes = json::array(), shapes = json::array(), sizes = json::array();
  uint64_t next = 0;
  for (const transport::ManifestTensor& t : bucket.tensors) {
    if (t.offset != next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket ", bucket.index, " tensor ", t.name, " starts at byte ", t.offset, ", not ", next,
          ": vLLM's packed IPC consumer needs the tensors back to back"));
    }
    next = t.offset + t.nbytes;
    names.push_back(t.name);
    dtypes.push_back(std::string(DTypeName(t.dtype)));
    json shape = json::array();
    for (int64_t d : t.shape) shape.push_back(d);
    if (shape.empty()) shape.push_back(1);  // vLLM's packed unpack cannot view a 0-d tensor
    shapes.push_back(std::move(shape));
    sizes.push_back(t.nbytes);
  }
  json info = {{"names", names},
               {"dtype_names", dtypes},
               {"shapes", shapes},
               {"ipc_handles_pickled", absl::Base64Escape(VllmPackedHandlesPickle(shared, slot))},
               {"tensor_sizes", sizes}};
  if (packed_per_update) info["packed"] = true;
  return json{{"update_info", info}}.dump();
}

absl::StatusOr<std::unique_ptr<VllmDriver>> VllmDriver::Create(const VllmDriverOptions& options) {
  absl::StatusOr<GroupLayout> layout = LayoutGroup(options.engines, options.group_name);
  if (!layout.ok()) return layout.status();
  for (const EngineSpec& e : options.engines) {
    if (!absl::StartsWith(e.url, "http://") && !absl::StartsWith(e.url, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine URL '", e.url, "' must start with http:// or https://"));
    }
  }
  if (options.master_port == 0 && !options.colocated) {
    return absl::InvalidArgumentError("vLLM driver: master_port (the TCPStore port) is 0");
  }
  if (options.packed_buffer_bytes == 0 || options.packed_num_buffers < 1) {
    return absl::InvalidArgumentError(
        "vLLM driver: packed_buffer_bytes and packed_num_buffers must be positive");
  }
  std::unique_ptr<VllmDriver> d(new VllmDriver(options, *std::move(layout)));
  for (const EngineSpec& e : options.engines) {
    d->workers_.push_back(std::make_unique<EngineRequestQueue>(e.url, options.connect_timeout,
                                                               options.request_timeout, /*lanes=*/1,
                                                               VllmAnswer, e.auth_token));
  }
  return d;
}

VllmDriver::VllmDriver(VllmDriverOptions options, GroupLayout layout)
    : options_(std::move(options)), layout_(std::move(layout)) {}
VllmDriver::~VllmDriver() {
  std::lock_guard lock(post_mu_);
  if (resumes_) resumes_->Release();  // no queue thread waits out a deadline at teardown
}

void VllmDriver::PostAll(const std::string& path, const std::string& body,
                         void (*customize)(EngineRequest&)) {
  auto shared = std::make_shared<const std::string>(body);
  for (auto& w : workers_) {
    EngineRequest r{"POST", path, shared};
    if (customize != nullptr) customize(r);
    w->Post(std::move(r));
  }
}

void VllmDriver::StartJoin() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->Reset();
    const auto body = [&](bool packing) {
      return std::make_shared<const std::string>(options_.colocated
                                                     ? VllmIpcInitBody(packing)
                                                     : VllmInitBody(options_, layout_, i, packing));
    };
    EngineRequest r{"POST", kInit, body(/*packing=*/true)};
    // Releases that take the packing parameters per update refuse them here
    // (WeightTransferEngine.parse_init_info's ValueError "Invalid init_info for ...", answered
    // 400 or, from the worker, 500): ask again without, and send them with every update.
    r.fallback_body = body(/*packing=*/false);
    r.fallback_when = "Invalid init_info";
    r.on_404 = kNoTransferRoutes;
    workers_[i]->Post(std::move(r));
  }
}

absl::Status VllmDriver::WaitIdle(absl::Time deadline) { return WaitAllIdle(workers_, deadline); }

void VllmDriver::BeginPublication(uint64_t version, bool lifecycle_calls) {
  std::lock_guard lock(post_mu_);
  version_ = version;
  closed_ = false;
  lifecycle_calls_ = lifecycle_calls;
  paused_ = false;
  for (auto& w : workers_) w->Reset();
}

void VllmDriver::PauseLocked() {
  if (paused_ || !lifecycle_calls_) return;
  paused_ = true;
  if (options_.pause_calls) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      EngineRequest r{"POST", absl::StrCat("/pause?", VllmPauseQuery(options_.engines[i].pause)),
                      std::make_shared<const std::string>("")};
      r.pauses = true;
      workers_[i]->Post(std::move(r));
    }
  }
  // the first four-phase releases parse a JSON body here; later ones read none.
  PostAll(kStart, "{}", [](EngineRequest& r) {
    r.opens = true;  // an abort then finishes the update (ResumeAfterAbort)
    r.on_404 = kBeforeFourPhases;
  });
}

void VllmDriver::PostBucket(const transport::BucketManifest& bucket,
                            const transport::SharedDeviceBytes* shared) {
  std::lock_guard lock(post_mu_);
  if (closed_) return;
  PauseLocked();
  std::shared_ptr<const std::string> plain, packing;
  for (size_t i = 0; i < workers_.size(); ++i) {
    auto& w = workers_[i];
    const bool per_update = w->fell_back();
    if (options_.colocated) {
      if (shared == nullptr) {
        // Nothing of this bucket reaches the engine: it fails the publication.
        w->Fail(absl::StrCat("engine ", options_.engines[i].url, " bucket ", bucket.index,
                             ": the bucket was not shared in GPU memory (colocated engines need "
                             "the GPU path)"));
        continue;
      }
      // Every rank of every engine takes its own GPU's entry; the channel releases the bucket
      // on the answers (vLLM has copied when it answers), so one slot serves them all.
      absl::StatusOr<std::string> body =
          VllmIpcUpdateBody(bucket, *shared, shared->ref_counter_offset, per_update);
      if (!body.ok()) {
        w->Fail(absl::StrCat("engine ", options_.engines[i].url, ": ", body.status().message()));
        continue;
      }
      EngineRequest r{"POST", kUpdate, std::make_shared<const std::string>(*std::move(body)),
                      /*overlappable=*/false, /*update=*/true};
      w->Post(std::move(r));
      continue;
    }
    std::shared_ptr<const std::string>& body = per_update ? packing : plain;
    if (!body) {
      body = std::make_shared<const std::string>(VllmUpdateBody(options_, bucket, per_update));
    }
    EngineRequest r{"POST", kUpdate, body, /*overlappable=*/false, /*update=*/true};
    w->Post(std::move(r));
  }
}

std::vector<uint64_t> VllmDriver::BroadcastChunks(const transport::BucketManifest& bucket) const {
  return VllmPackedChunks(bucket, options_.packed_buffer_bytes);
}

void VllmDriver::EndPublication() {
  std::lock_guard lock(post_mu_);
  if (closed_) return;
  closed_ = true;
  if (!lifecycle_calls_) return;
  PauseLocked();  // a publication without buckets still pauses, starts and finishes
  PostAll(kFinish, json{{"weight_version", std::to_string(version_)}}.dump());
  if (options_.pause_calls) {
    std::vector<size_t> all(workers_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    if (resumes_) resumes_->Release();
    resumes_ = PostResumesTogether(workers_, all, "POST", kResume, "");
  }
}

std::string VllmPauseQuery(const engine::PausePolicy& policy) {
  using InFlight = engine::PausePolicy::InFlight;
  const bool clear = policy.cache_action() == engine::PausePolicy::Cache::kFlush;
  const char* mode = policy.in_flight == InFlight::kAbort  ? "abort"
                     : policy.in_flight == InFlight::kWait ? "wait"
                                                           : "keep";
  return absl::StrCat("mode=", mode, "&clear_cache=", clear ? "true" : "false");
}

absl::StatusOr<engine::PausePolicy> VllmFamily::ResolvePause(
    const engine::PausePolicy& policy) const {
  using InFlight = engine::PausePolicy::InFlight;
  using Cache = engine::PausePolicy::Cache;
  engine::PausePolicy p = policy;
  p.cache = policy.cache_action();
  if (policy.in_flight == InFlight::kRetract && p.cache == Cache::kKeep) {
    return absl::InvalidArgumentError(
        "vLLM frees a paused request's KV only by clearing its whole cache (/pause mode keep with "
        "clear_cache=true): retract needs ':flush'");
  }
  if (policy.in_flight == InFlight::kKeep && p.cache == Cache::kFlush) {
    return absl::InvalidArgumentError(
        "vLLM clears its cache in /pause mode keep by preempting the frozen requests, which are "
        "then recomputed on the new weights: that is 'retract:flush'; 'keep' keeps the cache");
  }
  return p;
}

std::vector<bool> VllmDriver::ResumeAfterAbort(const std::set<std::string>& still_dirty) {
  std::lock_guard lock(post_mu_);
  std::vector<bool> dirty(workers_.size(), false);
  for (size_t i = 0; i < workers_.size(); ++i) dirty[i] = still_dirty.count(workers_[i]->url()) > 0;
  if (closed_) return dirty;
  closed_ = true;
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->DropQueued();
    dirty[i] = dirty[i] || workers_[i]->outcome().updates_sent > 0;
    if (!lifecycle_calls_) continue;
    // Ends the weight update on every engine that was asked to start one (one that received
    // nothing restores its previous weights; one never asked has none to end and would refuse
    // the finish); only the clean ones serve again.
    if (workers_[i]->opened()) {
      EngineRequest f{"POST", kFinish, std::make_shared<const std::string>("{}")};
      f.always = true;
      workers_[i]->Post(std::move(f));
    }
    if (!dirty[i] && paused_ && options_.pause_calls) {
      EngineRequest r{"POST", kResume, std::make_shared<const std::string>("")};
      r.always = true;
      r.resumes = true;
      workers_[i]->Post(std::move(r));
    }
  }
  return dirty;
}

void VllmDriver::Leave() {
  // vLLM has no route to leave a weight-transfer group: a new init replaces it.
  std::lock_guard lock(post_mu_);
  closed_ = true;
  for (auto& w : workers_) {
    w->DropQueued();
    w->Reset();
  }
}

std::vector<EngineOutcome> VllmDriver::outcomes() const { return OutcomesOf(workers_); }

bool VllmDriver::any_failed() const { return AnyFailed(workers_); }

std::vector<bool> VllmFamily::Probe(const std::vector<EngineSpec>& engines,
                                    absl::Duration timeout) const {
  if (options_.health_endpoint.empty()) return std::vector<bool>(engines.size(), true);
  return ProbeEngines(engines, options_.health_endpoint, timeout);
}

std::vector<uint64_t> VllmFamily::WeightVersions(const std::vector<EngineSpec>& engines,
                                                 absl::Duration timeout) const {
  if (options_.weight_info_endpoint.empty()) return std::vector<uint64_t>(engines.size(), 0);
  return FetchWeightVersions(engines, options_.weight_info_endpoint, timeout);
}

std::vector<absl::StatusOr<EngineProfile>> VllmFamily::Profile(
    const std::vector<EngineSpec>& engines, absl::Duration timeout) const {
  // What a 404 on each route means (vLLM's dev-mode router registers all four together from
  // v0.22; before, /init_weight_transfer_engine and /update_weights only).
  const std::vector<std::pair<std::string, std::string>> routes = {
      {kInit, kNoTransferRoutes},
      {kStart, kBeforeFourPhases},
      {kUpdate, kNoTransferRoutes},
      {kFinish, kBeforeFourPhases},
  };
  std::vector<std::string> paths;
  for (const auto& [path, why] : routes) paths.push_back(path);
  paths.push_back("/version");
  const size_t version_at = routes.size();
  return ProfileEngines(
      engines, paths, timeout,
      [&](const EngineSpec& engine,
          const std::vector<RouteAnswer>& answers) -> absl::StatusOr<EngineProfile> {
        EngineProfile p;
        for (size_t k = 0; k < routes.size(); ++k) {
          const std::string what = absl::StrCat("engine ", engine.url, " GET ", paths[k]);
          if (std::optional<absl::Status> refused = ProbeRefusal(what, answers[k])) {
            return *refused;
          }
          if (answers[k].status == 404) {
            return absl::FailedPreconditionError(absl::StrCat(
                "engine ", engine.url, " has no ", paths[k], " (HTTP 404): ", routes[k].second));
          }
        }
        // The backend, in a probe of its own: vLLM's first /server_info collects the host's
        // environment (pip, nvidia-smi) before it answers, which can take seconds.
        const std::vector<RouteAnswer> info =
            ProbeRoutes(engine, {kServerInfo}, kServerInfoTimeout);
        const std::string backend = WeightTransferBackend(info[0]);
        if (backend.empty() && info[0].status != 404) {
          spdlog::warn("engine {}: its weight-transfer backend is unknown (GET {}: {}); taken",
                       engine.url, kServerInfo,
                       info[0].status == 0 ? info[0].error : absl::StrCat("HTTP ", info[0].status));
        }
        if (std::optional<absl::Status> refused =
                BackendRefusal(engine.url, backend, options_.driver.colocated)) {
          return *refused;
        }
        (void)ReadServerInfo(answers[version_at], &p);
        return p;
      });
}

absl::StatusOr<std::unique_ptr<EngineDriver>> VllmFamily::CreateDriver(
    const GroupAddress& address) const {
  VllmDriverOptions d = options_.driver;
  d.engines = address.engines;
  d.master_address = address.master_address;
  d.master_port = address.master_port;
  d.group_name = address.group_name;
  absl::StatusOr<std::unique_ptr<VllmDriver>> driver = VllmDriver::Create(d);
  if (!driver.ok()) return driver.status();
  return std::unique_ptr<EngineDriver>(*std::move(driver));
}

std::optional<std::vector<EngineFamily::StoreEntry>> VllmFamily::UniqueIdEntries(
    absl::Span<const uint8_t> id) const {
  return std::vector<StoreEntry>{{kVllmUniqueIdKey, VllmUniqueIdPickle(id)}};
}

}  // namespace wpub::rollout
