// IpcChannel (ipc_channel.h): buckets handed to colocated engines in place.
#include "core/rollout/ipc_channel.h"

#include <cuda.h>

#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/status.h"
#include "core/gpu/backend_parts.h"
#include "core/gpu/ipc_cache.h"

namespace wpub::rollout {
namespace {

// cuMemGetAddressRange, looked up at run time (nothing links libcuda).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(absl::StrCat("colocated channel: ", what, ": ", cudaGetErrorName(e),
                                          " (", cudaGetErrorString(e), ")"));
}

#define WPUB_IPC_CUDA(call, what)                      \
  do {                                                 \
    const cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) return CudaError(e_, what); \
  } while (0)

std::string UuidOf(const cudaDeviceProp& p) {
  gpu::DeviceUuid u{};
  std::memcpy(u.data(), p.uuid.bytes, u.size());
  return gpu::FormatDeviceUuid(u);
}

}  // namespace

absl::StatusOr<std::unique_ptr<IpcChannel>> IpcChannel::Create(const IpcChannelOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || options.device < 0 || options.device >= count) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("colocated channel: no CUDA device ",
                                                      options.device, " (", count, " visible)"));
  }
  WPUB_IPC_CUDA(cudaSetDevice(options.device), "cudaSetDevice");
  cudaDeviceProp prop{};
  WPUB_IPC_CUDA(cudaGetDeviceProperties(&prop, options.device), "cudaGetDeviceProperties");
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<TorchRefCounters> counters, TorchRefCounters::Create());
  std::unique_ptr<IpcChannel> c(new IpcChannel(options, UuidOf(prop), std::move(counters)));
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    WPUB_IPC_CUDA(cudaGetDeviceProperties(&p, d), "cudaGetDeviceProperties");
    c->node_uuids_.push_back(UuidOf(p));
  }
  WPUB_IPC_CUDA(kernels::cuda::Stream::Create(&c->stream_), "stream");
  for (cudaEvent_t& e : c->events_) {
    WPUB_IPC_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
                  "interprocess event");
  }
  return c;
}

IpcChannel::IpcChannel(const IpcChannelOptions& options, std::string uuid,
                       std::unique_ptr<TorchRefCounters> counters)
    : options_(options), uuid_(std::move(uuid)), counters_(std::move(counters)) {}

IpcChannel::~IpcChannel() {
  cudaSetDevice(options_.device);
  DropHeld();
  if (stream_.get() != nullptr) cudaStreamSynchronize(stream_.get());
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

absl::StatusOr<transport::GroupId> IpcChannel::NewId() {
  // Names the group only (nothing rendezvouses on it).
  transport::GroupId id{};
  std::random_device rd;
  for (uint8_t& b : id) b = static_cast<uint8_t>(rd());
  return id;
}

absl::Status IpcChannel::Open(int world_size, const transport::GroupId& /*id*/,
                              std::function<std::string(int rank)> /*rank_name*/) {
  if (world_size < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("colocated channel: a group of ", world_size, " ranks has no engine rank"));
  }
  Close();
  readers_ = world_size - 1;
  {
    std::lock_guard lock(mu_);
    failure_ = absl::OkStatus();
  }
  open_ = true;
  return absl::OkStatus();
}

void IpcChannel::Close() {
  DropHeld();
  open_ = false;
}

std::string IpcChannel::Describe() const {
  return absl::StrCat("CUDA IPC on device ", options_.device, " (", uuid_, "), reference counters ",
                      counters_->name());
}

void IpcChannel::Begin(transport::PublicationWatch watch) {
  DropHeld();
  watch_ = std::move(watch);
  seq_ = 0;
  std::lock_guard lock(mu_);
  if (open_) failure_ = absl::OkStatus();
}

