// The receive path of a ReceiverEndpoint, without HTTP: the engine's membership of one
// weight-update group (one GroupMember per GPU, as the TP ranks of an SGLang engine join), the
// order of update requests, the receive of each flattened bucket on every GPU and its
// verification, and the per-version ReceiverVersionStats. receiver_endpoint.cc maps the routes
// onto it; the contract below is the one receiver_endpoint.h states for the routes.
//
// Threading: every method is thread-safe and may run on any thread (HTTP handler threads).
// Receives are posted one bucket at a time under one lock, in request order: a request with
// `wpub_sequence` waits for its turn (sequence 0 starts a publication; k + 1 follows k, as NCCL
// matches broadcasts by order). Nothing blocks in CUDA: receives are awaited by polling the
// stream or event, the members' asynchronous errors, Stop and receive_timeout. A failure on any
// rank aborts every member and leaves the group. Join and Destroy first abort a receive still
// blocked on the old group; the waiters of a group that changed end with ABORTED.
//
// With keep_weights every bucket is received into the engine's own copy of it (one buffer per
// bucket index -- the request's wpub_sequence, required -- per GPU, kept across versions as an
// engine keeps its parameters) and checksummed there under the lock; an update request with
// `wpub_patch` (core/rollout/update_request.h) brings a format 3 patch instead, applied to that
// copy on every GPU (kernels/cuda/bucket_diff.h) when the copy's checksum is the patch's base --
// restored when the result is not the target -- and refused (its broadcast still taken)
// otherwise.
//
// With copy_to_host, rank 0 copies every bucket back and checksums it on the host (the other
// ranks on their devices) before the next bucket is posted, and on_bucket runs under the lock.
// Without it the path is pipelined two deep (DeviceRank's two slots): a bucket's receives and
// checksums are enqueued under the lock, the next request may post right behind them, and the
// checksums are awaited without it; on_bucket then runs without the lock and possibly out of
// order, while the version's stats keep bucket order.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "clients/recv/nccl/device_rank.h"
#include "clients/recv/nccl/group_member.h"
#include "clients/recv/nccl/receiver_endpoint.h"

namespace wpub::recv::nccl {

class BucketReceiver {
 public:
  using OnBucket = std::function<void(const ReceivedBucket&)>;  // may be empty

  // One DeviceRank per options.devices entry. INVALID_ARGUMENT without devices;
  // FAILED_PRECONDITION naming an unusable device.
  static absl::StatusOr<std::unique_ptr<BucketReceiver>> Create(
      const ReceiverEndpointOptions& options, OnBucket on_bucket);
  // Stop()s, then releases the members and every device's resources.
  ~BucketReceiver();
  BucketReceiver(const BucketReceiver&) = delete;
  BucketReceiver& operator=(const BucketReceiver&) = delete;

  // Ends every call blocked in a receive or waiting for its turn or a slot (UNAVAILABLE or
  // ABORTED) and refuses new updates. Idempotent; the endpoint calls it before stopping its
  // server, which joins the handlers.
  void Stop();

  // /init_weights_update_group: leaves the current group (aborting a receive still blocked on
  // it) and joins `group` with one rank per device, rank_offset + i on device i (group.rank and
  // group.device are set here). Every rank's communicator init is started before any is
  // awaited. The join timeout and channel count come from the options. With vLLM's rendezvous
  // it returns once every rank ran the warm-up all-reduce.
  absl::Status Join(GroupMemberOptions group, int rank_offset);
  // /destroy_weights_update_group: aborts the members and leaves the group.
  void Destroy();

  // /update_weights_from_distributed: decodes `body` (core/rollout/update_request.h), receives
  // the bucket on every device, verifies it and calls on_bucket. Returns the route's message.
  // FAILED_PRECONDITION outside a group or for a request naming another group, ABORTED when the
  // group changed while it waited, DEADLINE_EXCEEDED after receive_timeout, DATA_LOSS when the
  // devices' checksums differ; a receive that failed leaves the group.
  absl::StatusOr<std::string> Update(const std::string& body);
  // A bucket already decoded (vLLM's /update_weights, clients/recv/vllm_engine.h): `tensors`
  // back to back over `nbytes`, carried by the broadcasts `chunks` (summing to nbytes), received
  // on every device and verified as Update does, in arrival order. Needs copy_to_host (the bytes
  // come back in the result). Errors as Update's.
  absl::StatusOr<ReceivedBucket> ReceiveChunks(std::string version,
                                               std::vector<transport::ManifestTensor> tensors,
                                               uint64_t nbytes, std::vector<uint64_t> chunks);
  // /receive_raw: `count` broadcasts of `nbytes` back to back, no decoding, no checksum.
  absl::StatusOr<std::string> ReceiveRaw(uint64_t nbytes, uint64_t count);

