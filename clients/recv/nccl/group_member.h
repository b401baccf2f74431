// The receiving side of a weight-update group, for a C++ receiver (wpub-recv's NCCL data
// path): joins exactly as an SGLang engine does -- a TCPStore client to the publisher's
// rendezvous (torch's wire format: VALIDATE, PING, ADD "init/"), the ncclUniqueId read under
// the key ProcessGroupNCCL would read, a nonblocking communicator as rank `rank` -- or as a vLLM
// worker does (Rendezvous::kVllm: the pickled id StatelessProcessGroup broadcasts, read at
// rollout::kVllmUniqueIdKey; the caller then runs the warm-up all-reduce, WarmUp), and then
// receives each bucket with broadcasts from rank 0 (one, or vLLM's packed chunks).
//
// Thread-compatible: one owner thread. Receive only enqueues (the caller waits on its stream);
// Abort may be called from any thread (NcclComm's contract).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/nccl/nccl_comm.h"
#include "core/rendezvous/tcp_store_server.h"

namespace wpub::recv::nccl {

enum class Rendezvous { kSglang, kVllm };

struct GroupMemberOptions {
  Rendezvous rendezvous = Rendezvous::kSglang;
  std::string master_address = "127.0.0.1";
  uint16_t master_port = 0;
  std::string group_name;
  int rank = 1;
  int world_size = 2;
  int device = 0;
  // Tried in order; the first key present wins (see rollout::RolloutGroupOptions). kSglang only.
  std::vector<std::string> unique_id_key_templates = {
      std::string(rendezvous::kDefaultUniqueIdKeyTemplate), "/{group}/{group}/{index}"};
  absl::Duration timeout = absl::Seconds(120);  // store connect + id lookup + NCCL init
  int ctas = 0;                                 // NcclCommOptions::ctas (0: NCCL's choice)
};

// Reads the ncclUniqueId of `options.group_name` from the store (the first template whose key
// appears before the timeout; kVllm: the pickle at rollout::kVllmUniqueIdKey).
// DEADLINE_EXCEEDED naming every key tried; INVALID_ARGUMENT for a value that is not 128 bytes
// (or not vLLM's pickle of them).
absl::StatusOr<wpub::nccl::UniqueId> FetchUniqueId(const GroupMemberOptions& options);

class GroupMember {
 public:
  // Fetches the id and starts the communicator; does not wait for the other ranks.
  static absl::StatusOr<std::unique_ptr<GroupMember>> Join(const GroupMemberOptions& options);

  // Waits (polling, bounded by the join timeout) until every rank joined.
  absl::Status WaitReady();
  // Enqueues the receive of one bucket into `device_buffer` on `stream`: one broadcast per
  // chunk (byte sizes, back to back; empty chunks are skipped, as no publisher sends them).
  absl::Status Receive(void* device_buffer, absl::Span<const uint64_t> chunks, cudaStream_t stream);
  // Enqueues vLLM's warm-up: a one-element float32 sum all-reduce of `device_float` (zeroed
  // first) on `stream`.
  absl::Status WarmUp(float* device_float, cudaStream_t stream);
  void Abort() { comm_->Abort(); }
  // NcclComm::AsyncError: OK while healthy; any thread.
  absl::Status AsyncError() { return comm_->AsyncError(); }
  const GroupMemberOptions& options() const { return options_; }

 private:
  GroupMember(GroupMemberOptions options, std::unique_ptr<wpub::nccl::NcclComm> comm,
              absl::Time deadline)
      : options_(std::move(options)), comm_(std::move(comm)), deadline_(deadline) {}
  GroupMemberOptions options_;
  std::unique_ptr<wpub::nccl::NcclComm> comm_;
  absl::Time deadline_;
};

}  // namespace wpub::recv::nccl
