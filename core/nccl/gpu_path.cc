// GPU path assembly: backend + NCCL transport (also the engine connector) as EngineComponents.
#include "core/nccl/gpu_path.h"

#include "core/common/status.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/ipc_cache.h"
#include "core/nccl/nccl_transport.h"

namespace wpub::nccl {

absl::StatusOr<engine::EngineComponents> MakeGpuPathComponents(const GpuPathOptions& options) {
  NcclTransportOptions to;
  to.device = options.device;
  to.store.bind_address = options.store_bind_address;
  to.store.port = options.store_port;
  to.advertise_address = options.advertise_address;
  to.sglang.engines = options.engines;
  to.sglang.group_name = options.group_name;
  to.sglang.request_timeout = options.request_timeout;
  to.sglang.requests_in_flight = options.requests_in_flight;
  to.publication_deadline = options.publication_deadline;
  to.nccl_ctas = options.nccl_ctas;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<NcclTransport> transport, NcclTransport::Create(to));
  gpu::GpuBackendOptions bo;
  bo.device = options.device;
  bo.sink = transport.get();
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
  c.connector = transport.get();  // owned by c.transports below
  c.transports.push_back(std::move(transport));
  return c;
}

}  // namespace wpub::nccl
