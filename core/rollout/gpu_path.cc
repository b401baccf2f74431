// GPU path assembly: backend + rollout group (also the engine connector) + CUDA IPC cache.
#include "core/rollout/gpu_path.h"

#include "core/common/status.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/ipc_cache.h"
#include "core/gpu/retained_memory.h"
#include "core/rollout/family_router.h"
#include "core/rollout/ipc_channel.h"
#include "core/rollout/rollout_group.h"
#include "core/rollout/vllm_driver.h"

namespace wpub::rollout {

absl::StatusOr<engine::EngineComponents> MakeGpuPathComponents(const GpuPathOptions& options) {
  // One rollout group per engine family (its own TCPStore, communicator and protocol), and a
  // router that splits ConnectEngines between them (family_router.h). The SGLang group's store
  // takes store_port; the vLLM group's the next port (or an ephemeral one).
  std::vector<std::unique_ptr<RolloutGroup>> groups;
  // Colocated families read the buckets in place over CUDA IPC (ipc_channel.h): their group's
  // channel moves no bytes, and its TCPStore serves nobody.
  const std::string families[] = {"sglang", "vllm", std::string(kSglangIpcFamily),
                                  std::string(kVllmIpcFamily)};
  for (const std::string& family : families) {
    const bool colocated = engine::IsColocatedFamily(family);
    RolloutGroupOptions ro;
    ro.colocated = colocated;
    ro.device = options.device;
    ro.store.bind_address = options.store_bind_address;
    ro.store.port = options.store_port == 0 || colocated ? 0
                    : family == families[0]              ? options.store_port
                                            : static_cast<uint16_t>(options.store_port + 1);
    ro.advertise_address = options.advertise_address;
    for (const EngineSpec& e : options.engines) {
      if (e.family == family) ro.engines.push_back(e);
    }
    ro.group_name = options.group_name;
    ro.sglang.driver.request_timeout = options.request_timeout;
    ro.sglang.driver.requests_in_flight = options.requests_in_flight;
    ro.vllm.driver.request_timeout = options.request_timeout;
    ro.publication_deadline = options.publication_deadline;
    ro.nccl_ctas = options.nccl_ctas;
    ro.engine_auth_token = options.engine_auth_token;
    ro.pause = options.pause;
    ro.engine_watch_interval = options.engine_watch_interval;
    std::unique_ptr<RolloutGroup> group;
    if (colocated) {
      IpcChannelOptions io;
      io.device = options.device;
      // SGLang answers before its copies completed: torch's counters say when they did. vLLM's
      // packed consumer has copied (and synchronized) when it answers.
      io.release = family == kVllmIpcFamily ? IpcChannelOptions::Release::kAnswered
                                            : IpcChannelOptions::Release::kRefCounter;
      WPUB_ASSIGN_OR_RETURN(std::unique_ptr<IpcChannel> channel, IpcChannel::Create(io));
      WPUB_ASSIGN_OR_RETURN(group, RolloutGroup::Create(ro, std::move(channel)));
    } else {
      WPUB_ASSIGN_OR_RETURN(group, RolloutGroup::Create(ro));
    }
    groups.push_back(std::move(group));
  }
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
  if (options.retain == transport::RetainWhere::kDevice ||
      options.retain == transport::RetainWhere::kPinned) {
    WPUB_ASSIGN_OR_RETURN(c.retained_memory,
                          gpu::GpuRetainedMemory::Create({options.device, options.retain}));
  }
  c.cuda_ipc = std::move(ipc);
  c.backend = std::move(backend);
  std::vector<std::pair<std::string, FamilyConnector*>> members;
  for (size_t i = 0; i < groups.size(); ++i) members.emplace_back(families[i], groups[i].get());
  c.owned_connector = std::make_unique<FamilyRouter>(std::move(members));
  for (auto& g : groups) c.transports.push_back(std::move(g));  // owned by the engine
  return c;
}

}  // namespace wpub::rollout
