// SGLang driver: per-engine ordered request workers over cpp-httplib, JSON bodies.
#include "core/rollout/sglang_driver.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/common/json_bounds.h"
#include "core/common/status.h"
#include "core/rollout/engine_requests.h"
#include "core/rollout/torch_ipc.h"
#include "core/rollout/update_request.h"
#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

// SGLang answers {"success": bool, "message": str} on the weight-update routes.
std::string SglangAnswer(const std::string& what, const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("success") && j["success"].is_boolean() &&
      !j["success"].get<bool>()) {
    // json::value throws on a type mismatch: an engine's "message" may be anything.
    const auto message = j.find("message");
    const std::string text = message != j.end() && message->is_string()
                                 ? message->get<std::string>().substr(0, 300)
                                 : std::string("(no message)");
    return absl::StrCat(what, ": success=false: ", text);
  }
  return "";
}

}  // namespace

std::string InitGroupBody(const SglangDriverOptions& o, const GroupLayout& g, size_t engine) {
  json j = {{"master_address", o.master_address},
            {"master_port", o.master_port},
            {"rank_offset", g.rank_offsets.at(engine)},
            {"world_size", g.world_size},
            {"group_name", g.group_name},
            {"backend", o.endpoints.backend}};
  return j.dump();
}

std::string UpdateBody(const SglangDriverOptions& o, const transport::BucketManifest& bucket,
                       const std::string& load_format, const std::string& version, bool sequenced,
                       const UpdatePatch* patch = nullptr) {
  UpdateRequestFields f;
  if (patch != nullptr) f.patch = *patch;
  f.group_name = o.group_name;
  f.flush_cache = o.flush_cache_on_update;
  f.weight_version = version;
  f.load_format = load_format;
  // Several requests in flight: the engine must receive them in this order (see the option);
  // an engine that takes patches keeps its buckets by this index (`sequenced`).
  if (o.requests_in_flight > 1 || sequenced) f.sequence = bucket.index;
  return EncodeUpdateRequest(bucket.tensors, f);
}

absl::StatusOr<std::string> TensorUpdateBody(const transport::BucketManifest& bucket,
                                             const transport::SharedDeviceBytes& shared,
                                             int tp_ranks, uint64_t first_slot) {
  WPUB_ASSIGN_OR_RETURN(const std::vector<std::string> pickles,
                        SglangFlattenedBucketPickles(
                            bucket, shared, shared.ref_counter_offset + first_slot, tp_ranks));
  // Written directly: base64's alphabet needs no JSON escaping, and a document tree would copy
  // and scan every entry (~1 MB a bucket at TP=2) once more.
  std::string body = R"({"serialized_named_tensors":[)";
  for (size_t r = 0; r < pickles.size(); ++r) {
    if (r > 0) body += ',';
    body += '"';
    body += absl::Base64Escape(pickles[r]);
    body += '"';
  }
  body += R"(],"load_format":"flattened_bucket","flush_cache":false})";
  return body;
}

absl::StatusOr<std::unique_ptr<SglangDriver>> SglangDriver::Create(
    const SglangDriverOptions& options) {
  absl::StatusOr<GroupLayout> layout = LayoutGroup(options.engines, options.group_name);
  if (!layout.ok()) return layout.status();
  for (const EngineSpec& e : options.engines) {
    if (!absl::StartsWith(e.url, "http://") && !absl::StartsWith(e.url, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine URL '", e.url, "' must start with http:// or https://"));
    }
  }
  if (options.colocated) {
    if (options.endpoints.tensor_update.empty()) {
      return absl::InvalidArgumentError(
          "SGLang driver: colocated engines need the tensor_update endpoint");
    }
  } else {
    if (options.master_port == 0) {
      return absl::InvalidArgumentError("SGLang driver: master_port (the TCPStore port) is 0");
    }
    if (options.endpoints.update.empty() || options.endpoints.init_group.empty()) {
      return absl::InvalidArgumentError(
          "SGLang driver: the init_group and update endpoints may not be empty");
    }
  }
  if (!options.profiles.empty() && options.profiles.size() != options.engines.size()) {
    return absl::InvalidArgumentError(absl::StrCat("SGLang driver: ", options.profiles.size(),
                                                   " profiles for ", options.engines.size(),
                                                   " engines"));
  }
  std::unique_ptr<SglangDriver> d(new SglangDriver(options, *std::move(layout)));
  d->load_format_ = options.endpoints.load_format;
  for (const EngineProfile& p : options.profiles) {
    if (p.Lacks(kFlattenedBucket)) d->load_format_.clear();
  }
  for (const EngineSpec& e : options.engines) {
    d->workers_.push_back(std::make_unique<EngineRequestQueue>(
        e.url, options.connect_timeout, options.request_timeout, options.requests_in_flight,
        SglangAnswer, e.auth_token));
  }
  return d;
}

SglangDriver::SglangDriver(SglangDriverOptions options, GroupLayout layout)
    : options_(std::move(options)), layout_(std::move(layout)) {}
SglangDriver::~SglangDriver() {
  std::lock_guard lock(post_mu_);
  if (resumes_) resumes_->Release();  // no queue thread waits out a deadline at teardown
}

void SglangDriver::PostEach(const std::string& method, const std::string& path,
                            const std::function<std::optional<std::string>(size_t)>& body_of,
                            void (*customize)(EngineRequest&)) {
  if (path.empty()) return;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (Lacks(i, path)) continue;
    std::optional<std::string> body = body_of(i);
    if (!body) continue;
    EngineRequest r{method, path, std::make_shared<const std::string>(*std::move(body)),
                    /*overlappable=*/false, /*update=*/false};
    if (customize != nullptr) customize(r);
    workers_[i]->Post(std::move(r));
  }
}

