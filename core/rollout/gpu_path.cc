// GPU path assembly: backend + rollout group (also the engine connector) + CUDA IPC cache.
#include "core/rollout/gpu_path.h"

#include "core/common/status.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/ipc_cache.h"
#include "core/rollout/rollout_group.h"

namespace wpub::rollout {

absl::StatusOr<engine::EngineComponents> MakeGpuPathComponents(const GpuPathOptions& options) {
  RolloutGroupOptions ro;
  ro.device = options.device;
  ro.store.bind_address = options.store_bind_address;
  ro.store.port = options.store_port;
  ro.advertise_address = options.advertise_address;
  ro.engines = options.engines;
  ro.group_name = options.group_name;
  ro.sglang.driver.request_timeout = options.request_timeout;
  ro.sglang.driver.requests_in_flight = options.requests_in_flight;
  ro.publication_deadline = options.publication_deadline;
  ro.nccl_ctas = options.nccl_ctas;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<RolloutGroup> group, RolloutGroup::Create(ro));
  gpu::GpuBackendOptions bo;
  bo.device = options.device;
  bo.reject_before_send = options.reject_non_finite_before_send;
  bo.compute_sms = options.compute_sms;
  bo.overlap_ctas_per_sm = options.overlap_ctas_per_sm;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<gpu::GpuBackend> backend, gpu::GpuBackend::Create(bo));
  gpu::IpcCacheOptions io;
  io.device = options.device;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<gpu::IpcCache> ipc, gpu::IpcCache::Create(io));
  engine::EngineComponents c;
  c.cuda_ipc = std::move(ipc);
  c.backend = std::move(backend);
  c.connector = group.get();  // owned by c.transports below
  c.transports.push_back(std::move(group));
  return c;
}

}  // namespace wpub::rollout
