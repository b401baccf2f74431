// The rollout group options the multi-GPU tests and benchmarks publish with: the TCPStore on
// loopback, the given engines, group name and update requests in flight, and one deadline for
// every request and for the whole publication.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "core/rollout/rollout_group.h"

namespace wpub::testing {

inline rollout::RolloutGroupOptions LoopbackTransportOptions(
    std::vector<rollout::EngineSpec> engines, std::string group, int in_flight,
    absl::Duration deadline) {
  rollout::RolloutGroupOptions o;
  o.store.bind_address = "127.0.0.1";
  o.advertise_address = "127.0.0.1";
  o.engines = std::move(engines);
  o.group_name = std::move(group);
  o.sglang.driver.requests_in_flight = in_flight;
  o.sglang.driver.request_timeout = deadline;
  o.publication_deadline = deadline;
  return o;
}

}  // namespace wpub::testing
