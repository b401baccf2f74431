// The rollout group's engine watch (rollout_group.h, RolloutGroupOptions::engine_watch_interval):
// an engine that restarts between publications leaves the NCCL group with its process and comes
// back serving its start-up checkpoint. The watch finds it -- it answers its health check and
// reports a weight version below the one the group last gave it -- marks the group for
// re-formation and tells the behind listener, so the engine is caught up from the retained copy
// (docs/DESIGN.md, "Convergence on the committed version"). An engine that stopped answering
// its health check makes the group re-form too, without it, so the next version is not lost to
// a pause request the dead engine cannot answer. An engine a re-formation left out that way is
// watched too: once it answers again, it is shown behind and the group re-forms with it, so it
// is caught up like a restarted one.
#include <spdlog/spdlog.h>

#include <set>

#include "core/rollout/rollout_group.h"

namespace wpub::rollout {

void RolloutGroup::SetBehindListener(BehindListener listener) {
  std::lock_guard lock(watch_mu_);
  behind_listener_ = std::move(listener);
}

std::vector<std::string> RolloutGroup::WatchEnginesOnce() {
  std::vector<EngineSpec> engines;
  std::vector<EngineSpec> left_out;  // of the set, not in the formed group
  std::shared_ptr<const EngineFamily> family;
  int generation = 0;
  {
    // Never waits on a publication or a Connect: the watch only looks at an idle, formed group.
    std::unique_lock lock(connect_mu_, std::try_to_lock);
    if (!lock.owns_lock() || in_flight() || !formed_ || engines_.empty() || !driver_) return {};
    engines = driver_->engines();
    std::set<std::string> members;
    for (const EngineSpec& e : engines) members.insert(e.url);
    std::lock_guard info(info_mu_);
    for (const EngineSpec& e : engines_) {
      if (members.count(e.url) == 0 && unusable_.count(e.url) == 0) left_out.push_back(e);
    }
    family = family_;
    generation = generation_;
  }
  // The probes run without the group's lock (they take up to the family's connect timeout).
  const absl::Duration timeout = family->connect_timeout();
  const std::vector<bool> alive = family->Probe(engines, timeout);
  const std::vector<uint64_t> versions = family->WeightVersions(engines, timeout);
  // Left out: probed, and only those that answer asked for their version.
  const std::vector<bool> left_alive =
      left_out.empty() ? std::vector<bool>{} : family->Probe(left_out, timeout);
  std::vector<EngineSpec> answering;
  for (size_t i = 0; i < left_out.size() && i < left_alive.size(); ++i) {
    if (left_alive[i]) answering.push_back(left_out[i]);
  }
  const std::vector<uint64_t> answering_versions =
      answering.empty() ? std::vector<uint64_t>{} : family->WeightVersions(answering, timeout);
  std::vector<std::pair<std::string, uint64_t>> back;
  std::vector<std::string> down;
  {
    std::unique_lock lock(connect_mu_, std::try_to_lock);
    // A publication or Connect began meanwhile: it sees the engines itself.
    if (!lock.owns_lock() || in_flight() || generation_ != generation) return {};
    {
      std::lock_guard info(info_mu_);
      for (size_t i = 0; i < answering.size(); ++i) {
        const std::string& url = answering[i].url;
        if (rejoining_.count(url) != 0) continue;  // told already
        rejoining_.insert(url);
        const uint64_t held = i < answering_versions.size() ? answering_versions[i] : 0;
        weight_versions_[url] = held;
        back.emplace_back(url, held);
      }
      for (size_t i = 0; i < engines.size() && i < alive.size() && i < versions.size(); ++i) {
        if (!alive[i]) {  // down: the next publication re-forms the group without it
          down.push_back(engines[i].url);
          continue;
        }
        const std::string& url = engines[i].url;
        // Only an engine seen reporting a version is judged by what it reports (0 is also what
        // a release without versions answers, every time).
        if (versions[i] > 0) reporting_.insert(url);
        if (reporting_.count(url) == 0) continue;
        uint64_t& had = weight_versions_[url];
        if (versions[i] >= had) continue;
        back.emplace_back(url, versions[i]);
        had = versions[i];  // what it holds now: behind the committed version
      }
    }
    if (back.empty() && down.empty()) return {};
    // Said once per re-formation owed: the watch finds a dead engine again every round until
    // the next Begin leaves it out.
    if (reform_) down.clear();
    // The next Begin (the catch-up's) forms the group again, with it. The group stays shown
    // formed meanwhile: the engine is up, and behind (it holds less than the committed version).
    reform_ = true;
    PublishInfo();
  }
  for (const std::string& url : down) {
    spdlog::warn(
        "engine {} does not answer its health check: the next publication re-forms the "
        "group without it",
        url);
  }
  BehindListener listener;
  {
    std::lock_guard lock(watch_mu_);
    listener = behind_listener_;
  }
  std::vector<std::string> urls;
  for (const auto& [url, held] : back) {
    spdlog::warn("engine {} is back holding v{}: the group re-forms with it", url, held);
    if (listener) listener(url, held);
    urls.push_back(url);
  }
  return urls;
}

void RolloutGroup::WatchLoop() {
  std::unique_lock lock(watch_mu_);
  for (;;) {
    watch_cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.engine_watch_interval),
                       [&] { return watch_stop_; });
    if (watch_stop_) return;
    lock.unlock();
    WatchEnginesOnce();
    lock.lock();
  }
}

}  // namespace wpub::rollout
