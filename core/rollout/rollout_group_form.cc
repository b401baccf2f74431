// RolloutGroup's formation: the health probe, the join's profile of each engine, the layout, the
// unique id in the store, the joins; ConnectEngines and Disconnect (rollout_group.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/rollout/rollout_group.h"
#include "spdlog/spdlog.h"

namespace wpub::rollout {

absl::StatusOr<std::vector<EngineSpec>> RolloutGroup::Alive(const std::vector<EngineSpec>& want,
                                                            absl::Duration timeout,
                                                            bool strict) const {
  const absl::Duration probe_timeout = std::min(family_->connect_timeout(), timeout);
  const std::vector<bool> up = family_->Probe(want, probe_timeout);
  std::vector<EngineSpec> alive;
  std::vector<std::string> down;
  for (size_t i = 0; i < want.size(); ++i) {
    if (i < up.size() && up[i]) {
      alive.push_back(want[i]);
    } else {
      down.push_back(want[i].url);
    }
  }
  if (strict && !down.empty()) {
    return absl::UnavailableError(
        absl::StrCat(down.size() == 1 ? "engine " : "engines ", absl::StrJoin(down, ", "),
                     " did not pass the ", std::string(family_->name()), " health check within ",
                     absl::FormatDuration(probe_timeout), "; no engine group is connected"));
  }
  if (alive.empty()) {
    return absl::UnavailableError(absl::StrCat("rollout group: no engine passed the ",
                                               std::string(family_->name()), " health check (",
                                               want.size(), " configured)"));
  }
  return alive;
}

void RolloutGroup::RecordWeightVersions(const std::vector<EngineSpec>& engines,
                                        absl::Duration timeout) {
  // What each engine serves now: a daemon that restarted learns the version to go beyond.
  const std::vector<uint64_t> versions =
      family_->WeightVersions(engines, std::min(family_->connect_timeout(), timeout));
  std::lock_guard lock(info_mu_);
  for (size_t i = 0; i < engines.size() && i < versions.size(); ++i) {
    uint64_t& v = weight_versions_[engines[i].url];
    v = std::max(v, versions[i]);
  }
  // Joined anew: a patch needs a version committed in this group (SetEnginePatches).
  for (const EngineSpec& e : engines) patch_holders_.erase(e.url);
}

absl::StatusOr<std::shared_ptr<const EngineFamily>> RolloutGroup::FamilyOf(
    const std::vector<EngineSpec>& engines) const {
  if (engines.empty()) return families_.begin()->second;
  for (const EngineSpec& e : engines) {
    if (e.family != engines[0].family) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engines ", engines[0].url, " (", engines[0].family, ") and ", e.url, " (", e.family,
          ") speak different protocols: one weight-update group has one engine family (the GPU "
          "path gives each family its own group)"));
    }
  }
  const auto it = families_.find(engines[0].family.empty() ? "sglang" : engines[0].family);
  if (it != families_.end()) return it->second;
  std::vector<std::string> served;
  for (const auto& [name, family] : families_) served.push_back(name);
  return absl::InvalidArgumentError(absl::StrCat(
      "engine ", engines[0].url, ": engine family '", engines[0].family, "' is not served by this ",
      "weight-update group (it serves ", absl::StrJoin(served, ", "), ")"));
}

absl::StatusOr<std::vector<EngineSpec>> RolloutGroup::WithPause(
    std::vector<EngineSpec> engines, const EngineFamily& family,
    const engine::PausePolicy& policy) const {
  absl::StatusOr<engine::PausePolicy> resolved = family.ResolvePause(policy);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pause policy '", engine::InFlightName(policy.in_flight), ":",
                     engine::CacheName(policy.cache), "' for ", std::string(family.name()),
                     " engines: ", resolved.status().message()));
  }
  for (EngineSpec& e : engines) e.pause = *resolved;
  return engines;
}

absl::StatusOr<std::vector<EngineSpec>> RolloutGroup::Check(
    const engine::RolloutConnectRequest& request) const {
  WPUB_RETURN_IF_ERROR(engine::ValidateRolloutConnectRequest(request));
  const engine::PausePolicy pause = request.pause.value_or(options_.pause);
  std::vector<EngineSpec> want;
  for (const engine::RolloutEndpoint& e : request.engines) {
    want.push_back({e.url, e.gpus, e.family.empty() ? std::string("sglang") : e.family,
                    options_.engine_auth_token, pause});
  }
  WPUB_ASSIGN_OR_RETURN(std::shared_ptr<const EngineFamily> family, FamilyOf(want));
  return WithPause(std::move(want), *family, pause);
}