void SglangDriver::PostAll(const std::string& method, const std::string& path,
                           const std::string& body, void (*customize)(EngineRequest&)) {
  if (path.empty()) return;
  auto shared = std::make_shared<const std::string>(body);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (Lacks(i, path)) continue;
    EngineRequest r{method, path, shared, /*overlappable=*/false, /*update=*/false};
    if (customize != nullptr) customize(r);
    workers_[i]->Post(std::move(r));
  }
}

void SglangDriver::PostClosing(size_t engine, const std::string& path) {
  if (path.empty() || Lacks(engine, path)) return;
  EngineRequest r{"POST",
                  path,
                  std::make_shared<const std::string>("{}"),
                  /*overlappable=*/false,
                  /*update=*/false,
                  /*always=*/true};
  r.resumes = path == options_.endpoints.resume;
  workers_[engine]->Post(std::move(r));
}

bool SglangDriver::Lacks(size_t engine, const std::string& path) const {
  return engine < options_.profiles.size() && options_.profiles[engine].Lacks(path);
}

void SglangDriver::StartJoin() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->Reset();
    if (options_.colocated) continue;  // no weight-update group: nothing to join
    workers_[i]->Post(
        EngineRequest{"POST", options_.endpoints.init_group,
                      std::make_shared<const std::string>(InitGroupBody(options_, layout_, i)),
                      /*overlappable=*/false});
  }
}

absl::Status SglangDriver::WaitIdle(absl::Time deadline) { return WaitAllIdle(workers_, deadline); }

void SglangDriver::BeginPublication(uint64_t version, bool lifecycle_calls) {
  std::lock_guard lock(post_mu_);
  version_ = version;
  closed_ = false;
  lifecycle_calls_ = lifecycle_calls;
  paused_ = false;
  for (auto& w : workers_) w->Reset();
}

void SglangDriver::PauseLocked() {
  if (paused_ || !lifecycle_calls_) return;
  paused_ = true;
  const SglangEndpoints& e = options_.endpoints;
  PostEach(
      "POST", e.pause,
      [&](size_t i) -> std::optional<std::string> {
        return json({{"mode", SglangPauseMode(options_.engines[i].pause.in_flight)}}).dump();
      },
      [](EngineRequest& r) { r.pauses = true; });
  // Opens SGLang's weight-update session: every path from here closes it (EndPublication, or
  // ResumeAfterAbort's end), since the next begin on an engine whose session is still open
  // fails its scheduler's assertion and takes the server down.
  PostAll("POST", e.begin, "{}", [](EngineRequest& r) { r.opens = true; });
}

bool SglangDriver::TakesPatches() const {
  if (options_.colocated || options_.endpoints.update.empty() || load_format_.empty() ||
      options_.profiles.size() != options_.engines.size() || options_.engines.empty()) {
    return false;
  }
  for (const EngineProfile& p : options_.profiles) {
    if (!p.bucket_patches) return false;
  }
  return true;
}

void SglangDriver::PostPatchedBucket(const transport::BucketManifest& bucket,
                                     const UpdatePatch& patch) {
  PostUpdate(bucket, &patch);
}

void SglangDriver::PostBucket(const transport::BucketManifest& bucket,
                              const transport::SharedDeviceBytes* shared) {
  if (options_.colocated) {
    PostSharedBucket(bucket, shared);
    return;
  }
  PostUpdate(bucket, nullptr);
}

