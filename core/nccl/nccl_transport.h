// The NCCL side of a weight-update group, as rank 0: each bucket onto the group's communicator
// (nccl_comm.h) on a communication stream of the device's greatest priority, and the watchdog
// that aborts the communicator on an asynchronous NCCL error, a peer's failure or the
// publication's deadline (ncclCommAbort also terminates the broadcast kernels, so no host wait
// can hang). Who the peers are, how they join and what they are told is the rollout group's
// (core/rollout/rollout_group.h): this class knows buckets and a communicator only.
//
// Per bucket: a device bucket (transport::DeviceBytes) is broadcast from the producer's staging
// buffer after its `ready` event and `done` is recorded behind the broadcast; a host bucket is
// first copied into a device staging buffer of this transport (one uncounted wait per bucket
// for that buffer's previous broadcast). Nothing here synchronizes the device per bucket.
//
// Thread-safety: Fail, failure and Attach's abort of the old communicator are safe from any
// thread; the rest is called by the publication thread (or a group formation, which the
// rollout group serializes with publications).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/nccl/nccl_comm.h"
#include "core/transport/bucket.h"
#include "core/transport/group_channel.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::nccl {

struct NcclTransportOptions {
  int device = 0;
  absl::Duration watchdog_interval = absl::Milliseconds(2);
  // NcclCommOptions::ctas of every communicator Open makes (0: NCCL's choice).
  int ctas = 0;
};

class NcclTransport final : public transport::GroupChannel {
 public:
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options);
  // Stops the watchdog, aborts the communicator, waits for the comm stream.
  ~NcclTransport();
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // GroupChannel: ncclGetUniqueId; a nonblocking communicator as rank 0 on options.device with
  // options.ctas (its errors name ranks with `rank_name`); Attach(nullptr); the loaded NCCL.
  absl::StatusOr<transport::GroupId> NewId() override;
  absl::Status Open(int world_size, const transport::GroupId& id,
                    std::function<std::string(int rank)> rank_name) override;
  void Close() override { Attach(nullptr); }
  std::string Describe() const override;

  // Installs the communicator of a newly formed group (null: none); the previous one is aborted
  // and destroyed first.
  void Attach(std::unique_ptr<NcclComm> comm);
  // A communicator is installed and was not aborted.
  bool usable() const override;

  // Starts a publication: forgets the previous one's failure and starts the watchdog.
  void Begin(transport::PublicationWatch watch) override;
  // One bucket from rank 0 (see the file comment); waits for the communicator to be ready
  // before the first one, bounded by the deadline. ABORTED with the failure on any error (the
  // communicator is then aborted).
  // `chunks`: the byte sizes of the broadcasts the bucket is sent as, in order, summing to its
  // size (vLLM's packed chunks); empty: one broadcast of the whole bucket. INVALID_ARGUMENT
  // when they do not add up.
  absl::Status Send(const transport::Bucket& bucket, absl::Span<const uint64_t> chunks) override;
  // vLLM's communicators run a one-element float32 sum all-reduce right after init, and every
  // rank must match it before the first broadcast: waits (bounded by `deadline`) for the
  // communicator to become ready, runs that all-reduce and waits for it on the device (polled).
  // ABORTED / DEADLINE_EXCEEDED on failure (the communicator is then aborted).
  absl::Status WarmUp(absl::Time deadline) override;
  // Blocks until rank 0's side of every broadcast of the publication completed (polled: no
  // blocking device wait), the publication failed, or min(deadline, its deadline) passed.
  absl::Status WaitSent(absl::Time deadline) override;
  // Ends the publication: stops the watchdog. Idempotent.
  void End() override;

  // Records the first failure of the publication and aborts the communicator. Any thread.
  void Fail(absl::Status why) override;
  absl::Status failure() const override;

  cudaStream_t comm_stream() const { return comm_stream_.get(); }

  // Device time of the last publication's broadcasts, from events around each on the comm
  // stream (read once they completed, e.g. after WaitSent): busy[i] is broadcast i's kernel
  // (including any wait for the peers' receives), idle[i] the gap before it since the previous
  // one ended (the stream waiting for the bucket to be packed).
  struct BroadcastTiming {
    std::vector<double> busy, idle;
  };
  BroadcastTiming last_broadcast_timing() const;

 private:
  explicit NcclTransport(NcclTransportOptions options) : options_(options) {}
  void StartWatchdog();
  void StopWatchdog();
  absl::Status Broadcast(const void* data, uint64_t nbytes, cudaEvent_t ready, cudaEvent_t done,
                         uint32_t index, absl::Span<const uint64_t> chunks);
  absl::Status SendHost(const transport::Bucket& bucket, absl::Span<const uint64_t> chunks);

  const NcclTransportOptions options_;
  kernels::cuda::Stream comm_stream_;
  kernels::cuda::Event host_done_;            // the host staging buffer's last broadcast
  kernels::cuda::DeviceBuffer host_staging_;  // device copy of host buckets
  kernels::cuda::DeviceBuffer warmup_;        // WarmUp's one float
  // 2 per broadcast (start, end), grown on demand: last_broadcast_timing, and the last end event
  // is what WaitSent polls.
  std::vector<kernels::cuda::Event> bcast_events_;
  size_t bcast_count_ = 0;             // broadcasts of the current publication
  transport::PublicationWatch watch_;  // publication thread (the watchdog reads it while it runs)

  mutable std::mutex mu_;
  std::unique_ptr<NcclComm> comm_;  // guarded by mu_ for replacement; used by one thread
  absl::Status failure_;            // guarded by mu_
  std::condition_variable cv_;
  bool watchdog_stop_ = true;  // guarded by mu_
  std::thread watchdog_;
};

}  // namespace wpub::nccl