  std::map<std::string, ReceiverVersionStats> stats() const;
  size_t ranks() const { return ranks_.size(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct ParsedUpdate;
  struct Advance;
  // Runs fn(rank index, others failed) for every rank, each on a thread of its own.
  using RankFn = absl::FunctionRef<absl::Status(size_t, const std::atomic<bool>&)>;

  BucketReceiver(ReceiverEndpointOptions options, OnBucket on_bucket)
      : options_(std::move(options)), on_bucket_(std::move(on_bucket)) {}

  void Leave();
  void AbortAll();
  absl::Status AwaitTurn(const std::string& version, int64_t sequence,
                         std::unique_lock<std::mutex>& lock);
  absl::Status ReserveAll(uint64_t n, std::unique_lock<std::mutex>& lock,
                          Clock::time_point deadline);
  absl::Status AwaitSlot(int slot, std::unique_lock<std::mutex>& lock, Clock::time_point deadline);
  absl::Status Poll(absl::FunctionRef<cudaError_t()> query, int device, GroupMember& member,
                    const std::atomic<bool>* others_failed, Clock::time_point deadline);
  absl::Status WaitRank(size_t i, const std::atomic<bool>& others_failed,
                        Clock::time_point deadline);
  absl::Status OnEveryRank(RankFn fn);
  absl::Status ReceiveOnRank(size_t i, absl::Span<const uint64_t> chunks, uint64_t n,
                             std::vector<uint8_t>* bytes, uint64_t* checksum,
                             const std::atomic<bool>& failed, Clock::time_point deadline);
  // Update and ReceiveChunks after decoding: the turn, the reservation, one receive path.
  absl::StatusOr<std::string> ReceiveParsed(ParsedUpdate& update);
  // The two receive paths of Update (mu_ held on entry; ReceivePipelined releases it).
  absl::StatusOr<std::string> ReceiveCopied(ParsedUpdate& update, Clock::time_point deadline);
  absl::StatusOr<std::string> ReceiveKept(ParsedUpdate& update, Clock::time_point deadline);
  absl::StatusOr<std::string> ReceivePipelined(ParsedUpdate& update, Advance& advance,
                                               std::unique_lock<std::mutex>& lock,
                                               Clock::time_point deadline);

  const ReceiverEndpointOptions options_;
  const OnBucket on_bucket_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  // One per device, never resized after Create. A rank's resources are used under mu_, except
  // a pipelined bucket's slot, which only its own request touches once it posted.
  std::vector<std::unique_ptr<DeviceRank>> ranks_;
  // members_[i] is device i's rank of the group (null outside one). Replaced only with both mu_
  // and members_mu_ held; receives are enqueued under mu_, aborts take members_mu_ alone (an
  // abort never waits for a receive in progress), and a verification outside mu_ holds its own
  // references.
  std::mutex members_mu_;  // after mu_ when both are taken
  std::vector<std::shared_ptr<GroupMember>> members_;
  bool joined_ = false;                                // guarded by mu_
  std::string group_name_;                             // guarded by mu_
  std::map<std::string, ReceiverVersionStats> stats_;  // guarded by mu_
  std::condition_variable turn_;                       // next_sequence_ advanced
  std::string sequence_version_;                       // guarded by mu_
  int64_t next_sequence_ = 0;                          // guarded by mu_
  uint64_t group_epoch_ = 0;  // guarded by mu_: bumped by join/destroy, ends stale waiters
  int next_slot_ = 0;         // guarded by mu_: the slot of the next pipelined bucket
  bool slot_busy_[DeviceRank::kSlots] = {false, false};  // guarded by mu_: being verified
  std::condition_variable slot_free_;                    // a slot's verification finished
  // Kept weights: by bucket index, the checksum of the bucket every rank holds (verified when
  // it was received or patched); nullopt while it is being written or after a failed restore.
  std::vector<std::optional<uint64_t>> kept_sums_;  // guarded by mu_
};

}  // namespace wpub::recv::nccl
