// NcclComm: nonblocking init/collectives, polled completion, abort from any thread.
#include "core/nccl/nccl_comm.h"

#include <nccl.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/nccl/nccl_version.h"

namespace wpub::nccl {
namespace {

// `rank_name`: NcclCommOptions::rank_name (may be null).
absl::Status NcclError(ncclResult_t r, const char* what, ncclComm_t comm,
                       const std::function<std::string(int)>& rank_name = nullptr) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  std::string text =
      absl::StrCat(what, ": ", ncclGetErrorString(r),
                   last != nullptr && *last ? absl::StrCat(" (", last, ")") : std::string());
  if (last != nullptr) {
    if (std::optional<std::string> why = ExplainVersionMismatch(last, rank_name)) {
      absl::StrAppend(&text, ": ", *why);
    }
  }
  return absl::InternalError(text);
}

}  // namespace

absl::Status CheckCtas(int ctas, absl::string_view field) {
  if (ctas >= 0 && ctas <= kMaxCtas) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be in [0, ", kMaxCtas, "], not ", ctas));
}

absl::StatusOr<UniqueId> NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, "ncclGetUniqueId", nullptr);
  }
  static_assert(sizeof(id) == sizeof(UniqueId), "ncclUniqueId is 128 bytes");
  UniqueId out;
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(const NcclCommOptions& options) {
  if (options.nranks < 1 || options.rank < 0 || options.rank >= options.nranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL: rank ", options.rank, " outside [0, ", options.nranks, ")"));
  }
  if (absl::Status s = CheckCtas(options.ctas, "NCCL: ctas"); !s.ok()) return s;
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL: cudaSetDevice(", options.device, "): ", cudaGetErrorString(e)));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  if (options.ctas > 0) {
    config.minCTAs = options.ctas;
    config.maxCTAs = options.ctas;
  }
  ncclUniqueId id;
  std::memcpy(&id, options.id.data(), sizeof(id));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, options.nranks, id, options.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclError(r, "ncclCommInitRankConfig", nullptr);
  }
  return std::unique_ptr<NcclComm>(new NcclComm(options, comm));
}

NcclComm::NcclComm(NcclCommOptions options, void* comm)
    : options_(std::move(options)), comm_(comm) {}

NcclComm::~NcclComm() { Abort(); }

absl::Status NcclComm::WaitReady(absl::Time deadline, const std::function<bool()>& stop) {
  if (ready_.load()) return absl::OkStatus();
  auto comm = static_cast<ncclComm_t>(comm_);
  for (int spin = 0;; ++spin) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r;
    {
      std::lock_guard lock(abort_mu_);  // Abort may free the communicator concurrently
      if (aborted_.load()) return absl::AbortedError("NCCL communicator was aborted during init");
      r = ncclCommGetAsyncError(comm, &state);
    }
    if (r != ncclSuccess) {
      Abort();
      return NcclError(r, "ncclCommGetAsyncError", nullptr);
    }
    if (state == ncclSuccess) {
      ready_ = true;
      return absl::OkStatus();
    }
    if (state != ncclInProgress) {
      absl::Status s;
      {
        std::lock_guard lock(abort_mu_);
        s = NcclError(state, "NCCL communicator init", aborted_.load() ? nullptr : comm,
                      options_.rank_name);
      }
      Abort();
      return s;
    }
    if (stop && stop()) return absl::CancelledError("NCCL init wait cancelled");
    if (absl::Now() >= deadline) {
      Abort();
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL communicator init: ", options_.nranks - 1,
                       " peer rank(s) did not join before the deadline; communicator aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 100 ? 50 : 1000));
  }
}

absl::Status NcclComm::AllReduceSumFloat(float* buffer, uint64_t count, cudaStream_t stream) {
  return Enqueue("ncclAllReduce", [&](void* comm) {
    return static_cast<int>(ncclAllReduce(buffer, buffer, count, ncclFloat32, ncclSum,
                                          static_cast<ncclComm_t>(comm), stream));
  });
}

absl::Status NcclComm::Broadcast(void* buffer, uint64_t bytes, int root, cudaStream_t stream) {
  return Enqueue("ncclBroadcast", [&](void* comm) {
    return static_cast<int>(ncclBroadcast(buffer, buffer, bytes, ncclUint8, root,
                                          static_cast<ncclComm_t>(comm), stream));
  });
}

absl::Status NcclComm::Enqueue(const char* what, const std::function<int(void*)>& call) {
  if (!ready_.load()) return absl::FailedPreconditionError("NCCL communicator is not ready");
  auto comm = static_cast<ncclComm_t>(comm_);
  ncclResult_t r;
  {
    std::lock_guard lock(abort_mu_);
    if (aborted_.load()) return absl::AbortedError("NCCL communicator was aborted");
    r = static_cast<ncclResult_t>(call(comm));
  }
  // Nonblocking communicators may return ncclInProgress while the enqueue completes.
  while (r == ncclInProgress) {
    std::lock_guard lock(abort_mu_);
    if (aborted_.load()) return absl::AbortedError("NCCL communicator was aborted");
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    r = state;
  }
  if (r != ncclSuccess) {
    std::lock_guard lock(abort_mu_);
    if (aborted_.load()) return absl::AbortedError("NCCL communicator was aborted");
    return NcclError(r, what, comm, options_.rank_name);
  }
  return absl::OkStatus();
}

absl::Status NcclComm::AsyncError() {
  std::lock_guard lock(abort_mu_);
  if (aborted_.load()) return absl::AbortedError("NCCL communicator was aborted");
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &state);
  if (r != ncclSuccess) return NcclError(r, "ncclCommGetAsyncError", nullptr);
  if (state == ncclSuccess || state == ncclInProgress) return absl::OkStatus();
  return NcclError(state, "NCCL communicator", static_cast<ncclComm_t>(comm_), options_.rank_name);
}

void NcclComm::Abort() {
  std::lock_guard lock(abort_mu_);
  if (aborted_.exchange(true)) return;
  if (comm_ != nullptr) ncclCommAbort(static_cast<ncclComm_t>(comm_));
}

}  // namespace wpub::nccl