void SglangDriver::PostUpdate(const transport::BucketManifest& bucket, const UpdatePatch* patch) {
  const std::string& path = options_.endpoints.update;
  if (path.empty()) return;
  std::lock_guard lock(post_mu_);
  if (closed_) return;  // aborted: no engine may receive more of this version
  PauseLocked();
  // Encoded here, once for every engine of each form (with or without weight_version, with or
  // without wpub_sequence for an engine that keeps its buckets by it): a 3,300-tensor body takes
  // ~0.3 ms (bench/rollout/update_request_bench), less than copying the manifest for another
  // thread.
  std::shared_ptr<const std::string> bodies[2][2];
  for (size_t i = 0; i < workers_.size(); ++i) {
    const bool with_version = i < options_.profiles.size() && options_.profiles[i].bucket_versions;
    const bool sequenced = i < options_.profiles.size() && options_.profiles[i].bucket_patches;
    std::shared_ptr<const std::string>& body = bodies[with_version][sequenced];
    if (!body) {
      body = std::make_shared<const std::string>(
          UpdateBody(options_, bucket, load_format_, with_version ? std::to_string(version_) : "",
                     sequenced, patch));
    }
    workers_[i]->Post(EngineRequest{"POST", path, body, /*overlappable=*/true, /*update=*/true});
  }
}

void SglangDriver::PostSharedBucket(const transport::BucketManifest& bucket,
                                    const transport::SharedDeviceBytes* shared) {
  std::lock_guard lock(post_mu_);
  if (closed_) return;  // aborted: no engine may receive more of this version
  PauseLocked();
  for (size_t i = 0; i < workers_.size(); ++i) {
    absl::StatusOr<std::string> body =
        shared == nullptr
            ? absl::FailedPreconditionError(
                  "the bucket was not shared in GPU memory (colocated engines need the GPU path)")
            : TensorUpdateBody(bucket, *shared, options_.engines[i].gpus,
                               static_cast<uint64_t>(layout_.rank_offsets[i] - 1));
    if (!body.ok()) {
      // Nothing of this bucket reaches the engine: it fails the publication, never commits it.
      workers_[i]->Fail(absl::StrCat("engine ", options_.engines[i].url, " bucket ", bucket.index,
                                     ": ", body.status().message()));
      continue;
    }
    workers_[i]->Post(EngineRequest{"POST", options_.endpoints.tensor_update,
                                    std::make_shared<const std::string>(*std::move(body)),
                                    /*overlappable=*/true, /*update=*/true});
  }
}

std::vector<uint64_t> SglangDriver::BroadcastChunks(const transport::BucketManifest& bucket) const {
  if (!load_format_.empty()) return {bucket.nbytes};
  // Per tensor, in request order: the planner lays a bucket's tensors back to back in that
  // order (engines.md), so these sizes cut the bucket's bytes into the tensors.
  std::vector<uint64_t> chunks;
  for (const transport::ManifestTensor& t : bucket.tensors) chunks.push_back(t.nbytes);
  return chunks;
}

void SglangDriver::EndPublication() {
  std::lock_guard lock(post_mu_);
  if (closed_) return;
  closed_ = true;
  if (!lifecycle_calls_) return;
  PauseLocked();  // a publication without buckets still pauses, opens and ends its session
  const SglangEndpoints& e = options_.endpoints;
  // The session ends first (it finalizes the quantized layers); the version is announced only
  // then, so an engine reports a version once it holds all of it (update requests carry none:
  // SGLang adopts a bucket's version as soon as that bucket loads). SGLang's
  // UpdateWeightVersionReqInput defaults abort_all_requests to true (io_struct.py): left out,
  // every publication would abort every in-flight rollout request, the ones the pause kept.
  PostAll("POST", e.end, "{}");
  PostAll("POST", e.version,
          json({{"new_version", std::to_string(version_)}, {"abort_all_requests", false}}).dump());
  // The cache computed with the old weights goes once the new ones are in, before any request
  // runs again: with an abort pause nothing runs or waits in the scheduler by now (SGLang holds
  // new requests in its tokenizer manager while paused), so the flush finds it idle. Best
  // effort: a refusal is the engine's warning, the version stays applied.
  PostEach(
      "GET", e.flush,
      [&](size_t i) -> std::optional<std::string> {
        if (options_.engines[i].pause.cache_action() != engine::PausePolicy::Cache::kFlush) {
          return std::nullopt;
        }
        return std::string();
      },
      [](EngineRequest& r) { r.best_effort = true; });
  if (!e.resume.empty()) {
    std::vector<size_t> resumed;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!Lacks(i, e.resume)) resumed.push_back(i);
    }
    if (resumes_) resumes_->Release();
    resumes_ = PostResumesTogether(workers_, resumed, "POST", e.resume, "{}");
  }
}

