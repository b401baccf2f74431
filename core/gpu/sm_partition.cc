// PartitionedStream: cuDeviceGetDevResource -> cuDevSmResourceSplitByCount (one group) ->
// cuDevResourceGenerateDesc -> cuGreenCtxCreate -> cuGreenCtxStreamCreate.
#include "core/gpu/sm_partition.h"

#include <cuda.h>

#include "absl/strings/str_cat.h"
#include "core/gpu/backend_parts.h"

namespace wpub::gpu {

struct PartitionedStream::Driver {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*get_resource)(CUdevice, CUdevResource*, CUdevResourceType) = nullptr;
  CUresult (*split_by_count)(CUdevResource*, unsigned int*, const CUdevResource*, CUdevResource*,
                             unsigned int, unsigned int) = nullptr;
  CUresult (*generate_desc)(CUdevResourceDesc*, CUdevResource*, unsigned int) = nullptr;
  CUresult (*ctx_create)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned int) = nullptr;
  CUresult (*ctx_destroy)(CUgreenCtx) = nullptr;
  CUresult (*stream_create)(CUstream*, CUgreenCtx, unsigned int, int) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  const char* missing = nullptr;  // the first entry point not found; nullptr: all found

  static Driver Load() {
    Driver x;
    auto find = [&x](const char* name, auto* fn) {
      *fn = detail::DriverFunction<std::remove_pointer_t<decltype(fn)>>(name);
      if (*fn == nullptr) x.missing = name;
      return *fn != nullptr;
    };
    // Green-context streams arrived in CUDA 12.5; DriverFunction asks for this toolkit's versions.
    (void)(find("cuDeviceGet", &x.device_get) && find("cuDeviceGetDevResource", &x.get_resource) &&
           find("cuDevSmResourceSplitByCount", &x.split_by_count) &&
           find("cuDevResourceGenerateDesc", &x.generate_desc) &&
           find("cuGreenCtxCreate", &x.ctx_create) && find("cuGreenCtxDestroy", &x.ctx_destroy) &&
           find("cuGreenCtxStreamCreate", &x.stream_create) &&
           find("cuGetErrorString", &x.get_error_string));
    return x;
  }

  std::string Error(const char* call, CUresult r) const {
    const char* s = nullptr;
    if (get_error_string == nullptr || get_error_string(r, &s) != CUDA_SUCCESS) s = nullptr;
    return absl::StrCat(call, ": CUresult ", static_cast<int>(r),
                        s ? absl::StrCat(" (", s, ")") : "");
  }
};

absl::StatusOr<std::unique_ptr<PartitionedStream>> PartitionedStream::Create(int device, int sms,
                                                                             int priority) {
  auto loaded = std::make_unique<const Driver>(Driver::Load());
  const Driver& d = *loaded;
  if (d.missing != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("SM partition: this CUDA driver has no ", d.missing, " (green contexts)"));
  }
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("SM partition: CUDA device ", device, " is not usable"));
  }
  CUdevice dev = 0;
  CUdevResource all{};
  if (CUresult r = d.device_get(&dev, device); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(d.Error("cuDeviceGet", r));
  }
  if (CUresult r = d.get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(d.Error("cuDeviceGetDevResource", r));
  }
  const int total = static_cast<int>(all.sm.smCount);
  if (sms < 1 || sms > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("SM partition: ", sms, " SMs asked for; device ", device, " has ", total));
  }
  std::unique_ptr<PartitionedStream> p(new PartitionedStream());
  p->driver_ = std::move(loaded);
  CUdevResourceDesc desc = nullptr;
  if (sms == total) {
    // The whole device: no split (a split group must leave SMs over on some devices).
    if (CUresult r = d.generate_desc(&desc, &all, 1); r != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(d.Error("cuDevResourceGenerateDesc", r));
    }
    p->sms_ = total;
  } else {
    CUdevResource group{}, rest{};
    unsigned int groups = 1;
    if (CUresult r = d.split_by_count(&group, &groups, &all, &rest, 0, static_cast<unsigned>(sms));
        r != CUDA_SUCCESS || groups != 1) {
      return absl::FailedPreconditionError(
          r != CUDA_SUCCESS
              ? d.Error("cuDevSmResourceSplitByCount", r)
              : absl::StrCat("SM partition: no group of ", sms, " SMs on device ", device));
    }
    if (CUresult r = d.generate_desc(&desc, &group, 1); r != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(d.Error("cuDevResourceGenerateDesc", r));
    }
    p->sms_ = static_cast<int>(group.sm.smCount);
  }
  CUgreenCtx ctx = nullptr;
  if (CUresult r = d.ctx_create(&ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(d.Error("cuGreenCtxCreate", r));
  }
  p->context_ = ctx;
  CUstream s = nullptr;
  if (CUresult r = d.stream_create(&s, ctx, CU_STREAM_NON_BLOCKING, priority); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(d.Error("cuGreenCtxStreamCreate", r));
  }
  p->stream_ = reinterpret_cast<cudaStream_t>(s);
  return p;
}

PartitionedStream::~PartitionedStream() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (context_ != nullptr) driver_->ctx_destroy(static_cast<CUgreenCtx>(context_));
}

}  // namespace wpub::gpu
