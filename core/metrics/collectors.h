// Series computed when Prometheus scrapes, registered beside the registry on the metrics
// endpoint (server/wpubd/metrics_server.h):
//   ProcessCollector  the standard process_* series from /proc/self (Linux): CPU seconds,
//                     resident and virtual memory, open and maximum file descriptors, start time.
//   StatusCollector   the daemon's live state from engine::EngineStatus: the publication in
//                     flight (wpub_publication_in_flight, its version, age and bytes ingested
//                     and sent so far) and one series set per receiver or engine
//                     (wpub_receiver_last_committed_version{receiver},
//                     wpub_receiver_state{receiver,state}: 1 on its current state), bounded to
//                     kMaxReceiverSeries receivers in name order (wpub_receivers_unlisted counts
//                     the rest), so a fleet of receivers cannot grow the label set without bound.
// Thread-safe: Collect runs on scrape threads.
#pragma once

#include <functional>
#include <mutex>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "core/engine/types.h"

namespace wpub::metrics {

inline constexpr size_t kMaxReceiverSeries = 64;

class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

class StatusCollector final : public prometheus::Collectable {
 public:
  using StatusFn = std::function<engine::EngineStatus()>;
  explicit StatusCollector(StatusFn status) : status_(std::move(status)) {}
  // Stops reading the status (before what `status` reads is destroyed); Collect then
  // returns nothing. Waits for a Collect in progress.
  void Detach();
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  mutable std::mutex mu_;
  StatusFn status_;  // guarded by mu_
};

}  // namespace wpub::metrics
