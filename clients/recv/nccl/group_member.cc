// GroupMember: torch-compatible store handshake, unique-id lookup over the key templates,
// nonblocking communicator as a receiving rank.
#include "clients/recv/nccl/group_member.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/recv/vllm_engine.h"
#include "core/common/status.h"
#include "core/rendezvous/tcp_store_client.h"
#include "core/rollout/vllm_driver.h"

namespace wpub::recv::nccl {

absl::StatusOr<wpub::nccl::UniqueId> FetchUniqueId(const GroupMemberOptions& options) {
  if (options.unique_id_key_templates.empty()) {
    return absl::InvalidArgumentError("no unique-id key template");
  }
  const bool vllm = options.rendezvous == Rendezvous::kVllm;
  std::vector<std::string> keys;
  if (vllm) keys.push_back(rollout::kVllmUniqueIdKey);
  for (const std::string& t : options.unique_id_key_templates) {
    if (vllm) break;
    WPUB_ASSIGN_OR_RETURN(std::string key, rendezvous::UniqueIdKey(t, options.group_name, 0));
    keys.push_back(std::move(key));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  rendezvous::TcpStoreClientOptions co;
  co.host = options.master_address;
  co.port = options.master_port;
  co.timeout = options.timeout;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<rendezvous::TcpStoreClient> client,
                        rendezvous::TcpStoreClient::Connect(co));
  // CHECK every candidate until one exists (torch itself would WAIT on its one key).
  for (;;) {
    for (const std::string& key : keys) {
      WPUB_ASSIGN_OR_RETURN(bool present, client->Check({key}));
      if (!present) continue;
      WPUB_ASSIGN_OR_RETURN(std::vector<uint8_t> value, client->Get(key));
      if (vllm) {
        absl::StatusOr<std::vector<uint8_t>> id = recv::DecodeVllmUniqueIdPickle(
            std::string_view(reinterpret_cast<const char*>(value.data()), value.size()));
        if (!id.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("TCPStore key ", key, ": ", id.status().message()));
        }
        value = *std::move(id);
      }
      if (value.size() != sizeof(wpub::nccl::UniqueId)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TCPStore key ", key, " holds ", value.size(), " bytes, not an ncclUniqueId"));
      }
      wpub::nccl::UniqueId id;
      std::copy(value.begin(), value.end(), id.begin());
      return id;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no ncclUniqueId for group ", options.group_name, " within ",
          absl::FormatDuration(options.timeout), " under any of: ", absl::StrJoin(keys, ", ")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::StatusOr<std::unique_ptr<GroupMember>> GroupMember::Join(const GroupMemberOptions& options) {
  if (options.rank < 1 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("a receiving rank must be in [1, ",
                                                   options.world_size, "), not ", options.rank));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  WPUB_ASSIGN_OR_RETURN(wpub::nccl::UniqueId id, FetchUniqueId(options));
  wpub::nccl::NcclCommOptions co;
  co.device = options.device;
  co.nranks = options.world_size;
  co.rank = options.rank;
  co.id = id;
  co.ctas = options.ctas;
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<wpub::nccl::NcclComm> comm,
                        wpub::nccl::NcclComm::Create(co));
  return std::unique_ptr<GroupMember>(new GroupMember(options, std::move(comm), deadline));
}

absl::Status GroupMember::WaitReady() { return comm_->WaitReady(deadline_, nullptr); }

absl::Status GroupMember::Receive(void* device_buffer, absl::Span<const uint64_t> chunks,
                                  cudaStream_t stream) {
  WPUB_RETURN_IF_ERROR(WaitReady());
  uint64_t at = 0;
  for (const uint64_t n : chunks) {
    if (n == 0) continue;
    WPUB_RETURN_IF_ERROR(
        comm_->Broadcast(static_cast<uint8_t*>(device_buffer) + at, n, /*root=*/0, stream));
    at += n;
  }
  return absl::OkStatus();
}

absl::Status GroupMember::WarmUp(float* device_float, cudaStream_t stream) {
  WPUB_RETURN_IF_ERROR(WaitReady());
  if (const cudaError_t e = cudaMemsetAsync(device_float, 0, sizeof(float), stream);
      e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("warm-up: ", cudaGetErrorString(e)));
  }
  return comm_->AllReduceSumFloat(device_float, 1, stream);
}

}  // namespace wpub::recv::nccl
