// The NCCL data path of the C++ vLLM-protocol engine (recv::VllmEngine): joins the publisher's
// group as vLLM's workers do (Rendezvous::kVllm: the pickled id, then the warm-up all-reduce on
// every rank) and receives each /update_weights as its chunks, over a BucketReceiver with one
// rank per device and copies to the host (the engine keeps the weights it applies). Thread-safe
// as BucketReceiver; Abort leaves the group, ending a receive in progress.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "clients/recv/nccl/bucket_receiver.h"
#include "clients/recv/vllm_engine.h"

namespace wpub::recv::nccl {

class VllmNcclPath final : public recv::VllmDataPath {
 public:
  // `options.copy_to_host` is forced on. Errors as BucketReceiver::Create's.
  static absl::StatusOr<std::unique_ptr<VllmNcclPath>> Create(ReceiverEndpointOptions options);

  absl::Status Join(const recv::VllmInitInfo& init) override;
  absl::Status Receive(const recv::VllmUpdate& update, std::vector<uint8_t>* bytes) override;
  void Abort() override { receiver_->Destroy(); }

 private:
  explicit VllmNcclPath(std::unique_ptr<BucketReceiver> r) : receiver_(std::move(r)) {}
  const std::unique_ptr<BucketReceiver> receiver_;
};

}  // namespace wpub::recv::nccl
