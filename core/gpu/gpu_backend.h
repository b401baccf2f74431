// The GPU backend (engine::Backend): per bucket, amax/scales/quantize/pack on a compute stream
// into one of two device staging buffers, an event, then the bucket goes to a DeviceBucketSink
// (the NCCL group: broadcast on its comm stream, waiting on that event) while the next bucket
// is packed into the other buffer. Inputs are read in place: device pointers (CUDA IPC
// mappings, see ipc_cache.h) directly, host parts (shm, inline) after one async copy through a
// pinned staging area. Global amax and scales never leave the device; the non-finite counts
// and bucket checksums land in a small device status block read once. When non-finite weights
// are checked before sending, the first bucket is packed right behind the amax pass while the
// host reads the counts; nothing reaches the sink before the check passes.
//
// Host synchronizations per publication (all through HostSyncs, counted in hooks.syncs):
//  - with a sink: exactly 2 when non-finite weights are rejected (the status read after the
//    amax pass, before anything is sent; then the final completion, which also carries the
//    checksums; a publication rejected there drains the buckets already packed instead), 1
//    when the plan allows non-finite weights (amax is then pipelined per bucket);
//  - plus, only when a buffer must grow (first publication, larger buckets or host inputs):
//    one per allocation or free;
//  - without a sink (host buckets for the pull transport), or with one while pull receivers
//    take part (ExecutionHooks::host_buckets_needed: each bucket then goes to the sink AND,
//    copied to the host with Bucket::sent_direct set, through emit): one more per bucket (the
//    bucket's device-to-host copy) -- a function of bytes, never of tensors or experts.
// Buckets handed to the sink are reported through ExecutionHooks::sent_direct (bytes_out).
//
// Thread-compatible (the engine runs one publication at a time). Execute blocks until the
// publication's device work is complete or failed.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/engine/backend.h"
#include "core/gpu/device_sink.h"

namespace wpub::gpu {

struct GpuBackendOptions {
  int device = 0;
  // Device buckets go here; null: buckets are copied to pinned host memory and emitted through
  // ExecutionHooks::emit (checksum filled in), as the CPU backend does.
  DeviceBucketSink* sink = nullptr;
  // With plan.allow_non_finite == false, compute every amax first and read the non-finite
  // counts before the first bucket is sent (nothing reaches an engine on rejection). When
  // false, amax is pipelined per bucket and a rejection happens after the transfer, before
  // commit (engines that apply buckets immediately, like SGLang, would then hold them).
  bool reject_before_send = true;
  // > 0: the compute stream (amax, quantize, pack) runs on this many of the device's SMs (a
  // green context, core/gpu/sm_partition.h; rounded up to the partition granularity), leaving
  // the others to the sink's broadcast kernels. 0: every SM.
  int compute_sms = 0;
  // > 0 and a sink: the quantize kernels (and the amax kernels when pipelined per bucket) run
  // at most this many CTAs per SM (kernels::cuda::LaunchLimits), because they run while the sink
  // broadcasts the previous bucket. Measured on 2 x H200 (bench/RESULTS.md): a 1 GiB broadcast
  // takes 2.9 ms alone, 4.1-4.3 ms beside the uncapped kernels, ~3.6 ms beside capped ones; a
  // publication (a') 0.081 -> 0.071 s with 3. 0: no cap. The bytes never depend on it.
  int overlap_ctas_per_sm = 3;
};

// Device-measured phases of the last publication (CUDA events; read after completion).
struct GpuTiming {
  double amax_seconds = 0;          // amax-first pass (0 when pipelined)
  double compute_seconds = 0;       // first bucket started .. last bucket packed (compute stream)
  double total_seconds = 0;         // first device work .. everything transferred
  double host_staging_seconds = 0;  // host-side copy of shm/inline parts into pinned memory
  // Host time of the publication thread (wall clock, not device time): resolving parts and
  // laying out slots before any work is enqueued; enqueueing the amax/non-finite pass; building
  // and enqueueing each bucket's work; handing buckets to the sink (SendDevice). When their sum
  // approaches the publication's wall clock, the host, not the device, sets the pace.
  double host_setup_seconds = 0;
  double host_checks_seconds = 0;
  double host_buckets_seconds = 0;
  double host_sink_seconds = 0;
};

class GpuBackend : public engine::Backend {
 public:
  // FAILED_PRECONDITION when the device does not exist.
  static absl::StatusOr<std::unique_ptr<GpuBackend>> Create(const GpuBackendOptions& options);
  ~GpuBackend() override;

  std::string_view name() const override { return "gpu"; }
  absl::StatusOr<engine::ExecutionResult> Execute(const engine::ExecutionPlan& plan,
                                                  const engine::ExecutionHooks& hooks) override;

  // Bucket checksums of the last successful Execute, index order (core/engine/checksum.h).
  const std::vector<uint64_t>& last_checksums() const { return last_checksums_; }
  const GpuTiming& last_timing() const { return last_timing_; }
  cudaStream_t compute_stream() const;

 private:
  class Impl;
  explicit GpuBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::vector<uint64_t> last_checksums_;
  GpuTiming last_timing_;
};

}  // namespace wpub::gpu