std::string SglangPauseMode(engine::PausePolicy::InFlight in_flight) {
  switch (in_flight) {
    case engine::PausePolicy::InFlight::kAbort:
      return "abort";
    case engine::PausePolicy::InFlight::kRetract:
      return "retract";
    case engine::PausePolicy::InFlight::kKeep:
      return "in_place";
    case engine::PausePolicy::InFlight::kWait:
      return "";
  }
  return "";
}

absl::StatusOr<engine::PausePolicy> SglangFamily::ResolvePause(
    const engine::PausePolicy& policy) const {
  using InFlight = engine::PausePolicy::InFlight;
  using Cache = engine::PausePolicy::Cache;
  engine::PausePolicy p = policy;
  switch (policy.in_flight) {
    case InFlight::kWait:
      return absl::InvalidArgumentError(
          "SGLang's /pause_generation has no mode that lets in-flight requests finish (its modes "
          "are abort, retract and in_place): use abort, retract or keep");
    case InFlight::kAbort:
      if (p.cache == Cache::kDefault) p.cache = Cache::kFlush;
      return p;
    case InFlight::kRetract:
    case InFlight::kKeep:
      if (p.cache == Cache::kFlush) {
        return absl::InvalidArgumentError(
            "SGLang refuses /flush_cache while paused requests wait or run (retract re-queues "
            "them, in_place keeps them running): the cache can only be kept (':keep')");
      }
      p.cache = Cache::kKeep;
      return p;
  }
  return p;
}

std::vector<bool> SglangDriver::ResumeAfterAbort(const std::set<std::string>& still_dirty) {
  std::lock_guard lock(post_mu_);
  std::vector<bool> dirty(workers_.size(), false);
  for (size_t i = 0; i < workers_.size(); ++i) dirty[i] = still_dirty.count(workers_[i]->url()) > 0;
  if (closed_) return dirty;  // already ended (committed, or resumed by an earlier call)
  closed_ = true;
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->DropQueued();
    // After the drop no further update can start, so this is final for the publication.
    dirty[i] = dirty[i] || workers_[i]->outcome().updates_sent > 0;
    if (!lifecycle_calls_) continue;
    // Closes the session on every engine that was asked to open one (answered or not: a begin
    // whose answer was lost may have opened it), dirty ones included, before any resume.
    if (workers_[i]->opened()) PostClosing(i, options_.endpoints.end);
    if (!dirty[i] && paused_) PostClosing(i, options_.endpoints.resume);
  }
  return dirty;
}

void SglangDriver::Leave() {
  std::lock_guard lock(post_mu_);
  closed_ = true;
  for (auto& w : workers_) {
    w->DropQueued();
    w->Reset();
  }
  if (options_.colocated) return;  // no weight-update group to leave
  PostAll("POST", options_.endpoints.destroy_group,
          json({{"group_name", layout_.group_name}}).dump());
}

std::vector<EngineOutcome> SglangDriver::outcomes() const { return OutcomesOf(workers_); }

bool SglangDriver::any_failed() const { return AnyFailed(workers_); }

std::vector<bool> SglangFamily::Probe(const std::vector<EngineSpec>& engines,
                                      absl::Duration timeout) const {
  if (options_.health_endpoint.empty()) return std::vector<bool>(engines.size(), true);
  return ProbeEngines(engines, options_.health_endpoint, timeout);
}

std::vector<uint64_t> SglangFamily::WeightVersions(const std::vector<EngineSpec>& engines,
                                                   absl::Duration timeout) const {
  if (options_.model_info_endpoint.empty()) return std::vector<uint64_t>(engines.size(), 0);
  return FetchWeightVersions(engines, options_.model_info_endpoint, timeout);
}

namespace {

std::vector<int> ParseRelease(absl::string_view release) {
  // "0.5.5.post3", "0.5.3rc2", "v0.5.16.dev12+g1234": the leading numeric components.
  absl::ConsumePrefix(&release, "v");
  std::vector<int> parts;
  for (absl::string_view piece : absl::StrSplit(release, '.')) {
    size_t digits = 0;
    while (digits < piece.size() && absl::ascii_isdigit(piece[digits])) ++digits;
    int n = 0;
    if (digits == 0 || !absl::SimpleAtoi(piece.substr(0, digits), &n)) break;
    parts.push_back(n);
    if (digits != piece.size()) break;  // "3rc2": 3, then stop
  }
  return parts;
}

}  // namespace

