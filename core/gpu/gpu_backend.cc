// GPU backend: device resources (streams, events, buffers; RAII owners kept between
// publications) and one PublicationRun per Execute (backend_run.h has the phases).
#include "core/gpu/gpu_backend.h"

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/gpu/backend_run.h"
#include "core/gpu/host_syncs.h"
#include "core/gpu/sm_partition.h"
#include "core/gpu/streams.h"

namespace wpub::gpu {

absl::StatusOr<std::unique_ptr<GpuBackend>> GpuBackend::Create(const GpuBackendOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || options.device < 0 || options.device >= count) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("GPU backend: CUDA device ", options.device,
                                                      " is not present (", count, " visible)"));
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  auto res = std::make_unique<detail::BackendResources>();
  int priority = 0;
  WPUB_CUDA_RETURN_IF_ERROR(StreamPriority(StreamRole::kCompute, &priority));
  if (options.compute_sms > 0) {
    WPUB_ASSIGN_OR_RETURN(res->partition,
                          PartitionedStream::Create(options.device, options.compute_sms, priority));
    res->compute = res->partition->stream();
  } else {
    WPUB_CUDA_RETURN_IF_ERROR(
        kernels::cuda::Stream::CreateWithPriority(priority, &res->own_stream));
    res->compute = res->own_stream.get();
  }
  using kernels::cuda::Event;
  for (Event* e :
       {&res->ready[0], &res->ready[1], &res->status_ready, &res->finished, &res->bounce_ready}) {
    WPUB_CUDA_RETURN_IF_ERROR(Event::Create(/*timing=*/false, e));
  }
  for (auto& per_buffer : res->done) {
    for (Event& e : per_buffer) WPUB_CUDA_RETURN_IF_ERROR(Event::Create(/*timing=*/false, &e));
  }
  for (Event* e : {&res->t_begin, &res->t_amax, &res->t_packed, &res->t_end}) {
    WPUB_CUDA_RETURN_IF_ERROR(Event::Create(/*timing=*/true, e));
  }
  return std::unique_ptr<GpuBackend>(new GpuBackend(options, std::move(res)));
}

GpuBackend::GpuBackend(GpuBackendOptions options, std::unique_ptr<detail::BackendResources> res)
    : options_(options), res_(std::move(res)) {}
GpuBackend::~GpuBackend() = default;
cudaStream_t GpuBackend::compute_stream() const { return res_->compute; }

absl::StatusOr<engine::ExecutionResult> GpuBackend::Execute(const engine::ExecutionPlan& plan,
                                                            const engine::ExecutionHooks& hooks) {
  last_checksums_.clear();
  last_timing_ = GpuTiming();
  std::vector<uint64_t> sums;
  GpuTiming timing;
  detail::PublicationRun run(*res_, options_, plan, hooks, &timing);
  absl::StatusOr<engine::ExecutionResult> r = run.Execute(&sums);
  held_bytes_.store(BufferBytes(), std::memory_order_relaxed);
  if (r.ok()) {
    last_checksums_ = std::move(sums);
    last_timing_ = timing;
  }
  return r;
}

std::array<detail::GrowBuffer*, 6> GpuBackend::Buffers() const {
  return {&res_->staging[0], &res_->staging[1], &res_->scratch,
          &res_->arena,      &res_->host_stage, &res_->bounce};
}

uint64_t GpuBackend::BufferBytes() const {
  uint64_t bytes = 0;
  for (const detail::GrowBuffer* b : Buffers()) bytes += b->size();
  return bytes;
}

uint64_t GpuBackend::ReleaseMemory() {
  if (cudaSetDevice(options_.device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (res_->compute != nullptr) (void)cudaStreamSynchronize(res_->compute);
  engine::SyncCounter uncounted;
  HostSyncs syncs(&uncounted);
  const uint64_t freed = BufferBytes();
  for (detail::GrowBuffer* b : Buffers()) (void)b->Release(syncs);
  held_bytes_.store(BufferBytes(), std::memory_order_relaxed);
  return freed;
}

}  // namespace wpub::gpu
