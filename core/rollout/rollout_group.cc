// RolloutGroup: creation, per-bucket update request + broadcast, re-formation at the next Begin,
// the publication's stage, aborts and dirty engines, the snapshots (formation and ConnectEngines:
// rollout_group_form.cc).
#include "core/rollout/rollout_group.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/delta/bucket_patch.h"
#include "spdlog/spdlog.h"

namespace wpub::rollout {
namespace {

// How long an abort waits for the engines to take its closing calls and resumes.
constexpr absl::Duration kAbortSettle = absl::Seconds(5);

transport::ReceiverFailure Classify(const std::string& error) {
  if (error.find("imed out") != std::string::npos || error.find("eadline") != std::string::npos ||
      error.find("Read") != std::string::npos) {
    return transport::ReceiverFailure::kTimeout;
  }
  if (error.find("Connection") != std::string::npos || error.find("NCCL") != std::string::npos) {
    return transport::ReceiverFailure::kDisconnected;
  }
  return transport::ReceiverFailure::kProtocol;
}

// `engines` with `token` as the bearer token of each that has none of its own.
std::vector<EngineSpec> WithToken(std::vector<EngineSpec> engines, const std::string& token) {
  for (EngineSpec& e : engines) {
    if (e.auth_token.empty()) e.auth_token = token;
  }
  return engines;
}

std::string NewIncarnation() {
  std::random_device rd;
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08x", static_cast<unsigned>(rd()));
  return hex;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RolloutGroup>> RolloutGroup::Create(
    const RolloutGroupOptions& options, std::unique_ptr<transport::GroupChannel> channel) {
  if (channel == nullptr) return absl::InvalidArgumentError("rollout group: no channel");
  if (!options.engines.empty()) {
    // The initial set obeys the same rules as a ConnectEngines request.
    engine::RolloutConnectRequest r;
    for (const EngineSpec& e : options.engines) r.engines.push_back({e.url, e.gpus, e.family});
    r.group_name = options.group_name;
    WPUB_RETURN_IF_ERROR(engine::ValidateRolloutConnectRequest(r));
  }
  if (options.group_name.empty()) {
    return absl::InvalidArgumentError("rollout group: empty group name");
  }
  if (options.unique_id_key_templates.empty()) {
    return absl::InvalidArgumentError("rollout group: no unique-id key template");
  }
  std::map<std::string, std::shared_ptr<const EngineFamily>> families;
  if (options.colocated) {
    SglangFamilyOptions sglang = options.sglang;
    sglang.driver.colocated = true;
    families[std::string(kSglangIpcFamily)] =
        options.family ? options.family : std::make_shared<SglangFamily>(sglang);
    VllmFamilyOptions vllm = options.vllm;
    vllm.driver.colocated = true;
    families[std::string(kVllmIpcFamily)] =
        options.vllm_family ? options.vllm_family : std::make_shared<VllmFamily>(vllm);
  } else {
    families["sglang"] =
        options.family ? options.family : std::make_shared<SglangFamily>(options.sglang);
    families["vllm"] =
        options.vllm_family ? options.vllm_family : std::make_shared<VllmFamily>(options.vllm);
  }
  std::unique_ptr<RolloutGroup> g(new RolloutGroup(options, std::move(families)));
  WPUB_ASSIGN_OR_RETURN(g->family_, g->FamilyOf(g->engines_));
  if (!g->engines_.empty()) {
    WPUB_ASSIGN_OR_RETURN(g->engines_, g->WithPause(g->engines_, *g->family_, options.pause));
  }
  WPUB_ASSIGN_OR_RETURN(g->store_, rendezvous::TcpStoreServer::Create(options.store));
  g->channel_ = std::move(channel);
  {
    std::lock_guard lock(g->connect_mu_);
    g->PublishInfo();
  }
  if (options.engine_watch_interval > absl::ZeroDuration()) {
    g->watch_thread_ = std::thread([raw = g.get()] { raw->WatchLoop(); });
  }
  return g;
}

RolloutGroup::RolloutGroup(RolloutGroupOptions options,
                           std::map<std::string, std::shared_ptr<const EngineFamily>> families)
    : options_(std::move(options)),
      families_(std::move(families)),
      engines_(WithToken(options_.engines, options_.engine_auth_token)),
      base_group_(options_.group_name),
      incarnation_(NewIncarnation()) {}

RolloutGroup::~RolloutGroup() {
  {
    std::lock_guard lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (channel_) {  // null when Create failed before taking it
    channel_->End();
    channel_->Close();  // NCCL: terminates anything still on the comm stream
  }
  driver_.reset();
}

void RolloutGroup::TearDownGroup() {
  if (driver_) {
    driver_->Leave();  // best effort: engines drop the old group (they key groups by name)
    (void)driver_->WaitIdle(absl::Now() + absl::Seconds(5));
  }
  channel_->Close();  // NCCL: ncclCommAbort
  driver_.reset();
  formed_ = false;
}

void RolloutGroup::PublishInfo() {
  engine::RolloutGroupInfo g;
  g.store_address = absl::StrCat(options_.advertise_address, ":", store_->port());
  g.generation = static_cast<uint64_t>(generation_.load());
  g.healthy = formed_;
  if (driver_) {
    const GroupLayout& l = driver_->layout();
    g.group_name = l.group_name;
    g.world_size = l.world_size;
    const std::vector<EngineSpec>& members = driver_->engines();
    for (size_t i = 0; i < members.size(); ++i) {
      g.engines.push_back({members[i].url, members[i].gpus, l.rank_offsets[i],
                           transport::ReceiverState::kIdle, 0, members[i].pause});
    }
    // Left out for not answering, answering again (the engine watch): behind, no rank yet.
    std::lock_guard lock(info_mu_);
    for (const EngineSpec& e : engines_) {
      if (rejoining_.count(e.url) != 0) {
        g.engines.push_back({e.url, e.gpus, 0, transport::ReceiverState::kIdle, 0, e.pause});
      }
    }
  } else {
    // No group: the engine set the next Begin forms one with (empty after a failed Connect).
    int next = 1;
    for (const EngineSpec& e : engines_) {
      g.engines.push_back({e.url, e.gpus, next, transport::ReceiverState::kLeft, 0, e.pause});
      next += e.gpus;
    }
  }
  std::lock_guard lock(info_mu_);
  for (engine::RolloutEngineInfo& e : g.engines) {
    auto it = weight_versions_.find(e.url);
    e.weight_version = it == weight_versions_.end() ? 0 : it->second;
  }
  for (const auto& [url, v] : weight_versions_) {
    g.highest_engine_version = std::max(g.highest_engine_version, v);
  }
  info_ = std::move(g);
}

engine::RolloutGroupInfo RolloutGroup::Group() const {
  engine::RolloutGroupInfo g;
  std::set<std::string> dirty;
  {
    std::lock_guard lock(info_mu_);
    g = info_;
    dirty = dirty_;
  }
  // Live state: a failure or an abort since the snapshot marks the group down.
  g.healthy = g.healthy && formed_ && channel_->usable();
  for (engine::RolloutEngineInfo& e : g.engines) {
    if (e.state == transport::ReceiverState::kLeft) continue;
    e.state = !g.healthy    ? transport::ReceiverState::kFailed
              : in_flight() ? transport::ReceiverState::kReceiving
                            : transport::ReceiverState::kIdle;
    // Paused with a possible mix of versions until a complete one reaches it.
    if (dirty.count(e.url) && e.state != transport::ReceiverState::kReceiving) {
      e.state = transport::ReceiverState::kDirty;
    }
  }
  return g;
}

transport::TransportCapabilities RolloutGroup::capabilities() const {
  transport::TransportCapabilities c;
  c.name = options_.colocated ? "ipc" : "nccl";
  c.accepts = transport::kHostOrDevice;
  c.receiver_paced = false;
  c.acknowledges_checksums = false;
  c.applies_on_receipt = true;  // engines load each bucket into their live weights
  return c;
}

absl::Status RolloutGroup::EngineFailure() const {
  if (!driver_ || !driver_->any_failed()) return absl::OkStatus();
  std::vector<std::string> errs;
  for (const EngineOutcome& o : driver_->outcomes()) {
    if (o.failed) errs.push_back(o.error);
  }
  return absl::AbortedError(absl::StrJoin(errs, "; "));
}

absl::StatusOr<std::vector<std::string>> RolloutGroup::Begin(
    const transport::PublicationManifest& m) {
  std::lock_guard connect_lock(connect_mu_);
  if (in_flight()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rollout group: publication ", version_, " is in flight"));
  }
  channel_->End();  // a watchdog left running by an abort from another thread
  if (engines_.empty()) {
    // No engines connected (yet, or after a failed ConnectEngines): no participants here; the
    // publication reaches the other transports' receivers only.
    if (driver_) TearDownGroup();
    version_ = m.version;
    stage_ = Stage::kBegun;
    return std::vector<std::string>{};
  }
  if (!formed_ || reform_ || !channel_->usable()) {
    reform_ = false;
    // Re-formation after a failure: the engines that pass their health check.
    absl::Status s = Form(engines_, base_group_, options_.join_timeout, /*strict=*/false);
    PublishInfo();
    WPUB_RETURN_IF_ERROR(s);
  }
  version_ = m.version;
  stage_ = Stage::kBegun;
  publication_deadline_ = absl::Now() + options_.publication_deadline;
  transport::PublicationWatch watch;
  watch.deadline = publication_deadline_;
  watch.deadline_message =
      absl::StrCat("publication ", m.version, " did not reach every engine within ",
                   absl::FormatDuration(options_.publication_deadline),
                   options_.colocated ? "" : "; NCCL communicator aborted");
  watch.peer_failure = [this] { return EngineFailure(); };
  watch.updates_answered = [this] {
    if (!driver_) return uint64_t{0};
    uint64_t fewest = UINT64_MAX;
    for (const EngineOutcome& o : driver_->outcomes())
      fewest = std::min(fewest, o.updates_answered);
    return fewest == UINT64_MAX ? 0 : fewest;
  };
  watch.not_ready_detail = [this] {
    // The keys engines asked the store for tell a wrong unique-id key template at once.
    return absl::StrCat("keys engines asked the store for: ",
                        absl::StrJoin(store_->RecentlyAwaitedKeys(), ", "));
  };
  channel_->Begin(std::move(watch));
  driver_->BeginPublication(m.version, m.engine_lifecycle);
  // Patches when every engine holds the retained version whole (see SetPatches).
  patch_base_.reset();
  std::shared_ptr<const transport::RetainedVersion> base =
      patches_.retained && patches_.full_every != 1 && m.group.empty() && !m.replay &&
              driver_->TakesPatches()
          ? patches_.retained()
          : nullptr;
  if (base != nullptr && base->manifest.group.empty() && base->manifest.version < m.version &&
      (patches_.full_every == 0 || patched_in_a_row_ + 1 < patches_.full_every)) {
    std::lock_guard lock(info_mu_);
    bool all = true;
    for (const EngineSpec& e : driver_->engines()) {
      const auto v = patch_holders_.find(e.url);
      all &= dirty_.count(e.url) == 0 && v != patch_holders_.end() &&
             v->second == base->manifest.version;
    }
    if (all) patch_base_ = std::move(base);
  }
  {
    std::lock_guard lock(patch_mu_);
    patch_stats_ = EnginePatchStats{};
    if (patch_base_ != nullptr) patch_stats_.base_version = patch_base_->manifest.version;
  }
  // An abort from another thread since kBegun found no engine asked anything yet: the resume it
  // could not owe is owed now, to the publication thread's own abort that follows.
  if (Stage begun = Stage::kBegun; !stage_.compare_exchange_strong(begun, Stage::kPaused)) {
    stage_ = Stage::kResumeOwed;
  }
  std::vector<std::string> names;
  for (const EngineSpec& e : driver_->engines()) names.push_back(e.url);
  return names;
}

absl::Status RolloutGroup::Send(std::shared_ptr<const transport::Bucket> bucket) {
  if (!in_flight()) return absl::FailedPreconditionError("rollout group: no publication begun");
  if (!driver_) return absl::OkStatus();  // no engines: no participants
  WPUB_RETURN_IF_ERROR(channel_->failure());
  // A colocated channel's engines read the bucket in place: their request carries it.
  WPUB_ASSIGN_OR_RETURN(const std::optional<transport::SharedDeviceBytes> shared,
                        channel_->Share(*bucket));
  if (patch_base_ != nullptr && !shared.has_value()) {
    absl::StatusOr<PatchMade> made = MakePatch(*bucket);
    if (!made.ok()) {
      spdlog::warn("publication {}: bucket {} goes whole: its patch: {}", version_,
                   bucket->manifest.index, made.status().ToString());
    } else if (made->patch != nullptr) {
      const transport::BucketManifest& m = bucket->manifest;
      driver_->PostPatchedBucket(
          m, UpdatePatch{
                 .base_version = patch_base_->manifest.version,
                 .base_checksum = patch_base_->manifest.buckets[m.index].checksum,
                 .target_checksum = made->target_checksum,
                 .bytes = made->patch->manifest.nbytes,
             });
      {
        std::lock_guard lock(patch_mu_);
        ++patch_stats_.patched_buckets;
        patch_stats_.patch_bytes += made->patch->manifest.nbytes;
        patch_stats_.patched_bucket_bytes += m.nbytes;
      }
      return channel_->Send(*made->patch, {});
    }
  }
  {
    std::lock_guard lock(patch_mu_);
    ++patch_stats_.whole_buckets;
    patch_stats_.whole_bytes += bucket->manifest.nbytes;
  }
  // The engine posts its receive inside this request's handler: issue it first.
  driver_->PostBucket(bucket->manifest, shared.has_value() ? &*shared : nullptr);
  const std::vector<uint64_t> chunks = driver_->BroadcastChunks(bucket->manifest);
  return channel_->Send(*bucket, chunks);
}

absl::StatusOr<RolloutGroup::PatchMade> RolloutGroup::MakePatch(const transport::Bucket& bucket) {
  const transport::RetainedVersion& r = *patch_base_;
  const uint32_t i = bucket.manifest.index;
  PatchMade out;
  if (i >= r.bucket_count()) return out;
  const transport::BucketManifest& was = r.manifest.buckets[i];
  if (was.nbytes != bucket.manifest.nbytes || was.tensors != bucket.manifest.tensors) return out;
  if (bucket.location == transport::BucketLocation::kDevice) {
    // Diffed where both live; only the checksum and the patch's size come to the host.
    if (r.memory == nullptr || !bucket.device.checksum_to_host) return out;
    WPUB_ASSIGN_OR_RETURN(out.target_checksum, bucket.device.checksum_to_host());
    WPUB_ASSIGN_OR_RETURN(
        transport::DevicePatch p,
        r.memory->PatchOnDevice(was, bucket, out.target_checksum, patches_.max_patch_fraction));
    if (p.made) out.patch = std::move(p.patch);
    return out;
  }
  WPUB_ASSIGN_OR_RETURN(std::shared_ptr<const transport::Bucket> base, r.HostBucketAt(i));
  delta::BucketPatchPlan plan =
      delta::DiffBucket(base->span(), was.checksum, bucket.span(), bucket.manifest.checksum,
                        {.max_patch_fraction = patches_.max_patch_fraction,
                         .threads = patches_.threads,
                         .format = delta::PatchFormat::kIndexedUnits});
  if (plan.full) return out;
  auto patch = std::make_shared<transport::Bucket>();
  patch->version = bucket.version;
  patch->manifest.index = i;
  patch->manifest.nbytes = plan.patch.size();
  patch->bytes = std::move(plan.patch);
  out.target_checksum = bucket.manifest.checksum;
  out.patch = std::move(patch);
  return out;
}

void RolloutGroup::SetEnginePatches(transport::EnginePatches patches) {
  patches_ = std::move(patches);
}

EnginePatchStats RolloutGroup::last_patches() const {
  std::lock_guard lock(patch_mu_);
  return patch_stats_;
}

absl::Status RolloutGroup::WaitAcknowledged(absl::Time deadline) {
  if (!in_flight()) return absl::FailedPreconditionError("rollout group: no publication begun");
  if (!driver_) return absl::OkStatus();  // no engines
  const absl::Time d = std::min(deadline, publication_deadline_);
  // The engines answer their bucket requests once their receives completed.
  for (;;) {
    WPUB_RETURN_IF_ERROR(channel_->failure());
    const absl::Time step = std::min(d, absl::Now() + absl::Milliseconds(20));
    absl::Status s = driver_->WaitIdle(step);
    if (s.ok()) break;
    if (!absl::IsDeadlineExceeded(s) || absl::Now() >= d) {
      channel_->Fail(absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError(absl::StrCat(
                                                       "publication ", version_, ": ", s.message()))
                                                 : s);
      return channel_->failure();
    }
  }
  // And rank 0's side of every broadcast is complete.
  return channel_->WaitSent(d);
}

absl::Status RolloutGroup::Commit() {
  if (!in_flight()) return absl::FailedPreconditionError("rollout group: no publication begun");
  channel_->End();
  if (!driver_) {  // no engines
    stage_ = Stage::kIdle;
    return absl::OkStatus();
  }
  WPUB_RETURN_IF_ERROR(channel_->failure());
  if (Stage paused = Stage::kPaused; !stage_.compare_exchange_strong(paused, Stage::kEnding)) {
    return absl::AbortedError(absl::StrCat("publication ", version_,
                                           " was aborted before the engines were told to end it"));
  }
  driver_->EndPublication();
  absl::Status s = driver_->WaitIdle(absl::Now() + family_->request_timeout());
  const EnginePatchStats p = last_patches();
  // full_every counts committed publications that patched something.
  patched_in_a_row_ = s.ok() && p.patched_buckets > 0 ? patched_in_a_row_ + 1 : 0;
  if (patch_base_ != nullptr) {
    spdlog::info(
        "publication {}: {} of {} buckets broadcast as patches against v{} ({} bytes "
        "for {})",
        version_, p.patched_buckets, p.patched_buckets + p.whole_buckets, p.base_version,
        p.patch_bytes, p.patched_bucket_bytes);
  }
  patch_base_.reset();
  {
    // An engine that applied the whole version is clean again; one whose end calls failed
    // may have applied part of it and stays dirty.
    std::lock_guard lock(info_mu_);
    for (const EngineOutcome& o : driver_->outcomes()) {
      if (!o.warning.empty()) spdlog::warn("publication {}: {}", version_, o.warning);
      if (o.failed) {
        dirty_.insert(o.url);
      } else {
        dirty_.erase(o.url);
        weight_versions_[o.url] = version_;
        patch_holders_[o.url] = version_;
      }
    }
  }
  stage_ = Stage::kIdle;
  return s;
}

void RolloutGroup::Abort(absl::string_view reason) {
  // A group without engines has no communicator in use and must keep no failure: only Begin
  // with engines (NcclTransport::Begin) forgets one, so a failure recorded here would end the
  // next publication of this empty group -- the other family's in a mixed deployment -- with
  // this one's reason.
  if (driver_) {
    channel_->Fail(
        absl::AbortedError(absl::StrCat("publication ", version_, " aborted: ", reason)));
  }
  // kBegun, kEnding -> kAborted; kPaused -> kResumeOwed (other stages stay: nothing in flight
  // to abort, or an abort already claimed it).
  Stage s = stage_.load();
  while ((s == Stage::kBegun || s == Stage::kPaused || s == Stage::kEnding) &&
         !stage_.compare_exchange_weak(
             s, s == Stage::kPaused ? Stage::kResumeOwed : Stage::kAborted)) {
  }
  ResumeCleanEngines();
}

void RolloutGroup::ResumeCleanEngines() {
  // Begin (which replaces driver_) holds connect_mu_ for as long as it forms a group: an abort
  // arriving then leaves the resume to the publication thread's own Abort, which follows.
  std::unique_lock connect_lock(connect_mu_, std::try_to_lock);
  if (!connect_lock.owns_lock()) return;
  if (Stage aborted = Stage::kAborted; stage_.compare_exchange_strong(aborted, Stage::kIdle)) {
    return;
  }
  Stage owed = Stage::kResumeOwed;
  if (!stage_.compare_exchange_strong(owed, Stage::kResuming)) return;
  if (!driver_) {
    stage_ = Stage::kIdle;
    return;
  }
  std::set<std::string> still_dirty;
  {
    std::lock_guard lock(info_mu_);
    still_dirty = dirty_;
  }
  const std::vector<bool> dirty = driver_->ResumeAfterAbort(still_dirty);
  // The calls that close what the publication opened (SGLang's end, vLLM's finish) and the
  // resumes are delivered before the abort is reported and before the next publication can
  // begin (connect_mu_ is held): an engine is never left with a session open behind a report
  // that says the publication is over. Bounded: a hung engine costs at most kAbortSettle.
  (void)driver_->WaitIdle(absl::Now() + kAbortSettle);
  const std::vector<EngineSpec>& engines = driver_->engines();
  {
    std::lock_guard lock(info_mu_);
    for (size_t i = 0; i < dirty.size() && i < engines.size(); ++i) {
      if (dirty[i]) dirty_.insert(engines[i].url);
    }
  }
  stage_ = Stage::kIdle;
}

void RolloutGroup::MarkParticipantsDirty() {
  std::lock_guard lock(info_mu_);
  for (const engine::RolloutEngineInfo& e : info_.engines) dirty_.insert(e.url);
}

std::vector<std::string> RolloutGroup::dirty_engines() const {
  std::lock_guard lock(info_mu_);
  return std::vector<std::string>(dirty_.begin(), dirty_.end());
}

std::vector<transport::ReceiverOutcome> RolloutGroup::Outcomes() const {
  if (!driver_) return {};
  const absl::Status f = channel_->failure();
  const std::vector<EngineOutcome> outcomes = driver_->outcomes();
  bool any_engine_failed = false;
  for (const EngineOutcome& o : outcomes) any_engine_failed |= o.failed;
  std::set<std::string> dirty;
  {
    std::lock_guard lock(info_mu_);
    dirty = dirty_;
  }
  std::vector<transport::ReceiverOutcome> out;
  const std::vector<EngineSpec>& specs = driver_->engines();
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const EngineOutcome& o = outcomes[i];
    transport::ReceiverOutcome r;
    r.name = o.url;
    if (i < specs.size()) r.family = specs[i].family;
    r.pause = PauseWindowOf(o.pause, now);
    // Holds part of a version that has not committed: left dirty by an abort, or (in flight)
    // it would be if this attempt ended now.
    const bool in_flight = this->in_flight();
    r.dirty = dirty.count(o.url) > 0 || (in_flight && o.updates_sent > 0);
    if (o.failed || (!f.ok() && !any_engine_failed)) {
      r.state = transport::ReceiverState::kFailed;
      r.error = o.failed ? o.error : std::string(f.message());
      r.failure = Classify(r.error);
    } else {
      r.state =
          in_flight ? transport::ReceiverState::kReceiving : transport::ReceiverState::kStaged;
      r.committed = !in_flight && f.ok();
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<transport::ReceiverInfo> RolloutGroup::Receivers() const {
  std::vector<transport::ReceiverInfo> out;
  for (const engine::RolloutEngineInfo& e : Group().engines) {
    transport::ReceiverInfo r;
    r.name = e.url;
    r.state =
        e.state == transport::ReceiverState::kFailed ? transport::ReceiverState::kLeft : e.state;
    r.held_version = e.weight_version;
    out.push_back(std::move(r));
  }
  // Dirty engines no longer in the group (it re-formed without them) are still paused.
  std::set<std::string> listed;
  for (const auto& r : out) listed.insert(r.name);
  for (const std::string& url : dirty_engines()) {
    if (listed.count(url)) continue;
    transport::ReceiverInfo r;
    r.name = url;
    r.state = transport::ReceiverState::kDirty;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace wpub::rollout