bool ReleaseBefore(absl::string_view release, absl::string_view minimum) {
  const std::vector<int> a = ParseRelease(release), b = ParseRelease(minimum);
  if (a.empty() || b.empty()) return false;  // unknown: assume a current release
  return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
}

std::vector<absl::StatusOr<EngineProfile>> SglangFamily::Profile(
    const std::vector<EngineSpec>& engines, absl::Duration timeout) const {
  const SglangEndpoints& e = options_.driver.endpoints;
  // GETs only: SGLang serves these routes for POST (FastAPI answers 405 to a GET of a route it
  // has, 404 to one it lacks), so nothing on the engine changes. /flush_cache is not probed (a
  // GET flushes).
  const bool colocated = options_.driver.colocated;
  std::vector<std::string> required = colocated ? std::vector<std::string>{e.tensor_update}
                                                : std::vector<std::string>{e.init_group, e.update};
  std::vector<std::string> optional;
  for (const std::string* p :
       {&e.destroy_group, &e.pause, &e.begin, &e.version, &e.end, &e.resume}) {
    if (!p->empty() && !(colocated && p == &e.destroy_group)) optional.push_back(*p);
  }
  std::vector<std::string> paths = required;
  paths.insert(paths.end(), optional.begin(), optional.end());
  // The server's info: /server_info (current releases), /get_server_info (older ones).
  paths.push_back("/server_info");
  paths.push_back("/get_server_info");
  return ProfileEngines(
      engines, paths, timeout,
      [&](const EngineSpec& engine,
          const std::vector<RouteAnswer>& answers) -> absl::StatusOr<EngineProfile> {
        EngineProfile p;
        const size_t routes = required.size() + optional.size();
        for (size_t k = 0; k < routes; ++k) {
          const std::string what = absl::StrCat("engine ", engine.url, " GET ", paths[k]);
          if (std::optional<absl::Status> refused = ProbeRefusal(what, answers[k])) {
            return *refused;
          }
          if (answers[k].status != 404) continue;
          if (k < required.size()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "engine ", engine.url, " has no ", paths[k],
                " (HTTP 404): not an SGLang server, or one whose weight-update routes are off"));
          }
          p.lacks.insert(paths[k]);
        }
        // Begin and end come as a pair (SGLang's weight-update session): one without the other is
        // neither.
        if (!e.begin.empty() && !e.end.empty() && (p.Lacks(e.begin) || p.Lacks(e.end))) {
          p.lacks.insert(e.begin);
          p.lacks.insert(e.end);
        }
        // The server info is a NORMAL route: with both of SGLang's keys it may refuse the admin key
        // the weight routes take, so only a missing answer refuses the engine.
        for (size_t k = routes; k < paths.size(); ++k) {
          if (answers[k].status == 0) {
            return *ProbeRefusal(absl::StrCat("engine ", engine.url, " GET ", paths[k]),
                                 answers[k]);
          }
          if (ReadServerInfo(answers[k], &p)) break;
        }
        if (!options_.flattened_bucket_since.empty() &&
            ReleaseBefore(p.release, options_.flattened_bucket_since)) {
          p.lacks.emplace(kFlattenedBucket);
          if (colocated) {
            // Its tensor route rebuilds a flattened bucket in one dtype only.
            return absl::FailedPreconditionError(absl::StrCat(
                "engine ", engine.url, " runs SGLang ", p.release,
                ", whose /update_weights_from_tensor takes no flattened bucket of mixed dtypes (",
                options_.flattened_bucket_since, " or later serves colocated publications)"));
          }
        }
        return p;
      });
}

absl::StatusOr<std::unique_ptr<EngineDriver>> SglangFamily::CreateDriver(
    const GroupAddress& address) const {
  SglangDriverOptions d = options_.driver;
  d.engines = address.engines;
  d.master_address = address.master_address;
  d.master_port = address.master_port;
  d.group_name = address.group_name;
  d.profiles = address.profiles;
  absl::StatusOr<std::unique_ptr<SglangDriver>> driver = SglangDriver::Create(d);
  if (!driver.ok()) return driver.status();
  return std::unique_ptr<EngineDriver>(*std::move(driver));
}

}  // namespace wpub::rollout
