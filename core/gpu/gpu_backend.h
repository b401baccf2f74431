// The GPU backend (engine::Backend): per bucket, amax/scales/quantize/pack on a compute stream
// into one of two device staging buffers, a `ready` event, then the bucket is emitted as a
// device bucket (transport::DeviceBytes, core/transport/bucket.h) through the engine's one road:
// the transport group hands it to the rollout groups (each group's broadcast waits on `ready` on
// its comm stream and records its own `done`: SGLang's and vLLM's groups read the same device
// bytes), and to host-only transports (gRPC-pull receivers) through its host
// copy, made only when they take part; meanwhile the next bucket is packed into the other
// buffer. Inputs are read in place: device pointers (CUDA IPC mappings, see ipc_cache.h)
// directly, host parts (shm, inline) after one async copy through a pinned staging area. Global
// amax and scales never leave the device; the non-finite counts and bucket checksums land in a
// small device status block read once. When non-finite weights are checked before sending, the
// first bucket is packed right behind the amax pass while the host reads the counts; nothing is
// emitted before the check passes. The phases are core/gpu/backend_run.h's.
//
// Host synchronizations per publication (all through HostSyncs, counted in hooks.syncs):
//  - exactly 2 when non-finite weights are rejected (the status read after the amax pass,
//    before anything is emitted; then the final completion, which also carries the checksums;
//    a publication rejected there drains the buckets already packed instead), 1 when the plan
//    allows non-finite weights (amax is then pipelined per bucket);
//  - plus, only when a buffer must grow (first publication, larger buckets or host inputs):
//    one per allocation or free;
//  - plus one per bucket whose host copy the transport group asked for (pull receivers take
//    part): a function of bytes, never of tensors or experts.
//
// Thread-compatible (the engine runs one publication at a time). Execute blocks until the
// publication's device work is complete or failed.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/backend.h"

namespace wpub::gpu {
namespace detail {
struct BackendResources;
class GrowBuffer;
}  // namespace detail

struct GpuBackendOptions {
  int device = 0;
  // With plan.allow_non_finite == false, compute every amax first and read the non-finite
  // counts before the first bucket is sent (nothing reaches an engine on rejection). When
  // false, amax is pipelined per bucket and a rejection happens after the transfer, before
  // commit (engines that apply buckets immediately, like SGLang, would then hold them).
  bool reject_before_send = true;
  // > 0: the compute stream (amax, quantize, pack) runs on this many of the device's SMs (a
  // green context, core/gpu/sm_partition.h; rounded up to the partition granularity), leaving
  // the others to the broadcast kernels. 0: every SM.
  int compute_sms = 0;
  // > 0: the quantize kernels of every bucket but the first (and the amax kernels when pipelined
  // per bucket) run at most this many CTAs per SM (kernels::cuda::LaunchLimits), because they
  // run while the previous bucket is broadcast (the GPU path sets 3, rollout::GpuPathOptions).
  // Measured on 2 x H200 (bench/RESULTS.md): a 1 GiB broadcast takes 2.9 ms alone, 4.1-4.3 ms
  // beside the uncapped kernels, ~3.6 ms beside capped ones; a publication (a') 0.081 -> 0.071 s
  // with 3. 0: no cap (nothing is broadcast beside the kernels, e.g. only pull receivers take
  // part). The bytes never depend on it.
  int overlap_ctas_per_sm = 0;
};

// Device-measured phases of the last publication (CUDA events; read after completion).
struct GpuTiming {
  double amax_seconds = 0;          // amax-first pass (0 when pipelined)
  double compute_seconds = 0;       // first bucket started .. last bucket packed (compute stream)
  double total_seconds = 0;         // first device work .. everything transferred
  double host_staging_seconds = 0;  // host-side copy of shm/inline parts into pinned memory
  // Host time of the publication thread (wall clock, not device time): resolving parts and
  // laying out slots before any work is enqueued; enqueueing the amax/non-finite pass; building
  // and enqueueing each bucket's work; emitting buckets (the transports' Send, host copies). When
  // their sum approaches the publication's wall clock, the host, not the device, sets the pace.
  double host_setup_seconds = 0;
  double host_checks_seconds = 0;
  double host_buckets_seconds = 0;
  double host_emit_seconds = 0;
};

class GpuBackend : public engine::Backend {
 public:
  // FAILED_PRECONDITION when the device does not exist.
  static absl::StatusOr<std::unique_ptr<GpuBackend>> Create(const GpuBackendOptions& options);
  ~GpuBackend() override;

  std::string_view name() const override { return "gpu"; }
  absl::StatusOr<engine::ExecutionResult> Execute(const engine::ExecutionPlan& plan,
                                                  const engine::ExecutionHooks& hooks) override;

  // Frees the staging buffers, scratch, arena and host bounce buffers after waiting for the
  // device (every reader of the staging buffers included: cudaFree synchronizes the device);
  // the host synchronizations this costs are not a publication's. Returns the bytes freed.
  uint64_t ReleaseMemory() override;
  uint64_t held_bytes() const override { return held_bytes_.load(std::memory_order_relaxed); }

  // Bucket checksums of the last successful Execute, index order (core/transport/checksum.h).
  const std::vector<uint64_t>& last_checksums() const { return last_checksums_; }
  const GpuTiming& last_timing() const { return last_timing_; }
  cudaStream_t compute_stream() const;

 private:
  GpuBackend(GpuBackendOptions options, std::unique_ptr<detail::BackendResources> res);
  const GpuBackendOptions options_;
  std::unique_ptr<detail::BackendResources> res_;
  std::vector<uint64_t> last_checksums_;
  GpuTiming last_timing_;
  std::atomic<uint64_t> held_bytes_{0};  // the buffers' sizes after the last Execute or release
  // Every buffer the backend grows and keeps between publications, and their sizes summed.
  std::array<detail::GrowBuffer*, 6> Buffers() const;
  uint64_t BufferBytes() const;
};

}  // namespace wpub::gpu
