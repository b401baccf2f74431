// NcclTransport: buckets onto the communicator, the watchdog (see nccl_transport.h).
#include "core/nccl/nccl_transport.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/gpu/host_syncs.h"
#include "core/gpu/streams.h"
#include "core/nccl/nccl_version.h"

namespace wpub::nccl {

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const NcclTransportOptions& options) {
  if (const cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL transport: CUDA device ", options.device, " is not usable: ", cudaGetErrorString(e)));
  }
  std::unique_ptr<NcclTransport> t(new NcclTransport(options));
  int priority = 0;
  WPUB_CUDA_RETURN_IF_ERROR(gpu::StreamPriority(gpu::StreamRole::kCommunication, &priority));
  WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Stream::CreateWithPriority(priority, &t->comm_stream_));
  WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &t->host_done_));
  return t;
}

NcclTransport::~NcclTransport() {
  StopWatchdog();
  Attach(nullptr);  // ncclCommAbort: terminates anything still on the comm stream
  if (comm_stream_.get() != nullptr) (void)comm_stream_.Synchronize();
}

absl::StatusOr<transport::GroupId> NcclTransport::NewId() { return NewUniqueId(); }

absl::Status NcclTransport::Open(int world_size, const transport::GroupId& id,
                                 std::function<std::string(int rank)> rank_name) {
  NcclCommOptions co;
  co.device = options_.device;
  co.nranks = world_size;
  co.rank = 0;
  co.id = id;
  co.ctas = options_.ctas;
  co.rank_name = std::move(rank_name);
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> comm, NcclComm::Create(co));
  Attach(std::move(comm));
  return absl::OkStatus();
}

std::string NcclTransport::Describe() const { return absl::StrCat("NCCL ", LoadedNccl()); }

void NcclTransport::Attach(std::unique_ptr<NcclComm> comm) {
  std::unique_ptr<NcclComm> old;
  {
    std::lock_guard lock(mu_);
    old = std::exchange(comm_, std::move(comm));
  }
  old.reset();  // aborts it (NcclComm's destructor) outside the lock
}

bool NcclTransport::usable() const {
  std::lock_guard lock(mu_);
  return comm_ != nullptr && !comm_->aborted();
}

void NcclTransport::Begin(transport::PublicationWatch watch) {
  StopWatchdog();  // left running by an abort from another thread
  {
    std::lock_guard lock(mu_);
    failure_ = absl::OkStatus();
  }
  watch_ = std::move(watch);
  bcast_count_ = 0;
  StartWatchdog();
}

void NcclTransport::End() { StopWatchdog(); }

absl::Status NcclTransport::Send(const transport::Bucket& bucket,
                                 absl::Span<const uint64_t> chunks) {
  WPUB_RETURN_IF_ERROR(failure());
  uint64_t sum = 0;
  for (uint64_t c : chunks) sum += c;
  if (!chunks.empty() && sum != bucket.manifest.nbytes) {
    return absl::InvalidArgumentError(absl::StrCat("bucket ", bucket.manifest.index, ": chunks of ",
                                                   sum, " bytes for a bucket of ",
                                                   bucket.manifest.nbytes));
  }
  if (bucket.location == transport::BucketLocation::kHost) return SendHost(bucket, chunks);
  const transport::DeviceBytes& d = bucket.device;
  return Broadcast(d.data, bucket.manifest.nbytes, d.ready, d.done, bucket.manifest.index, chunks);
}

absl::Status NcclTransport::SendHost(const transport::Bucket& bucket,
                                     absl::Span<const uint64_t> chunks) {
  const uint64_t n = bucket.bytes.size();
  // The previous host bucket's broadcast must be done before its buffer is overwritten.
  gpu::HostSyncs uncounted(nullptr);
  WPUB_RETURN_IF_ERROR(uncounted.EventSynchronize(host_done_.get(), "host bucket buffer reuse"));
  if (n > host_staging_.size()) {
    host_staging_.Reset();
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::DeviceBuffer::Create(n, &host_staging_));
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_staging_.data(), bucket.bytes.data(), n,
                                            cudaMemcpyHostToDevice, comm_stream_.get()));
  WPUB_CUDA_RETURN_IF_ERROR(host_done_.Record(comm_stream_.get()));
  return Broadcast(host_staging_.data(), n, host_done_.get(), host_done_.get(),
                   bucket.manifest.index, chunks);
}

