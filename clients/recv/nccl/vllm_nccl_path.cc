// VllmNcclPath: recv::VllmDataPath over a BucketReceiver.
#include "clients/recv/nccl/vllm_nccl_path.h"

#include "core/common/status.h"

namespace wpub::recv::nccl {

absl::StatusOr<std::unique_ptr<VllmNcclPath>> VllmNcclPath::Create(
    ReceiverEndpointOptions options) {
  options.copy_to_host = true;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<BucketReceiver> r,
                        BucketReceiver::Create(options, /*on_bucket=*/nullptr));
  return std::unique_ptr<VllmNcclPath>(new VllmNcclPath(std::move(r)));
}

absl::Status VllmNcclPath::Join(const recv::VllmInitInfo& init) {
  GroupMemberOptions g;
  g.rendezvous = Rendezvous::kVllm;
  g.master_address = init.master_address;
  g.master_port = static_cast<uint16_t>(init.master_port);
  g.world_size = init.world_size;
  return receiver_->Join(std::move(g), init.rank_offset);
}

absl::Status VllmNcclPath::Receive(const recv::VllmUpdate& update, std::vector<uint8_t>* bytes) {
  WPUB_ASSIGN_OR_RETURN(ReceivedBucket b,
                        receiver_->ReceiveChunks("", update.tensors, update.nbytes, update.chunks));
  *bytes = std::move(b.bytes);
  return absl::OkStatus();
}

}  // namespace wpub::recv::nccl
