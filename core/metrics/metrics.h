// wpub's Prometheus metrics (the names are a contract, see docs/DESIGN.md): registered once
// on a caller-owned prometheus::Registry, labelled children created up front and cached, and
// updated from publication reports and engine state as the engine's observer
// (core/engine/observer.h). The HTTP exposer is the server's job.
// Thread-safe: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/observer.h"
#include "core/engine/types.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace wpub::metrics {

// Metric names.
inline constexpr char kPublicationsTotal[] = "wpub_publications_total";
inline constexpr char kPublicationSeconds[] = "wpub_publication_seconds";
inline constexpr char kPublicationPhaseSeconds[] = "wpub_publication_phase_seconds";
inline constexpr char kHostSyncsTotal[] = "wpub_host_syncs_total";
inline constexpr char kPublicationHostSyncs[] = "wpub_publication_host_syncs";
inline constexpr char kPublishedBytesTotal[] = "wpub_published_bytes_total";
inline constexpr char kTensorsTotal[] = "wpub_tensors_total";
inline constexpr char kIgnoreCacheHitsTotal[] = "wpub_ignore_snapshot_cache_hits_total";
inline constexpr char kIgnoreCacheMissesTotal[] = "wpub_ignore_snapshot_cache_misses_total";
inline constexpr char kEngines[] = "wpub_engines";
inline constexpr char kLastCommittedVersion[] = "wpub_last_committed_version";
inline constexpr char kEngineFailuresTotal[] = "wpub_engine_failures_total";
inline constexpr char kPublicationAttemptSeconds[] = "wpub_publication_attempt_seconds";
inline constexpr char kReceiverFailuresTotal[] = "wpub_receiver_failures_total";
inline constexpr char kPublicationsWithoutReceiversTotal[] =
    "wpub_publications_without_receivers_total";
inline constexpr char kEnginePausedSeconds[] = "wpub_engine_paused_seconds";
inline constexpr char kReplaysTotal[] = "wpub_replays_total";
inline constexpr char kReplaySeconds[] = "wpub_replay_seconds";
// Receivers with a series of their own in wpub_receiver_failures_total; the rest count under
// receiver="_other" (collectors.h bounds the live per-receiver series the same way).
inline constexpr size_t kMaxReceiverFailureSeries = 64;

class EngineMetrics final : public engine::EngineObserver {
 public:
  // Registers every family on `registry` (borrowed; must outlive this object and must not
  // already hold wpub metrics: INVALID_ARGUMENT then).
  static absl::StatusOr<std::unique_ptr<EngineMetrics>> Create(prometheus::Registry* registry);
  ~EngineMetrics() override;

  // Every report: wpub_publications_total{status}, wpub_host_syncs_total,
  // wpub_publication_host_syncs, wpub_engine_failures_total{reason} and
  // wpub_receiver_failures_total{receiver} (one per failed receiver),
  // wpub_publication_attempt_seconds{status} (the wall clock of every outcome),
  // wpub_engine_paused_seconds{family,part} (every rollout engine paused and resumed in it:
  // part total, waiting, transfer, finalization).
  // Committed reports also: wpub_publication_seconds, wpub_publication_phase_seconds{phase},
  // wpub_published_bytes_total{format}, wpub_tensors_total{action},
  // wpub_last_committed_version, and wpub_publications_without_receivers_total when no
  // receiver took part (committed to nobody).
  void OnReport(const engine::PublicationReport& report) override;

  // wpub_engines{state}: the number of connected receivers in each state; the policy cache's
  // counters advance by the difference of its monotonic totals to the last call (never
  // backwards).
  void OnState(const engine::EngineLiveState& state) override;

  // Every replay of the retained version that ran: wpub_replays_total{kind,outcome}
  // (outcome: completed, failed, preempted), wpub_replay_seconds{kind} (completed ones).
  void OnReplay(const engine::ReplayReport& report) override;

 private:
  EngineMetrics() = default;

  std::mutex mu_;
  prometheus::Family<prometheus::Counter>* published_bytes_ = nullptr;
  std::map<std::string, prometheus::Counter*> published_bytes_by_format_;  // guarded by mu_
  std::map<std::string, prometheus::Counter*> publications_;
  prometheus::Histogram* publication_seconds_ = nullptr;
  std::map<std::string, prometheus::Histogram*> phase_seconds_;
  prometheus::Counter* host_syncs_total_ = nullptr;
  prometheus::Gauge* publication_host_syncs_ = nullptr;
  std::map<std::string, prometheus::Counter*> tensors_;
  prometheus::Counter* cache_hits_ = nullptr;
  prometheus::Counter* cache_misses_ = nullptr;
  prometheus::Counter* without_receivers_ = nullptr;
  uint64_t last_hits_ = 0;    // guarded by mu_
  uint64_t last_misses_ = 0;  // guarded by mu_
  std::map<std::string, prometheus::Gauge*> engines_;
  prometheus::Gauge* last_committed_version_ = nullptr;
  std::map<std::string, prometheus::Counter*> failures_;
  std::map<std::string, prometheus::Histogram*> attempt_seconds_;
  std::map<std::string, prometheus::Histogram*> paused_seconds_;  // "<family>/<part>"
  prometheus::Family<prometheus::Histogram>* paused_family_ = nullptr;
  std::map<std::string, prometheus::Counter*> replays_;           // "<kind>/<outcome>"
  std::map<std::string, prometheus::Histogram*> replay_seconds_;  // by kind
  prometheus::Family<prometheus::Counter>* receiver_failures_ = nullptr;
  std::map<std::string, prometheus::Counter*> receiver_failures_by_name_;  // guarded by mu_
};

}  // namespace wpub::metrics