absl::Status NcclTransport::Broadcast(const void* data, uint64_t nbytes, cudaEvent_t ready,
                                      cudaEvent_t done, uint32_t index,
                                      absl::Span<const uint64_t> chunks) {
  NcclComm* comm = nullptr;
  {
    std::lock_guard lock(mu_);
    comm = comm_.get();
  }
  if (comm == nullptr) return absl::FailedPreconditionError("NCCL transport: no communicator");
  if (!comm->ready()) {
    absl::Status s = comm->WaitReady(watch_.deadline, [this] { return !failure().ok(); });
    if (!s.ok()) {
      std::string detail = watch_.not_ready_detail ? watch_.not_ready_detail() : std::string();
      Fail(absl::AbortedError(absl::StrCat("NCCL group did not become ready: ", s.message(),
                                           detail.empty() ? "" : " (", detail,
                                           detail.empty() ? "" : ")")));
      return failure();
    }
  }
  const cudaStream_t s = comm_stream_.get();
  WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, ready, 0));
  while (bcast_events_.size() < 2 * (bcast_count_ + 1)) {
    kernels::cuda::Event e;
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/true, &e));
    bcast_events_.push_back(std::move(e));
  }
  const size_t timed = bcast_count_;  // counted once both of its events are recorded
  WPUB_CUDA_RETURN_IF_ERROR(bcast_events_[2 * timed].Record(s));
  const uint64_t whole[1] = {nbytes};
  if (chunks.empty()) chunks = absl::MakeConstSpan(whole);
  uint64_t offset = 0;
  for (uint64_t chunk : chunks) {
    auto* at = static_cast<uint8_t*>(const_cast<void*>(data)) + offset;
    if (absl::Status b = comm->Broadcast(at, chunk, 0, s); !b.ok()) {
      Fail(absl::AbortedError(absl::StrCat("bucket ", index, ": ", b.message())));
      return failure();
    }
    offset += chunk;
  }
  WPUB_CUDA_RETURN_IF_ERROR(bcast_events_[2 * timed + 1].Record(s));
  ++bcast_count_;
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, s));
  return absl::OkStatus();
}

absl::Status NcclTransport::WarmUp(absl::Time deadline) {
  NcclComm* comm = nullptr;
  {
    std::lock_guard lock(mu_);
    comm = comm_.get();
  }
  if (comm == nullptr) return absl::FailedPreconditionError("NCCL transport: no communicator");
  const auto fail = [&](absl::Status why) {
    comm->Abort();
    return why;
  };
  if (absl::Status s = comm->WaitReady(deadline, [] { return false; }); !s.ok()) {
    return fail(absl::Status(s.code(), absl::StrCat("NCCL group did not become ready for the "
                                                    "warm-up all-reduce: ",
                                                    s.message())));
  }
  if (warmup_.size() < sizeof(float)) {
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::DeviceBuffer::Create(sizeof(float), &warmup_));
  }
  const cudaStream_t s = comm_stream_.get();
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(warmup_.data(), 0, sizeof(float), s));
  if (absl::Status a = comm->AllReduceSumFloat(static_cast<float*>(warmup_.data()), 1, s);
      !a.ok()) {
    return fail(absl::AbortedError(absl::StrCat("warm-up all-reduce: ", a.message())));
  }
  for (;;) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return fail(absl::InternalError(absl::StrCat("warm-up all-reduce: ", cudaGetErrorString(q))));
    }
    if (absl::Status e = comm->AsyncError(); !e.ok()) {
      return fail(absl::AbortedError(absl::StrCat("warm-up all-reduce: ", e.message())));
    }
    if (absl::Now() >= deadline) {
      return fail(absl::DeadlineExceededError(
          "the warm-up all-reduce did not complete: a peer did not take part"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

absl::Status NcclTransport::WaitSent(absl::Time deadline) {
  if (bcast_count_ == 0) return failure();
  const absl::Time d = std::min(deadline, watch_.deadline);
  const cudaEvent_t last = bcast_events_[2 * bcast_count_ - 1].get();
  for (;;) {
    const cudaError_t q = cudaEventQuery(last);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return absl::InternalError(absl::StrCat("comm stream: ", cudaGetErrorString(q)));
    }
    WPUB_RETURN_IF_ERROR(failure());
    if (absl::Now() >= d) {
      Fail(absl::DeadlineExceededError("broadcasts did not complete before the deadline"));
      return failure();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

NcclTransport::BroadcastTiming NcclTransport::last_broadcast_timing() const {
  BroadcastTiming t;
  for (size_t i = 0; i < bcast_count_; ++i) {
    float busy = 0, idle = 0;
    if (cudaEventElapsedTime(&busy, bcast_events_[2 * i].get(), bcast_events_[2 * i + 1].get()) !=
            cudaSuccess ||
        (i > 0 && cudaEventElapsedTime(&idle, bcast_events_[2 * i - 1].get(),
                                       bcast_events_[2 * i].get()) != cudaSuccess)) {
      (void)cudaGetLastError();
      return BroadcastTiming();
    }
    t.busy.push_back(busy / 1e3);
    if (i > 0) t.idle.push_back(idle / 1e3);
  }
  return t;
}

void NcclTransport::Fail(absl::Status why) {
  std::lock_guard lock(mu_);
  if (failure_.ok()) failure_ = std::move(why);
  if (comm_) comm_->Abort();
}

absl::Status NcclTransport::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

void NcclTransport::StartWatchdog() {
  {
    std::lock_guard lock(mu_);
    watchdog_stop_ = false;
  }
  watchdog_ = std::thread([this] {
    std::unique_lock lock(mu_);
    while (!watchdog_stop_) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.watchdog_interval));
      if (watchdog_stop_ || !failure_.ok()) continue;
      NcclComm* comm = comm_.get();
      lock.unlock();
      absl::Status why;
      if (comm != nullptr) why = comm->AsyncError();
      if (why.ok() && watch_.peer_failure) why = watch_.peer_failure();
      if (why.ok() && absl::Now() > watch_.deadline) {
        why = absl::DeadlineExceededError(watch_.deadline_message);
      }
      if (!why.ok()) Fail(why);
      lock.lock();
    }
  });
}

void NcclTransport::StopWatchdog() {
  {
    std::lock_guard lock(mu_);
    watchdog_stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

}  // namespace wpub::nccl
