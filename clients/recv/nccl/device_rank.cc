// DeviceRank: one GPU's bucket slots, streams and checksum read-back; AgreedChecksum.
#include "clients/recv/nccl/device_rank.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/gpu/streams.h"
#include "core/transport/checksum.h"
#include "kernels/cuda/bucket_diff.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::recv::nccl {
namespace {

using Word = unsigned long long;  // the checksum kernel's accumulator

cudaError_t CreateStream(gpu::StreamRole role, kernels::cuda::Stream* out) {
  int priority = 0;
  if (const cudaError_t e = gpu::StreamPriority(role, &priority); e != cudaSuccess) return e;
  return kernels::cuda::Stream::CreateWithPriority(priority, out);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRank>> DeviceRank::Create(int device) {
  std::unique_ptr<DeviceRank> k(new DeviceRank(device));
  using kernels::cuda::DeviceBuffer;
  using kernels::cuda::Event;
  using kernels::cuda::PinnedHostBuffer;
  bool ok = cudaSetDevice(device) == cudaSuccess &&
            CreateStream(gpu::StreamRole::kCommunication, &k->receive_) == cudaSuccess &&
            CreateStream(gpu::StreamRole::kCompute, &k->verify_) == cudaSuccess;
  for (Slot& s : k->slots_) {
    ok = ok && DeviceBuffer::Create(sizeof(Word), &s.sum) == cudaSuccess &&
         PinnedHostBuffer::Create(sizeof(Word), &s.sum_host) == cudaSuccess &&
         Event::Create(/*timing=*/false, &s.verified) == cudaSuccess &&
         Event::Create(/*timing=*/true, &s.posted) == cudaSuccess &&
         Event::Create(/*timing=*/true, &s.landed) == cudaSuccess;
  }
  if (!ok) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("receiver endpoint: CUDA device ", device, " is not usable"));
  }
  return k;
}

// The members are released after this body, on the device it selects.
DeviceRank::~DeviceRank() { (void)cudaSetDevice(device_); }

absl::Status DeviceRank::UseDevice() const {
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("receiver endpoint: cudaSetDevice(", device_, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::Status DeviceRank::CudaError(const char* what, cudaError_t e) const {
  return absl::InternalError(
      absl::StrCat(what, " on device ", device_, ": ", cudaGetErrorString(e)));
}

absl::Status DeviceRank::Reserve(uint64_t n) {
  if (n <= slot_bytes_) return absl::OkStatus();
  WPUB_RETURN_IF_ERROR(UseDevice());
  slot_bytes_ = 0;
  for (Slot& s : slots_) s.buffer.Reset();  // both old buffers go before the new ones come
  for (Slot& s : slots_) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(n, &s.buffer); e != cudaSuccess) {
      for (Slot& t : slots_) t.buffer.Reset();
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the bucket buffers of ", n,
                                                       " bytes on device ", device_, ": ",
                                                       cudaGetErrorString(e)));
    }
  }
  slot_bytes_ = n;
  return absl::OkStatus();
}

absl::Status DeviceRank::EnqueueReceive(GroupMember& member, int slot,
                                        absl::Span<const uint64_t> chunks) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  return member.Receive(slots_[slot].buffer.data(), chunks, receive_.get());
}

absl::Status DeviceRank::EnqueueWarmUp(GroupMember& member) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  if (warmup_.size() < sizeof(float)) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(sizeof(float), &warmup_);
        e != cudaSuccess) {
      return CudaError("allocating the warm-up's float", e);
    }
  }
  return member.WarmUp(static_cast<float*>(warmup_.data()), receive_.get());
}

absl::Status DeviceRank::EnqueueVerifiedReceive(GroupMember& member, int slot,
                                                absl::Span<const uint64_t> chunks) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  uint64_t n = 0;
  for (const uint64_t c : chunks) n += c;
  Slot& s = slots_[slot];
  cudaError_t e = cudaStreamWaitEvent(receive_.get(), s.verified.get(), 0);
  if (e != cudaSuccess) return CudaError("ordering the receive", e);
  e = s.posted.Record(receive_.get());
  if (e != cudaSuccess) return CudaError("timing the receive", e);
  WPUB_RETURN_IF_ERROR(member.Receive(s.buffer.data(), chunks, receive_.get()));
  e = s.landed.Record(receive_.get());
  if (e == cudaSuccess) e = cudaStreamWaitEvent(verify_.get(), s.landed.get(), 0);
  if (e == cudaSuccess) e = EnqueueChecksumOn(slot, n, verify_.get());
  if (e == cudaSuccess) e = s.verified.Record(verify_.get());
  if (e != cudaSuccess) return CudaError("enqueueing the bucket's checksum", e);
  return absl::OkStatus();
}

absl::Status DeviceRank::EnqueueChecksum(int slot, uint64_t n) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  if (const cudaError_t e = EnqueueChecksumOn(slot, n, receive_.get()); e != cudaSuccess) {
    return CudaError("the bucket's checksum", e);
  }
  return absl::OkStatus();
}

cudaError_t DeviceRank::EnqueueChecksumOn(int slot, uint64_t n, cudaStream_t stream) {
  Slot& s = slots_[slot];
  cudaError_t e = cudaMemsetAsync(s.sum.data(), 0, sizeof(Word), stream);
  if (e == cudaSuccess) {
    e = kernels::cuda::LaunchChecksumAdd(s.buffer.as<const uint8_t>(), n, 0, s.sum.as<Word>(),
                                         stream);
  }
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(s.sum_host.data(), s.sum.data(), sizeof(Word), cudaMemcpyDeviceToHost,
                        stream);
  }
  return e;
}

