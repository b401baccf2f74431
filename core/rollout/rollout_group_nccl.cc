// RolloutGroup::Create over NCCL (rollout_group.h): the group's channel is an
// nccl::NcclTransport. In the NCCL build only (wpub::rollout_group).
#include "core/common/status.h"
#include "core/nccl/nccl_comm.h"
#include "core/nccl/nccl_transport.h"
#include "core/rollout/rollout_group.h"

namespace wpub::rollout {

absl::StatusOr<std::unique_ptr<RolloutGroup>> RolloutGroup::Create(
    const RolloutGroupOptions& options) {
  WPUB_RETURN_IF_ERROR(nccl::CheckCtas(options.nccl_ctas, "rollout group: nccl_ctas"));
  nccl::NcclTransportOptions no;
  no.device = options.device;
  no.watchdog_interval = options.watchdog_interval;
  no.ctas = options.nccl_ctas;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<nccl::NcclTransport> channel,
                        nccl::NcclTransport::Create(no));
  return Create(options, std::move(channel));
}

}  // namespace wpub::rollout
