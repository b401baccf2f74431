// Assembles the GPU publication path for the engine: the GPU backend (device buckets), the
// rollout group (the engines' weight-update group: their transport and the RolloutConnector) and
// the CUDA IPC mapping cache, as engine::EngineComponents. What wpubd calls when it is
// given engines; tests and benchmarks build the same pieces directly.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/rollout/engine_driver.h"
#include "core/transport/types.h"

namespace wpub::rollout {

// Declared once: wpubd's GPU-path flags take their defaults from these (server/wpubd/options.cc)
// and DaemonOptions embeds them.
struct GpuPathOptions {
  int device = 0;
  // The initial engine set (see ParseEngineSpecs); empty: none until ConnectEngines.
  std::vector<EngineSpec> engines;
  std::string group_name = "wpub_weights";
  std::string store_bind_address = "0.0.0.0";
  uint16_t store_port = 0;  // 0: ephemeral
  std::string advertise_address = "127.0.0.1";
  absl::Duration request_timeout = absl::Seconds(120);
  absl::Duration publication_deadline = absl::Seconds(120);
  bool reject_non_finite_before_send = true;
  int requests_in_flight = 1;     // SglangDriverOptions::requests_in_flight
  int compute_sms = 0;            // gpu::GpuBackendOptions::compute_sms (0: every SM)
  int overlap_ctas_per_sm = 3;    // gpu::GpuBackendOptions::overlap_ctas_per_sm (0: no cap)
  int nccl_ctas = 0;              // RolloutGroupOptions::nccl_ctas (0: NCCL's choice)
  std::string engine_auth_token;  // RolloutGroupOptions::engine_auth_token ("": none)
  engine::PausePolicy pause;      // RolloutGroupOptions::pause (wpubd --pause)
  // RolloutGroupOptions::engine_watch_interval (wpubd --engine_watch_interval; zero: none).
  absl::Duration engine_watch_interval = absl::Seconds(10);
  // Where the retained copy lives (wpubd --retain): kDevice / kPinned make the components carry
  // the GPU memory for it (core/gpu/retained_memory.h); kOff / kHost need none.
  transport::RetainWhere retain = transport::RetainWhere::kOff;
};

// The GPU backend on options.device, the rollout group as the engine's extra transport and as
// its RolloutConnector (ConnectEngines), and the CUDA IPC mapping cache as its resolver of
// trainer memory.
// FAILED_PRECONDITION without that CUDA device.
absl::StatusOr<engine::EngineComponents> MakeGpuPathComponents(const GpuPathOptions& options);

}  // namespace wpub::rollout
