// Registration and updates of wpub's Prometheus metrics.
#include "core/metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/status.h"
#include "core/engine/rollout_connector.h"

namespace wpub::metrics {
namespace {

// Wall clock of publications: 10 ms .. ~20 min.
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600, 1200};
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineMetrics>> EngineMetrics::Create(
    prometheus::Registry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics: registry is null");
  std::unique_ptr<EngineMetrics> m(new EngineMetrics());
  try {
    auto& publications = prometheus::BuildCounter()
                             .Name(kPublicationsTotal)
                             .Help("Publications that ended, by final status")
                             .Register(*registry);
    for (auto s : {engine::PublicationStatus::kCommitted, engine::PublicationStatus::kAborted,
                   engine::PublicationStatus::kFailed}) {
      const std::string name = engine::PublicationStatusName(s);
      m->publications_[name] = &publications.Add({{"status", name}});
    }
    m->publication_seconds_ = &prometheus::BuildHistogram()
                                   .Name(kPublicationSeconds)
                                   .Help("Wall clock of committed publications, seconds")
                                   .Register(*registry)
                                   .Add({}, SecondsBuckets());
    auto& phases = prometheus::BuildHistogram()
                       .Name(kPublicationPhaseSeconds)
                       .Help("Seconds per executor phase of committed publications")
                       .Register(*registry);
    for (const char* phase : engine::kPhaseNames) {
      m->phase_seconds_[phase] = &phases.Add({{"phase", phase}}, SecondsBuckets());
    }
    m->host_syncs_total_ = &prometheus::BuildCounter()
                                .Name(kHostSyncsTotal)
                                .Help("Synchronizing device calls over all publications")
                                .Register(*registry)
                                .Add({});
    m->publication_host_syncs_ = &prometheus::BuildGauge()
                                      .Name(kPublicationHostSyncs)
                                      .Help("Synchronizing device calls of the last publication")
                                      .Register(*registry)
                                      .Add({});
    m->published_bytes_ = &prometheus::BuildCounter()
                               .Name(kPublishedBytesTotal)
                               .Help("Bytes of committed publications, by output format")
                               .Register(*registry);
    m->published_bytes_by_format_["nvfp4"] = &m->published_bytes_->Add({{"format", "nvfp4"}});
    auto& tensors = prometheus::BuildCounter()
                        .Name(kTensorsTotal)
                        .Help("Input tensors of committed publications, by policy action")
                        .Register(*registry);
    for (const char* action : {"quantized", "passthrough", "ignored"}) {
      m->tensors_[action] = &tensors.Add({{"action", action}});
    }
    m->cache_hits_ = &prometheus::BuildCounter()
                          .Name(kIgnoreCacheHitsTotal)
                          .Help("Ignore-rule snapshot cache hits")
                          .Register(*registry)
                          .Add({});
    m->cache_misses_ = &prometheus::BuildCounter()
                            .Name(kIgnoreCacheMissesTotal)
                            .Help("Ignore-rule snapshot cache misses (snapshot builds)")
                            .Register(*registry)
                            .Add({});
    m->without_receivers_ =
        &prometheus::BuildCounter()
             .Name(kPublicationsWithoutReceiversTotal)
             .Help(
                 "Committed publications that reached no receiver (no engine or pull receiver "
                 "connected): no rollout engine holds them")
             .Register(*registry)
             .Add({});
    auto& engines = prometheus::BuildGauge()
                        .Name(kEngines)
                        .Help("Connected receivers (engines), by state")
                        .Register(*registry);
    for (auto s : {transport::ReceiverState::kIdle, transport::ReceiverState::kReceiving,
                   transport::ReceiverState::kStaged, transport::ReceiverState::kFailed,
                   transport::ReceiverState::kLeft, transport::ReceiverState::kDirty}) {
      const std::string name = transport::ReceiverStateName(s);
      m->engines_[name] = &engines.Add({{"state", name}});
    }
    m->last_committed_version_ = &prometheus::BuildGauge()
                                      .Name(kLastCommittedVersion)
                                      .Help("Version of the last committed publication")
                                      .Register(*registry)
                                      .Add({});
    auto& failures = prometheus::BuildCounter()
                         .Name(kEngineFailuresTotal)
                         .Help("Receivers (engines) that failed a publication, by reason")
                         .Register(*registry);
    for (auto f :
         {transport::ReceiverFailure::kChecksum, transport::ReceiverFailure::kTimeout,
          transport::ReceiverFailure::kDisconnected, transport::ReceiverFailure::kProtocol}) {
      const std::string name = transport::ReceiverFailureName(f);
      m->failures_[name] = &failures.Add({{"reason", name}});
    }
    auto& attempts = prometheus::BuildHistogram()
                         .Name(kPublicationAttemptSeconds)
                         .Help(
                             "Wall clock of every publication that ended, by final status "
                             "(wpub_publication_seconds: committed ones only)")
                         .Register(*registry);
    for (auto s : {engine::PublicationStatus::kCommitted, engine::PublicationStatus::kAborted,
                   engine::PublicationStatus::kFailed}) {
      const std::string name = engine::PublicationStatusName(s);
      m->attempt_seconds_[name] = &attempts.Add({{"status", name}}, SecondsBuckets());
    }
    m->paused_family_ = &prometheus::BuildHistogram()
                             .Name(kEnginePausedSeconds)
                             .Help(
                                 "How long each rollout engine served nothing per publication "
                                 "(pause answered .. resume answered), by engine family and "
                                 "part: total, waiting (for wpub, before the first bucket), "
                                 "transfer, finalization (the engine's own end of the update)")
                             .Register(*registry);
    for (std::string_view family : engine::kEngineFamilies) {
      for (const char* part : {"total", "waiting", "transfer", "finalization"}) {
        m->paused_seconds_[std::string(family) + "/" + part] = &m->paused_family_->Add(
            {{"family", std::string(family)}, {"part", part}}, SecondsBuckets());
      }
    }
    auto& replays = prometheus::BuildCounter()
                        .Name(kReplaysTotal)
                        .Help(
                            "Replays of the retained committed version (restores of dirty "
                            "engines, catch-ups of engines and receivers behind), by outcome")
                        .Register(*registry);
    auto& replay_seconds = prometheus::BuildHistogram()
                               .Name(kReplaySeconds)
                               .Help("Wall clock of every completed replay, by kind")
                               .Register(*registry);
    for (auto k : {engine::ReplayKind::kRestore, engine::ReplayKind::kCatchUp}) {
      const std::string kind = engine::ReplayKindName(k);
      for (const char* outcome : {"completed", "failed", "preempted"}) {
        m->replays_[kind + "/" + outcome] = &replays.Add({{"kind", kind}, {"outcome", outcome}});
      }
      m->replay_seconds_[kind] = &replay_seconds.Add({{"kind", kind}}, SecondsBuckets());
    }
    m->receiver_failures_ = &prometheus::BuildCounter()
                                 .Name(kReceiverFailuresTotal)
                                 .Help(
                                     "Publications each receiver (engine) failed, by receiver "
                                     "(64 receivers at most; the rest as receiver=\"_other\")")
                                 .Register(*registry);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(std::string("metrics: registration failed: ") + e.what());
  }
  return m;
}

EngineMetrics::~EngineMetrics() = default;

void EngineMetrics::OnReport(const engine::PublicationReport& r) {
  std::lock_guard lock(mu_);
  publications_[engine::PublicationStatusName(r.status)]->Increment();
  host_syncs_total_->Increment(static_cast<double>(r.host_syncs));
  publication_host_syncs_->Set(static_cast<double>(r.host_syncs));
  attempt_seconds_[engine::PublicationStatusName(r.status)]->Observe(r.wall_seconds);
  for (const transport::ReceiverOutcome& o : r.receivers) {
    if (o.pause.paused && o.pause.resumed) {
      const std::pair<const char*, double> parts[] = {{"total", o.pause.seconds},
                                                      {"waiting", o.pause.waiting},
                                                      {"transfer", o.pause.transfer},
                                                      {"finalization", o.pause.finalization}};
      for (const auto& [part, seconds] : parts) {
        // Families are the rollout engines' (a bounded set): one not made up front is added.
        const std::string key = o.family + "/" + part;
        auto it = paused_seconds_.find(key);
        if (it == paused_seconds_.end()) {
          it = paused_seconds_
                   .emplace(key, &paused_family_->Add({{"family", o.family}, {"part", part}},
                                                      SecondsBuckets()))
                   .first;
        }
        it->second->Observe(seconds);
      }
    }
    if (o.failure == transport::ReceiverFailure::kNone) continue;
    failures_[transport::ReceiverFailureName(o.failure)]->Increment();
    auto it = receiver_failures_by_name_.find(o.name);
    if (it == receiver_failures_by_name_.end()) {
      const std::string label =
          receiver_failures_by_name_.size() < kMaxReceiverFailureSeries ? o.name : "_other";
      prometheus::Counter* c = &receiver_failures_->Add({{"receiver", label}});
      it = receiver_failures_by_name_.emplace(label == o.name ? o.name : "_other", c).first;
    }
    it->second->Increment();
  }
  if (r.status != engine::PublicationStatus::kCommitted) return;
  publication_seconds_->Observe(r.wall_seconds);
  for (const char* phase : engine::kPhaseNames) {
    phase_seconds_[phase]->Observe(engine::PhaseValue(r.phases, phase));
  }
  for (const auto& [format, bytes] : r.bytes_out_by_format) {
    auto it = published_bytes_by_format_.find(format);
    if (it == published_bytes_by_format_.end()) {
      // Formats are "nvfp4" and dtype names: a bounded set.
      it = published_bytes_by_format_.emplace(format, &published_bytes_->Add({{"format", format}}))
               .first;
    }
    it->second->Increment(static_cast<double>(bytes));
  }
  tensors_["quantized"]->Increment(static_cast<double>(r.tensors_quantized));
  tensors_["passthrough"]->Increment(static_cast<double>(r.tensors_passthrough));
  tensors_["ignored"]->Increment(static_cast<double>(r.tensors_ignored));
  last_committed_version_->Set(static_cast<double>(r.version));
  if (r.receivers.empty()) without_receivers_->Increment();
}

void EngineMetrics::OnState(const engine::EngineLiveState& state) {
  std::lock_guard lock(mu_);
  std::map<std::string, double> counts;
  for (const auto& [name, gauge] : engines_) counts[name] = 0;
  for (const transport::ReceiverInfo& r : state.receivers)
    counts[transport::ReceiverStateName(r.state)] += 1;
  for (const auto& [name, gauge] : engines_) gauge->Set(counts[name]);
  if (state.ignore_cache_hits > last_hits_) {
    cache_hits_->Increment(static_cast<double>(state.ignore_cache_hits - last_hits_));
    last_hits_ = state.ignore_cache_hits;
  }
  if (state.ignore_cache_misses > last_misses_) {
    cache_misses_->Increment(static_cast<double>(state.ignore_cache_misses - last_misses_));
    last_misses_ = state.ignore_cache_misses;
  }
}

void EngineMetrics::OnReplay(const engine::ReplayReport& report) {
  std::lock_guard lock(mu_);
  const std::string kind = engine::ReplayKindName(report.kind);
  const char* outcome = report.completed ? "completed" : report.preempted ? "preempted" : "failed";
  replays_.at(kind + "/" + outcome)->Increment();
  if (report.completed) replay_seconds_.at(kind)->Observe(report.seconds);
}

}  // namespace wpub::metrics
