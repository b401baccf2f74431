// What the engine tells whoever watches it. The engine knows nothing of Prometheus: the daemon's
// metrics (core/metrics' EngineMetrics) implement this interface and are handed to
// Engine::Create, so the dependency runs one way, metrics -> engine.
#pragma once

#include <cstdint>
#include <vector>

#include "core/engine/types.h"
#include "core/transport/types.h"

namespace wpub::engine {

// The engine's live state, as the observer is shown it.
struct EngineLiveState {
  // The policy cache's monotonic totals since the engine started.
  uint64_t ignore_cache_hits = 0;
  uint64_t ignore_cache_misses = 0;
  // Every connected receiver of every transport.
  std::vector<transport::ReceiverInfo> receivers;
};

// Thread-safety: both methods may be called from any of the engine's threads, concurrently with
// each other; an implementation synchronizes itself. Neither may call back into the engine.
// Lifetime: the observer outlives the Engine and every session of it (a session that outlives
// the Engine still reports its end).
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // Once per ended publication (committed, aborted or failed), after the engine recorded it.
  virtual void OnReport(const PublicationReport& report) = 0;
  // After each report and every 500 ms between them, so receivers that connect or leave between
  // publications are seen.
  virtual void OnState(const EngineLiveState& state) = 0;
  // Once per replay of the retained version that ran (restore or catch-up), completed or not.
  virtual void OnReplay(const ReplayReport& report) { (void)report; }
};

}  // namespace wpub::engine
