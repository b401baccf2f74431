// The bytes' side of a rollout group whose engines run on this node and read the buckets in
// wpub's own device memory (colocated engines; docs/specs/engines.md, "Colocated engines"): a
// transport::GroupChannel that moves no bytes. Each bucket is shared (Share) as torch shares a
// CUDA tensor -- the staging allocation's cudaIpcMemHandle, an interprocess event recorded on the
// channel's stream once the producer's `ready` completed (receivers' streams wait on it, so the
// host never waits), and one slot per engine rank in a TorchRefCounters file; the engine's update
// request carries that description (the driver's PostBucket) and each rank copies the bucket into
// its weights. A bucket is released -- its `done` recorded, so the producer may reuse the staging
// buffer -- only once every rank's slot is back at 0: torch decrements it when the rank freed the
// tensor, after synchronizing its stream. Send of bucket k releases every earlier bucket (the
// producer reuses bucket k-1's buffer for k+1 right after) and returns: the engines copy bucket k
// while bucket k+1 is packed. WaitSent releases the last.
//
// Failure: a peer failure (an engine's HTTP answer: watch.peer_failure), the deadline or Fail
// ends the waits with the publication's failure; the buckets still held are then released on
// the device at once (an engine that failed mid-copy is dirty: the rollout group keeps it paused
// until a whole version reached it). A failed channel is no longer usable(), as an aborted NCCL
// group: the rollout group re-forms before the next publication, leaving out engines that do
// not answer their health check (one killed mid-handover).
//
// Thread-safety as GroupChannel: Fail/failure/usable from any thread, the rest from the
// publication thread.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/rollout/torch_ipc.h"
#include "core/transport/group_channel.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::rollout {

struct IpcChannelOptions {
  int device = 0;
  // How often a wait for the engines' release polls their reference counters and the peers.
  absl::Duration poll_interval = absl::Microseconds(50);
  // When a bucket is released: once every rank freed the tensor (torch's reference counter:
  // SGLang, which answers before its copies completed), or once every engine answered the
  // bucket's request (vLLM's packed IPC consumer clones every tensor and synchronizes the
  // device before it answers, and keeps its mapping until the next bucket arrives).
  enum class Release : uint8_t { kRefCounter, kAnswered };
  Release release = Release::kRefCounter;
};

class IpcChannel final : public transport::GroupChannel {
 public:
  // FAILED_PRECONDITION without the device; INTERNAL when the reference-counter file or the
  // stream cannot be made.
  static absl::StatusOr<std::unique_ptr<IpcChannel>> Create(const IpcChannelOptions& options);
  ~IpcChannel() override;

  absl::StatusOr<transport::GroupId> NewId() override;
  // Every rank but rank 0 reads each bucket: world_size - 1 slots per bucket.
  absl::Status Open(int world_size, const transport::GroupId& id,
                    std::function<std::string(int rank)> rank_name) override;
  void Close() override;
  bool usable() const override { return open_.load(); }
  std::string Describe() const override;
  absl::Status WarmUp(absl::Time /*deadline*/) override { return absl::OkStatus(); }
  void Begin(transport::PublicationWatch watch) override;
  // FAILED_PRECONDITION for a host bucket (colocated engines need the GPU path's device
  // buckets); INTERNAL naming the CUDA call that failed.
  absl::StatusOr<std::optional<transport::SharedDeviceBytes>> Share(
      const transport::Bucket& bucket) override;
  absl::Status Send(const transport::Bucket& bucket, absl::Span<const uint64_t> chunks) override;
  absl::Status WaitSent(absl::Time deadline) override;
  void End() override;
  void Fail(absl::Status why) override;
  absl::Status failure() const override;

 private:
  static constexpr size_t kEvents = 8;  // buckets shared at once (two are ever held)
  struct Held {
    uint64_t first_slot = 0;
    int slots = 0;
    cudaEvent_t done = nullptr;
    uint32_t index = 0;
    uint64_t seq = 0;  // its place among the publication's update requests
  };
  IpcChannel(const IpcChannelOptions& options, std::string uuid,
             std::unique_ptr<TorchRefCounters> counters);
  // Waits until every rank released `h` (its slots at 0), or the publication failed.
  absl::Status WaitReleased(const Held& h, absl::Time deadline);
  // Records `done` of every held bucket (after a failure: the producer may reuse them).
  void DropHeld();

  const IpcChannelOptions options_;
  const std::string uuid_;  // "GPU-..."
  std::unique_ptr<TorchRefCounters> counters_;
  kernels::cuda::Stream stream_;
  std::array<cudaEvent_t, kEvents> events_{};  // interprocess
  std::atomic<bool> open_{false};
  int readers_ = 0;                      // ranks that read each bucket
  uint64_t next_slot_ = 0;               // the first counter slot of the next shared bucket
  uint64_t shared_ = 0;                  // buckets shared so far (event ring position)
  uint64_t seq_ = 0;                     // buckets shared in the publication in flight
  std::vector<std::string> node_uuids_;  // every visible GPU's
  std::optional<Held> pending_;          // shared, not yet sent
  std::deque<Held> held_;                // shared and sent, not yet released
  transport::PublicationWatch watch_;
  mutable std::mutex mu_;
  absl::Status failure_;  // guarded by mu_
};

}  // namespace wpub::rollout