absl::Status RolloutGroup::Form(const std::vector<EngineSpec>& want, const std::string& base_group,
                                absl::Duration timeout, bool strict) {
  channel_->End();
  TearDownGroup();
  {
    // This formation decides again who is in: the watch's findings are spent.
    std::lock_guard lock(info_mu_);
    rejoining_.clear();
    unusable_.clear();
  }
  PublishInfo();
  WPUB_ASSIGN_OR_RETURN(std::vector<EngineSpec> alive, Alive(want, timeout, strict));
  // What each engine serves decides what it is sent (its release's routes); one that cannot
  // take publications (an API key wpubd lacks, a release too old) fails a ConnectEngines and is
  // left out of a re-formation.
  std::vector<EngineProfile> profiles;
  {
    const std::vector<absl::StatusOr<EngineProfile>> found =
        family_->Profile(alive, std::min(family_->connect_timeout(), timeout));
    std::vector<EngineSpec> usable;
    for (size_t i = 0; i < alive.size(); ++i) {
      const absl::StatusOr<EngineProfile>& p = found.at(i);  // one per engine (the contract)
      if (!p.ok()) {
        if (strict) {
          return absl::Status(p.status().code(),
                              absl::StrCat(p.status().message(), "; no engine group is connected"));
        }
        spdlog::warn("weight-update group: {} left out: {}", alive[i].url,
                     std::string(p.status().message()));
        std::lock_guard lock(info_mu_);
        unusable_.insert(alive[i].url);  // the engine watch leaves it to ConnectEngines
        continue;
      }
      spdlog::info("engine {} ({}): release {}{}{}", alive[i].url, family_->name(),
                   p->release.empty() ? "(not reported)" : p->release,
                   p->lacks.empty() ? "" : ", lacks ", absl::StrJoin(p->lacks, ", "));
      usable.push_back(alive[i]);
      profiles.push_back(*p);
    }
    if (usable.empty()) {
      return absl::UnavailableError(absl::StrCat("rollout group: no engine of ", want.size(),
                                                 " can take publications (see the log)"));
    }
    alive = std::move(usable);
  }
  const int generation = ++generation_;
  GroupAddress address;
  address.engines = alive;
  address.profiles = profiles;
  address.master_address = options_.advertise_address;
  address.master_port = store_->port();
  address.group_name = absl::StrCat(base_group, "_", incarnation_, "_", generation);
  // Everything that may fail before an engine is asked to join comes first, so a failure here
  // leaves no group behind.
  WPUB_ASSIGN_OR_RETURN(const transport::GroupId id, channel_->NewId());
  if (std::optional<std::vector<EngineFamily::StoreEntry>> entries =
          family_->UniqueIdEntries(absl::MakeConstSpan(id))) {
    for (const auto& [key, value] : *entries) {
      store_->Set(key, std::vector<uint8_t>(value.begin(), value.end()));
    }
  } else {
    for (const std::string& tmpl : options_.unique_id_key_templates) {
      WPUB_ASSIGN_OR_RETURN(std::string key, rendezvous::UniqueIdKey(tmpl, address.group_name, 0));
      store_->Set(key, std::vector<uint8_t>(id.begin(), id.end()));
    }
  }
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<EngineDriver> driver, family_->CreateDriver(address));
  // Errors name ranks; a version mismatch is reported with the engine that holds the rank.
  auto rank_name = [layout = driver->layout(), engines = alive](int rank) -> std::string {
    if (rank == 0) return "wpubd";
    for (size_t i = engines.size(); i-- > 0;) {
      if (rank >= layout.rank_offsets[i]) return absl::StrCat("engine ", engines[i].url);
    }
    return "";
  };
  spdlog::info("weight-update group {}: {} {} engine(s), world size {}, wpubd's {}",
               address.group_name, alive.size(), family_->name(), driver->layout().world_size,
               channel_->Describe());
  WPUB_RETURN_IF_ERROR(channel_->Open(driver->layout().world_size, id, std::move(rank_name)));
  driver_ = std::move(driver);
  driver_->StartJoin();
  const absl::Time join_deadline = absl::Now() + timeout;
  absl::Status warm = absl::OkStatus();
  if (family_->warmup_all_reduce()) {
    // The engines answer their join only after the all-reduce every rank runs after init.
    warm = channel_->WarmUp(join_deadline);
    if (!warm.ok() && driver_->any_failed()) warm = driver_->WaitIdle(absl::Now());
  }
  if (absl::Status s = warm.ok() ? driver_->WaitIdle(join_deadline) : warm; !s.ok()) {
    TearDownGroup();  // also the engines that did join: never half-connected
    const std::string why =
        absl::StrCat("weight-update group ", address.group_name, " did not form: ", s.message());
    return absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError(why)
                                       : absl::UnavailableError(why);
  }
  formed_ = true;
  RecordWeightVersions(alive, timeout);
  PublishInfo();
  return absl::OkStatus();
}

absl::StatusOr<engine::RolloutGroupInfo> RolloutGroup::Connect(
    const engine::RolloutConnectRequest& request) {
  WPUB_RETURN_IF_ERROR(engine::ValidateRolloutConnectRequest(request));
  std::lock_guard lock(connect_mu_);
  if (in_flight()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "publication ", version_, " is in flight on the rollout group; connect after it ends"));
  }
  // Refused before anything changes: the connected group stays.
  WPUB_ASSIGN_OR_RETURN(std::vector<EngineSpec> want, Check(request));
  family_ = *FamilyOf(want);
  const std::string base = request.group_name.empty() ? base_group_ : request.group_name;
  const absl::Duration timeout =
      request.timeout > absl::ZeroDuration() ? request.timeout : options_.join_timeout;
  engines_.clear();  // a failure below leaves no engines
  absl::Status s = Form(want, base, timeout, /*strict=*/true);
  if (s.ok()) {
    engines_ = want;
    base_group_ = base;
    if (!want.empty() && !want[0].pause.never_mixes()) {
      spdlog::info(
          "{} engine(s): pause policy {} lets one request's tokens come from two weight "
          "versions (docs/specs/engines.md, \"Pause policies\")",
          want.size(), engine::PausePolicyName(want[0].pause));
    }
  }
  PublishInfo();
  if (!s.ok()) return s;
  return Group();
}

absl::Status RolloutGroup::Disconnect() {
  std::lock_guard lock(connect_mu_);
  if (in_flight()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "publication ", version_, " is in flight on the rollout group; disconnect after it ends"));
  }
  if (engines_.empty() && !driver_) return absl::OkStatus();
  channel_->End();
  TearDownGroup();
  engines_.clear();
  PublishInfo();
  return absl::OkStatus();
}

}  // namespace wpub::rollout
