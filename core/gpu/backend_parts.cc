// The GPU backend's helpers (backend_parts.h).
#include "core/gpu/backend_parts.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"

namespace wpub::gpu::detail {

using engine::InputTensor;
using engine::PartView;

void* DriverEntryPoint(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, CUDA_VERSION, cudaEnableDefault, &q) !=
          cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

bool FloatKindOf(DType d, kernels::cuda::FloatKind* k) {
  using kernels::cuda::FloatKind;
  switch (d) {
    case DType::kBFloat16:
      *k = FloatKind::kBF16;
      return true;
    case DType::kFloat16:
      *k = FloatKind::kF16;
      return true;
    case DType::kFloat32:
      *k = FloatKind::kF32;
      return true;
    case DType::kFloat64:
      *k = FloatKind::kF64;
      return true;
    default:
      return false;
  }
}

absl::Status KernelError(kernels::KernelStatus st, const std::string& what,
                         const std::string& msg) {
  return absl::InternalError(
      absl::StrCat(what, ": ", kernels::KernelStatusString(st), msg.empty() ? "" : ": ", msg));
}

GrowBuffer::~GrowBuffer() {
  HostSyncs uncounted(nullptr);
  (void)Release(uncounted);
}

GrowBuffer::GrowBuffer(GrowBuffer&& other) noexcept
    : pinned_(other.pinned_),
      ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

GrowBuffer& GrowBuffer::operator=(GrowBuffer&& other) noexcept {
  if (this != &other) {
    HostSyncs uncounted(nullptr);
    (void)Release(uncounted);
    pinned_ = other.pinned_;
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::Status GrowBuffer::Ensure(uint64_t bytes, HostSyncs& syncs, const char* why) {
  if (bytes <= size_) return absl::OkStatus();
  WPUB_RETURN_IF_ERROR(Release(syncs));
  const uint64_t want = AlignUp(bytes, uint64_t{1} << 20);
  WPUB_RETURN_IF_ERROR(pinned_ ? syncs.MallocHost(&ptr_, want, why)
                               : syncs.Malloc(&ptr_, want, why));
  size_ = want;
  return absl::OkStatus();
}

absl::Status GrowBuffer::Release(HostSyncs& syncs) {
  if (ptr_ == nullptr) return absl::OkStatus();
  absl::Status s = pinned_ ? syncs.FreeHost(ptr_) : syncs.Free(ptr_);
  ptr_ = nullptr;
  size_ = 0;
  return s;
}

}  // namespace wpub::gpu::detail
