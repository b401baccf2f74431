// The CPU backend: quantizes with the kernels' CPU reference (kernels/reference.h, the oracle
// the CUDA kernels match byte for byte), packs buckets in host memory and emits them one after
// another. No device, so no host synchronizations are counted.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "core/engine/backend.h"

namespace wpub::engine {

struct CpuBackendOptions {
  // Threads per kernel call (kernels::CpuOptions::num_threads; 0 = hardware concurrency).
  int num_threads = 1;
};

class CpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const CpuBackendOptions& options);

  std::string_view name() const override { return "cpu"; }
  absl::StatusOr<ExecutionResult> Execute(const ExecutionPlan& plan,
                                          const ExecutionHooks& hooks) override;

 private:
  explicit CpuBackend(const CpuBackendOptions& options) : options_(options) {}
  CpuBackendOptions options_;
};

}  // namespace wpub::engine
