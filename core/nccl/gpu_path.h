// Assembles the GPU publication path for the engine: the GPU backend whose device buckets go
// to the NCCL weight-update group, as engine::EngineComponents. What wpubd calls when it is
// given engines; tests and benchmarks build the same pieces directly.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engines/sglang_driver.h"

namespace wpub::nccl {

struct GpuPathOptions {
  int device = 0;
  std::vector<engines::EngineSpec> engines;  // see ParseEngineSpecs
  std::string group_name = "wpub_weights";
  std::string store_bind_address = "0.0.0.0";
  uint16_t store_port = 0;  // 0: ephemeral
  std::string advertise_address = "127.0.0.1";
  absl::Duration request_timeout = absl::Seconds(120);
  absl::Duration publication_deadline = absl::Seconds(120);
  bool reject_non_finite_before_send = true;
};

// "http://host:30000=2,http://other:30000" -> engines (GPU count after '=', default 1).
// INVALID_ARGUMENT naming the entry for an empty URL or a GPU count that is not a positive
// integer.
absl::StatusOr<std::vector<engines::EngineSpec>> ParseEngineSpecs(absl::string_view text);

// The GPU backend on options.device with the NCCL transport as its sink and as the engine's
// extra transport, and the CUDA IPC mapping cache as its resolver of trainer memory.
// FAILED_PRECONDITION without that CUDA device.
absl::StatusOr<engine::EngineComponents> MakeGpuPathComponents(const GpuPathOptions& options);

}  // namespace wpub::nccl
