// FamilyRouter (family_router.h).
#include "core/rollout/family_router.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"

namespace wpub::rollout {
namespace {

std::string FamilyOf(const engine::RolloutEndpoint& e) {
  return e.family.empty() ? std::string("sglang") : e.family;
}

}  // namespace

absl::StatusOr<engine::RolloutGroupInfo> FamilyRouter::Connect(
    const engine::RolloutConnectRequest& request) {
  if (absl::Status s = engine::ValidateRolloutConnectRequest(request); !s.ok()) return s;
  for (size_t i = 0; i < request.engines.size(); ++i) {
    const std::string f = FamilyOf(request.engines[i]);
    const bool served =
        std::any_of(members_.begin(), members_.end(), [&](const auto& m) { return m.first == f; });
    if (!served) {
      return absl::InvalidArgumentError(absl::StrCat("engines[", i, "] '", request.engines[i].url,
                                                     "': no group serves engine kind '", f, "'"));
    }
  }
  const auto disconnect_all = [&] {
    for (const auto& [family, group] : members_) group->Disconnect().IgnoreError();
  };
  std::vector<engine::RolloutConnectRequest> parts;
  for (const auto& [family, group] : members_) {
    engine::RolloutConnectRequest& part = parts.emplace_back(request);
    part.engines.clear();
    for (const engine::RolloutEndpoint& e : request.engines) {
      if (FamilyOf(e) == family) part.engines.push_back(e);
    }
    // Refused before any group changes (e.g. a pause policy one family cannot carry out).
    if (!part.engines.empty()) WPUB_RETURN_IF_ERROR(group->CheckConnect(part));
  }
  for (size_t m = 0; m < members_.size(); ++m) {
    FamilyConnector* group = members_[m].second;
    const engine::RolloutConnectRequest& part = parts[m];
    if (part.engines.empty()) {
      if (absl::Status s = group->Disconnect(); !s.ok()) {
        disconnect_all();
        return s;
      }
      continue;
    }
    absl::StatusOr<engine::RolloutGroupInfo> joined = group->Connect(part);
    if (!joined.ok()) {
      disconnect_all();
      return joined.status();
    }
  }
  return Group();
}

engine::RolloutGroupInfo FamilyRouter::Group() const {
  std::vector<engine::RolloutGroupInfo> withs;
  engine::RolloutGroupInfo first;
  for (size_t i = 0; i < members_.size(); ++i) {
    engine::RolloutGroupInfo g = members_[i].second->Group();
    if (i == 0) first = g;
    if (!g.engines.empty()) withs.push_back(std::move(g));
  }
  if (withs.empty()) return first;
  if (withs.size() == 1) return withs[0];
  engine::RolloutGroupInfo out;
  std::vector<std::string> names, stores;
  out.healthy = true;
  for (const engine::RolloutGroupInfo& g : withs) {
    names.push_back(g.group_name);
    stores.push_back(g.store_address);
    out.world_size += g.world_size;
    out.generation = std::max(out.generation, g.generation);
    out.healthy = out.healthy && g.healthy;
    out.highest_engine_version = std::max(out.highest_engine_version, g.highest_engine_version);
    out.engines.insert(out.engines.end(), g.engines.begin(), g.engines.end());
  }
  out.group_name = absl::StrJoin(names, ",");
  out.store_address = absl::StrJoin(stores, ",");
  return out;
}

}  // namespace wpub::rollout