absl::StatusOr<std::optional<transport::SharedDeviceBytes>> IpcChannel::Share(
    const transport::Bucket& bucket) {
  WPUB_RETURN_IF_ERROR(failure());
  if (!open_) return absl::FailedPreconditionError("colocated channel: no group is open");
  if (bucket.location != transport::BucketLocation::kDevice) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bucket ", bucket.manifest.index,
        " is in host memory: colocated engines read device buckets (wpubd's GPU path)"));
  }
  if (bucket.device.device != options_.device) {
    return absl::FailedPreconditionError(
        absl::StrCat("bucket ", bucket.manifest.index, " is on device ", bucket.device.device,
                     " but the colocated channel shares device ", options_.device));
  }
  if (held_.size() + 1 >= kEvents) {
    return absl::InternalError("colocated channel: more buckets held than it has events");
  }
  WPUB_IPC_CUDA(cudaSetDevice(options_.device), "cudaSetDevice");
  cudaEvent_t ev = events_[shared_ % kEvents];
  if (bucket.device.ready != nullptr) {
    WPUB_IPC_CUDA(cudaStreamWaitEvent(stream_.get(), bucket.device.ready, 0), "wait ready");
  }
  WPUB_IPC_CUDA(cudaEventRecord(ev, stream_.get()), "record the shared event");
  static const GetAddressRangeFn range =
      gpu::detail::DriverFunction<GetAddressRangeFn>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range == nullptr ||
      range(&base, &size, reinterpret_cast<CUdeviceptr>(bucket.device.data)) != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("colocated channel: bucket ", bucket.manifest.index,
                                            ": cannot read its allocation's extent"));
  }
  cudaIpcMemHandle_t mem{};
  WPUB_IPC_CUDA(cudaIpcGetMemHandle(&mem, reinterpret_cast<void*>(base)), "cudaIpcGetMemHandle");
  cudaIpcEventHandle_t evh{};
  WPUB_IPC_CUDA(cudaIpcGetEventHandle(&evh, ev), "cudaIpcGetEventHandle");
  transport::SharedDeviceBytes s;
  s.mem_handle.assign(reinterpret_cast<const char*>(&mem), sizeof(mem));
  s.allocation_bytes = size;
  s.offset_bytes = reinterpret_cast<CUdeviceptr>(bucket.device.data) - base;
  s.nbytes = bucket.manifest.nbytes;
  s.device = options_.device;
  s.device_uuid = uuid_;
  s.node_device_uuids = node_uuids_;
  s.event_handle.assign(reinterpret_cast<const char*>(&evh), sizeof(evh));
  s.ref_counter = counters_->name();
  // One slot per reading rank, each decremented once; wrapped around the file (the slots of a
  // bucket are reused only after thousands of buckets, long released).
  if (next_slot_ % TorchRefCounters::kSlots + readers_ > TorchRefCounters::kSlots) {
    next_slot_ += TorchRefCounters::kSlots - next_slot_ % TorchRefCounters::kSlots;
  }
  s.ref_counter_offset = next_slot_ % TorchRefCounters::kSlots;
  for (int r = 0; r < readers_; ++r) counters_->Set(s.ref_counter_offset + r, 1);
  pending_ =
      Held{s.ref_counter_offset, readers_, bucket.device.done, bucket.manifest.index, seq_++};
  next_slot_ += readers_;
  ++shared_;
  return std::optional<transport::SharedDeviceBytes>(std::move(s));
}

absl::Status IpcChannel::Send(const transport::Bucket& bucket,
                              absl::Span<const uint64_t> /*chunks*/) {
  WPUB_RETURN_IF_ERROR(failure());
  if (!pending_.has_value() || pending_->index != bucket.manifest.index) {
    return absl::InternalError(absl::StrCat("colocated channel: bucket ", bucket.manifest.index,
                                            " was sent without being shared first"));
  }
  held_.push_back(*std::exchange(pending_, std::nullopt));
  // The producer reuses the buffer of every earlier bucket next: release them.
  while (held_.size() > 1) {
    absl::Status s = WaitReleased(held_.front(), watch_.deadline);
    if (!s.ok()) {
      DropHeld();
      return s;
    }
    WPUB_IPC_CUDA(cudaEventRecord(held_.front().done, stream_.get()), "record done");
    held_.pop_front();
  }
  return absl::OkStatus();
}

absl::Status IpcChannel::WaitSent(absl::Time deadline) {
  while (!held_.empty()) {
    absl::Status s = WaitReleased(held_.front(), std::min(deadline, watch_.deadline));
    if (!s.ok()) {
      DropHeld();
      return s;
    }
    WPUB_IPC_CUDA(cudaEventRecord(held_.front().done, stream_.get()), "record done");
    held_.pop_front();
  }
  return failure();
}

absl::Status IpcChannel::WaitReleased(const Held& h, absl::Time deadline) {
  for (;;) {
    bool released = true;
    int64_t holding = 0;
    if (options_.release == IpcChannelOptions::Release::kAnswered) {
      released = watch_.updates_answered && watch_.updates_answered() > h.seq;
      holding = released ? 0 : 1;
    } else {
      for (int r = 0; r < h.slots; ++r) {
        const int64_t v = counters_->Get(h.first_slot + r);
        if (v > 0) {
          released = false;
          holding += v;
        }
      }
    }
    if (released) return absl::OkStatus();
    WPUB_RETURN_IF_ERROR(failure());
    if (watch_.peer_failure) {
      if (absl::Status p = watch_.peer_failure(); !p.ok()) {
        Fail(p);
        return failure();
      }
    }
    if (absl::Now() >= deadline) {
      Fail(absl::DeadlineExceededError(absl::StrCat(
          watch_.deadline_message.empty() ? "colocated publication timed out"
                                          : watch_.deadline_message,
          options_.release == IpcChannelOptions::Release::kAnswered
              ? absl::StrCat(": an engine has not answered bucket ", h.index, "'s request")
              : absl::StrCat(": ", holding, " engine rank(s) still hold bucket ", h.index,
                             " (torch's CUDA IPC reference counter not released)"))));
      return failure();
    }
    std::this_thread::sleep_for(absl::ToChronoMicroseconds(options_.poll_interval));
  }
}

void IpcChannel::DropHeld() {
  // A receiver still reading these bytes after a failure holds a version that is not committed
  // (it is dirty); the producer may overwrite them.
  for (const Held& h : held_) {
    if (h.done != nullptr) (void)cudaEventRecord(h.done, stream_.get());
  }
  held_.clear();
  pending_.reset();
}

void IpcChannel::End() {}

void IpcChannel::Fail(absl::Status why) {
  std::lock_guard lock(mu_);
  if (failure_.ok()) failure_ = why.ok() ? absl::AbortedError("colocated channel failed") : why;
  // As an aborted NCCL group: the next publication re-forms the group (the rollout group's
  // health probe leaves out an engine that died mid-handover).
  open_ = false;
}

absl::Status IpcChannel::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

}  // namespace wpub::rollout