absl::Status DeviceRank::CopyToHost(int slot, uint64_t n, std::vector<uint8_t>* bytes) const {
  WPUB_RETURN_IF_ERROR(UseDevice());
  bytes->resize(n);
  if (const cudaError_t e =
          cudaMemcpy(bytes->data(), slots_[slot].buffer.data(), n, cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return CudaError("copying the bucket back", e);
  }
  return absl::OkStatus();
}

absl::Status DeviceRank::ReserveKept(uint32_t index, uint64_t n) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  if (kept_words_.size() == 0) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(2 * sizeof(Word), &kept_words_);
        e != cudaSuccess) {
      return CudaError("allocating the kept weights' checksum word", e);
    }
    if (const cudaError_t e =
            kernels::cuda::PinnedHostBuffer::Create(2 * sizeof(Word), &kept_words_host_);
        e != cudaSuccess) {
      return CudaError("allocating the kept weights' read-back", e);
    }
  }
  if (index >= kept_.size()) {
    kept_.resize(index + 1);
    kept_sizes_.resize(index + 1, 0);
  }
  if (kept_[index].data() != nullptr && kept_sizes_[index] == n) return absl::OkStatus();
  kept_[index].Reset();
  kept_sizes_[index] = 0;
  if (const cudaError_t e =
          kernels::cuda::DeviceBuffer::Create(std::max<uint64_t>(n, 8), &kept_[index]);
      e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate kept bucket ", index, " of ",
                                                     n, " bytes on device ", device_, ": ",
                                                     cudaGetErrorString(e)));
  }
  kept_sizes_[index] = n;
  return absl::OkStatus();
}

bool DeviceRank::HasKept(uint32_t index, uint64_t n) const {
  return index < kept_.size() && kept_[index].data() != nullptr && kept_sizes_[index] == n;
}

absl::Status DeviceRank::EnqueueKeptReceive(GroupMember& member, uint32_t index,
                                            absl::Span<const uint64_t> chunks) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  uint64_t n = 0;
  for (const uint64_t c : chunks) n += c;
  if (!HasKept(index, n)) return absl::InternalError("kept bucket not reserved");
  WPUB_RETURN_IF_ERROR(member.Receive(kept_[index].data(), chunks, receive_.get()));
  const cudaStream_t s = receive_.get();
  kept_n_ = n;
  cudaError_t e = cudaMemsetAsync(kept_words_.data(), 0, 2 * sizeof(Word), s);
  if (e == cudaSuccess) {
    e = kernels::cuda::LaunchChecksumAdd(kept_[index].as<const uint8_t>(), n, 0,
                                         kept_words_.as<Word>(), s);
  }
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(kept_words_host_.data(), kept_words_.data(), 2 * sizeof(Word),
                        cudaMemcpyDeviceToHost, s);
  }
  if (e != cudaSuccess) return CudaError("the kept bucket's checksum", e);
  return absl::OkStatus();
}

absl::Status DeviceRank::EnqueueKeptPatch(uint32_t index, uint64_t n, uint64_t patch_bytes) {
  WPUB_RETURN_IF_ERROR(UseDevice());
  if (!HasKept(index, n) || patch_bytes > slot_bytes_) {
    return absl::InternalError("no kept bucket of that size, or the patch is not in slot 0");
  }
  const cudaStream_t s = receive_.get();
  kept_n_ = n;
  cudaError_t e = cudaMemsetAsync(kept_words_.data(), 0, 2 * sizeof(Word), s);
  // The error word is the second: the apply launch zeroes and sets it.
  if (e == cudaSuccess) {
    e = kernels::cuda::LaunchBucketPatchApply(
        slots_[0].buffer.as<const uint8_t>(), patch_bytes, kept_[index].as<uint8_t>(), n,
        reinterpret_cast<unsigned int*>(kept_words_.as<Word>() + 1), s);
  }
  if (e == cudaSuccess) {
    e = kernels::cuda::LaunchChecksumAdd(kept_[index].as<const uint8_t>(), n, 0,
                                         kept_words_.as<Word>(), s);
  }
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(kept_words_host_.data(), kept_words_.data(), 2 * sizeof(Word),
                        cudaMemcpyDeviceToHost, s);
  }
  if (e != cudaSuccess) return CudaError("applying the bucket's patch", e);
  return absl::OkStatus();
}

uint64_t DeviceRank::KeptChecksum(uint32_t /*index*/) const {
  return transport::ChecksumFinish(kept_words_host_.as<const Word>()[0], kept_n_);
}

bool DeviceRank::PatchRefused() const { return kept_words_host_.as<const Word>()[1] != 0; }

uint64_t DeviceRank::Checksum(int slot, uint64_t n) const {
  return transport::ChecksumFinish(*slots_[slot].sum_host.as<const Word>(), n);
}

double DeviceRank::ReceiveDeviceSeconds(int slot) const {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, slots_[slot].posted.get(), slots_[slot].landed.get()) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return ms / 1e3;
}

absl::StatusOr<uint64_t> AgreedChecksum(const std::vector<uint64_t>& sums,
                                        const std::vector<std::unique_ptr<DeviceRank>>& ranks,
                                        const std::string& version) {
  for (size_t i = 1; i < ranks.size(); ++i) {
    if (sums[i] != sums[0]) {
      return absl::DataLossError(
          absl::StrCat("version ", version, ": the bucket's checksum on device ",
                       ranks[i]->device(), " differs from device ", ranks[0]->device(), "'s"));
    }
  }
  return sums[0];
}

}  // namespace wpub::recv::nccl
