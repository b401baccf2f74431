// HostSyncs: each synchronizing CUDA runtime call of the GPU path, counted once.
#include "core/gpu/host_syncs.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_raii.h"

namespace wpub::gpu {

absl::Status CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  return absl::InternalError(absl::StrCat(expr, " failed at ", file, ":", line, ": ",
                                          cudaGetErrorName(err), " (", cudaGetErrorString(err),
                                          ")"));
}

namespace {
absl::Status Check(cudaError_t err, const char* call, const char* why) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, " (", why, ") failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}
}  // namespace

absl::Status HostSyncs::EventSynchronize(cudaEvent_t event, const char* why) {
  Count();
  return Check(cudaEventSynchronize(event), "cudaEventSynchronize", why);
}

absl::Status HostSyncs::StreamSynchronize(cudaStream_t stream, const char* why) {
  Count();
  return Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize", why);
}

absl::Status HostSyncs::Malloc(void** ptr, size_t bytes, const char* why) {
  Count();
  return Check(cudaMalloc(ptr, kernels::cuda::DeviceAllocationBytes(bytes)), "cudaMalloc", why);
}

absl::Status HostSyncs::Free(void* ptr) {
  if (ptr == nullptr) return absl::OkStatus();
  Count();
  return Check(cudaFree(ptr), "cudaFree", "release");
}

absl::Status HostSyncs::MallocHost(void** ptr, size_t bytes, const char* why) {
  Count();
  return Check(cudaMallocHost(ptr, bytes), "cudaMallocHost", why);
}

absl::Status HostSyncs::FreeHost(void* ptr) {
  if (ptr == nullptr) return absl::OkStatus();
  Count();
  return Check(cudaFreeHost(ptr), "cudaFreeHost", "release");
}

}  // namespace wpub::gpu
