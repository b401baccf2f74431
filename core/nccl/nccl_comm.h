// RAII owner of one nonblocking NCCL communicator (ncclConfig_t.blocking = 0): init returns at
// once and is completed by polling ncclCommGetAsyncError, collectives never block the host,
// and the communicator can always be torn down with ncclCommAbort (which also terminates its
// kernels still running on the device), so a dead peer can never hang the daemon.
//
// Thread-safety: Broadcast and WaitReady are called by one thread (the publication thread);
// AsyncError, Abort and aborted() may be called from any thread (the watchdog) at any time,
// as NCCL allows for ncclCommGetAsyncError / ncclCommAbort.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wpub::nccl {

using UniqueId = std::array<uint8_t, 128>;  // ncclUniqueId bytes, as stored in the TCPStore
inline constexpr int kMaxCtas = 64;         // the largest NcclCommOptions::ctas accepted

// OK for a channel count in [0, kMaxCtas]; else INVALID_ARGUMENT "<field> must be in [0, 64], not
// <ctas>". Every option that carries a count into NcclCommOptions::ctas checks it with this.
absl::Status CheckCtas(int ctas, absl::string_view field);

// ncclGetUniqueId (rank 0 only; it starts NCCL's bootstrap listener).
absl::StatusOr<UniqueId> NewUniqueId();

struct NcclCommOptions {
  int device = 0;
  int nranks = 2;
  int rank = 0;
  UniqueId id{};
  // > 0: ncclConfig_t minCTAs = maxCTAs = ctas (NCCL's channels; NCCL clamps to its own
  // maximum); 0: NCCL's choice (NCCL_MIN_CTAS / NCCL_MAX_CTAS in the environment override both).
  // Every rank of a group must end up with the same bounds: NCCL applies each rank's own after
  // the ranks agree on a topology, and ranks with different channel counts split a broadcast
  // differently, which NCCL reports as an error ("Message truncated") -- measured on 2 x H200,
  // tests/multi_gpu/publish_test.cc. Engines whose communicators wpub does not create take the
  // same count from their environment.
  int ctas = 0;
  // Names a rank in errors (e.g. the engine that holds it): an error that is NCCL's version
  // mismatch names both ranks' NCCL versions (nccl_version.h). Null or "": "rank N".
  std::function<std::string(int rank)> rank_name;
};

class NcclComm {
 public:
  // Starts ncclCommInitRankConfig (nonblocking) on `options.device`; returns while the other
  // ranks may not have joined yet. INVALID_ARGUMENT (before any device call) for a rank outside
  // [0, nranks) or ctas outside [0, kMaxCtas].
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(const NcclCommOptions& options);
  // Aborts the communicator (ncclCommAbort never waits for peers), unless already aborted.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Polls until every rank joined (OK), NCCL reports an error (INTERNAL, the communicator is
  // aborted), `deadline` passes (DEADLINE_EXCEEDED, aborted) or `stop` returns true (CANCELLED,
  // not aborted: the caller decides). Cheap once ready.
  absl::Status WaitReady(absl::Time deadline, const std::function<bool()>& stop);
  bool ready() const { return ready_.load(); }

  // Enqueues an in-place broadcast of `bytes` from `root` on `stream` (uint8 elements, as
  // torch's flattened bucket). Requires ready(). Never waits for the device.
  absl::Status Broadcast(void* buffer, uint64_t bytes, int root, cudaStream_t stream);
  // Enqueues an in-place sum all-reduce of `count` float32 elements on `stream` (the one-element
  // warm-up vLLM's communicators run right after init, which every rank must match). Requires
  // ready(). Never waits for the device.
  absl::Status AllReduceSumFloat(float* buffer, uint64_t count, cudaStream_t stream);

  // OK while healthy (also while an operation is in progress), INTERNAL with NCCL's error
  // string once the communicator failed, ABORTED once aborted.
  absl::Status AsyncError();
  // ncclCommAbort, once; idempotent and thread-safe.
  void Abort();
  bool aborted() const { return aborted_.load(); }

  int nranks() const { return options_.nranks; }
  int rank() const { return options_.rank; }

 private:
  NcclComm(NcclCommOptions options, void* comm);
  // Runs `call(comm)` (an NCCL enqueue returning its ncclResult_t) under the abort lock and
  // completes a nonblocking communicator's ncclInProgress.
  absl::Status Enqueue(const char* what, const std::function<int(void*)>& call);
  const NcclCommOptions options_;
  void* comm_;  // ncclComm_t
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> ready_{false};
};

}  // namespace wpub::nccl
