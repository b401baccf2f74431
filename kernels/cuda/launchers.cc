// Host launchers of quantize, dequantize and fused QDQ: validate every job before enqueueing
// anything, split the jobs into work items (weight x slice x part), pack the items into kernel
// parameter blocks of up to kMaxItemsPerLaunch, and dispatch the mode's specialization.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/kernel_params.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/cuda/resident_plan.h"

namespace wpub::kernels::cuda {
namespace {

using detail::CeilDiv;
using detail::CheckCuda;
using detail::Invalid;
using detail::Unsupported;

constexpr uint32_t kMaxGridCtas = 1u << 31;

// Appends items to a parameter block and launches it whenever it fills up. Params is one of the
// *Params structs; Launch(params) enqueues it.
template <class Params, class Launch>
class ItemBatcher {
 public:
  explicit ItemBatcher(Launch launch) : launch_(launch) { params_.num_items = 0; }

  template <class Item>
  KernelStatus Add(const Item& item, uint32_t ctas) {
    if (params_.num_items == kMaxItemsPerLaunch || uint64_t{ctas_} + ctas >= kMaxGridCtas) {
      const KernelStatus st = Flush();
      if (st != KernelStatus::kOk) return st;
    }
    params_.items[params_.num_items] = item;
    params_.cta_begin[params_.num_items] = ctas_;
    ++params_.num_items;
    ctas_ += ctas;
    return KernelStatus::kOk;
  }

  KernelStatus Flush() {
    if (params_.num_items == 0) return KernelStatus::kOk;
    params_.cta_begin[params_.num_items] = ctas_;
    const KernelStatus st = launch_(params_);
    params_.num_items = 0;
    ctas_ = 0;
    return st;
  }

 private:
  Launch launch_;
  Params params_{};
  uint32_t ctas_ = 0;
};

KernelStatus CheckModeForType(QuantMode mode, std::string* message) {
  if (!mode.IsValid()) return Invalid(message, "invalid quantization mode");
  return KernelStatus::kOk;
}

// Quantize jobs of one input type, one mode.
template <class Traits>
KernelStatus EnqueueQuantize(const QuantizeJob* jobs, int num_jobs, ElemType type,
                             const LaunchLimits& limits, cudaStream_t stream,
                             std::string* message) {
  auto launch = [&](const detail::QuantParams& p) {
    return detail::LaunchQuantizeKernel<Traits>(type, p, limits, stream, message);
  };
  ItemBatcher<detail::QuantParams, decltype(launch)> batch(launch);
  for (int i = 0; i < num_jobs; ++i) {
    const QuantizeJob& job = jobs[i];
    const WeightDesc& w = job.weight;
    if (w.type != type) continue;
    const int64_t rows = w.rows();
    const int64_t kv = w.cols() / kBlockSize;
    for (int64_t s = 0; s < w.num_slices; ++s) {
      for (int p = 0; p < w.num_parts; ++p) {
        const detail::PartGeometry g = detail::PartOrigin(w, p);
        detail::QuantItem item{};
        item.in = detail::PartSlice(w, p, s);
        item.packed = job.out.packed + s * rows * kv * (kBlockSize / 2);
        item.scales = job.out.scales + s * rows * kv;
        item.swizzled = job.out.swizzled == nullptr
                            ? nullptr
                            : job.out.swizzled + s * SwizzledScaleSize(rows, kv);
        item.amax = job.amax + s;
        item.decode_scale =
            (p == 0 && job.out.decode_scale != nullptr) ? job.out.decode_scale + s : nullptr;
        item.part_rows = static_cast<uint32_t>(w.parts[p].rows);
        item.part_colblks = static_cast<uint32_t>(w.parts[p].cols / kBlockSize);
        item.row0 = static_cast<uint32_t>(g.row0);
        item.colblk0 = static_cast<uint32_t>(g.col0 / kBlockSize);
        item.rows = static_cast<uint32_t>(rows);
        item.kv = static_cast<uint32_t>(kv);
        const int64_t blocks = int64_t{item.part_rows} * item.part_colblks;
        const KernelStatus st = batch.Add(
            item, static_cast<uint32_t>(CeilDiv(blocks, detail::kQuantBlocksPerCta<Traits>)));
        if (st != KernelStatus::kOk) return st;
      }
    }
  }
  return batch.Flush();
}

template <class Traits>
KernelStatus EnqueueQdq(const QdqJob* jobs, int num_jobs, const float* const* amax_per_job,
                        ElemType type, cudaStream_t stream, std::string* message) {
  auto launch = [&](const detail::QdqParams& p) {
    return detail::LaunchQdqKernel<Traits>(type, p, stream, message);
  };
  ItemBatcher<detail::QdqParams, decltype(launch)> batch(launch);
  for (int i = 0; i < num_jobs; ++i) {
    const WeightDesc& w = jobs[i].weight;
    if (w.type != type) continue;
    const int64_t slice_elems = w.rows() * w.cols();
    const int64_t blocks = slice_elems / kBlockSize;
    for (int64_t s = 0; s < w.num_slices; ++s) {
      detail::QdqItem item{};
      item.in = detail::PartSlice(w, 0, s);
      item.out = static_cast<uint8_t*>(jobs[i].out) + s * slice_elems * 2;
      item.amax = amax_per_job[i] + s;
      item.num_blocks = static_cast<uint32_t>(blocks);
      const KernelStatus st = batch.Add(
          item, static_cast<uint32_t>(CeilDiv(blocks, detail::kQuantBlocksPerCta<Traits>)));
      if (st != KernelStatus::kOk) return st;
    }
  }
  return batch.Flush();
}

KernelStatus ValidateQdqJobs(const QdqJob* jobs, int num_jobs, bool need_amax,
                             std::string* message) {
  if (num_jobs < 0 || (num_jobs > 0 && jobs == nullptr)) {
    return Invalid(message, "QDQ: null or negative job list");
  }
  for (int i = 0; i < num_jobs; ++i) {
    const QdqJob& job = jobs[i];
    const KernelStatus st =
        detail::ValidateDeviceWeight(job.weight, i, detail::k16BitTypes, message);
    if (st != KernelStatus::kOk) return st;
    const std::string who = "weight " + std::to_string(i);
    if (job.weight.num_parts != 1) {
      return Unsupported(message, who + ": fused QDQ takes single-part weights");
    }
    if (job.out == nullptr || !detail::Aligned(job.out, detail::kVectorAlign)) {
      return Invalid(message, who + ": QDQ output is null or not 16-byte aligned");
    }
    if (need_amax && job.amax == nullptr) return Invalid(message, who + ": amax is null");
  }
  return KernelStatus::kOk;
}

KernelStatus RunQdq(const QdqJob* jobs, int num_jobs, const float* const* amax_per_job,
                    QuantMode mode, cudaStream_t stream, std::string* message) {
  for (ElemType type : {ElemType::kBF16, ElemType::kF16}) {
    const KernelStatus st = DispatchQuantMode(mode, [&]<class Traits>() {
      return EnqueueQdq<Traits>(jobs, num_jobs, amax_per_job, type, stream, message);
    });
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

size_t AlignUp256(size_t n) { return (n + 255) / 256 * 256; }

int64_t TotalSlices(const QdqJob* jobs, int num_jobs) {
  int64_t n = 0;
  for (int i = 0; i < num_jobs; ++i) n += jobs[i].weight.num_slices;
  return n;
}

// Largest slice, in grid stashes, for which kAuto takes the resident path: measured on an H200,
// 48 MiB bf16 slices (1.6 stashes) gain from it (283 vs 326 us for 8), while a slice much larger
// than the stash is read almost twice anyway.
constexpr uint64_t kAutoMaxStashes = 2;

// The resident fused QDQ (qdq_resident.cuh) of every job, one cooperative launch per element type
// and per kMaxItemsPerLaunch slices. Zeroes the whole workspace (amax, counts, barrier) first.
// kUnsupported, with nothing enqueued, where the device cannot run it, or with `only_if_fits`
// where a slice exceeds kAutoMaxStashes grid stashes.
template <class Traits>
KernelStatus RunQdqResident(const QdqJob* jobs, int num_jobs, int64_t cta_bytes, bool only_if_fits,
                            float* amax, int64_t* counts, unsigned int* barrier,
                            size_t workspace_bytes, cudaStream_t stream, std::string* message) {
  detail::ResidentLaunch shape[2];
  const ElemType types[2] = {ElemType::kBF16, ElemType::kF16};
  for (int t = 0; t < 2; ++t) {
    bool used = false;
    for (int i = 0; i < num_jobs; ++i) used = used || jobs[i].weight.type == types[t];
    if (!used) continue;
    const KernelStatus st =
        detail::PrepareQdqResident<Traits>(types[t], cta_bytes, &shape[t], message);
    if (st != KernelStatus::kOk) return st;
    if (!only_if_fits) continue;
    const uint64_t stash = uint64_t{shape[t].ctas} * shape[t].stash_blocks;
    for (int i = 0; i < num_jobs; ++i) {
      const WeightDesc& w = jobs[i].weight;
      const uint64_t blocks = static_cast<uint64_t>(w.rows() * w.cols() / kBlockSize);
      if (w.type == types[t] && blocks > kAutoMaxStashes * stash) {
        return Unsupported(message, "resident QDQ: a slice exceeds the stashes kAuto takes");
      }
    }
  }
  KernelStatus st = CheckCuda(cudaMemsetAsync(amax, 0, workspace_bytes, stream),
                              "QDQ: zeroing the workspace", message);
  if (st != KernelStatus::kOk) return st;
  uint32_t arrivals = 0;  // barrier arrivals of the launches before this one
  for (int t = 0; t < 2; ++t) {
    const detail::ResidentLaunch& rl = shape[t];
    detail::QdqResidentParams params{};
    params.stash_blocks = rl.stash_blocks;
    params.amax = amax;
    params.nonfinite = reinterpret_cast<unsigned long long*>(counts);
    params.barrier = barrier;
    int items = 0;
    auto flush = [&]() -> KernelStatus {
      if (items == 0) return KernelStatus::kOk;
      uint64_t blocks[kMaxItemsPerLaunch];
      for (int i = 0; i < items; ++i) blocks[i] = params.items[i].num_blocks;
      params.num_rounds = detail::PlanRounds(blocks, items, uint64_t{rl.ctas} * rl.stash_blocks,
                                             params.round_begin);
      params.barrier_base = arrivals;
      arrivals += static_cast<uint32_t>(params.num_rounds) * rl.ctas;
      items = 0;
      return detail::LaunchQdqResidentKernel<Traits>(types[t], params, rl, stream, message);
    };
    int64_t slot = 0;
    for (int i = 0; i < num_jobs; ++i) {
      const WeightDesc& w = jobs[i].weight;
      const int64_t slice_elems = w.rows() * w.cols();
      if (w.type != types[t]) {
        slot += w.num_slices;
        continue;
      }
      for (int64_t s = 0; s < w.num_slices; ++s, ++slot) {
        if (items == kMaxItemsPerLaunch) {
          st = flush();
          if (st != KernelStatus::kOk) return st;
        }
        detail::QdqResidentItem& item = params.items[items++];
        item.in = detail::PartSlice(w, 0, s);
        item.out = static_cast<uint8_t*>(jobs[i].out) + s * slice_elems * 2;
        item.num_blocks = static_cast<uint32_t>(slice_elems / kBlockSize);
        item.slot = static_cast<uint32_t>(slot);
      }
    }
    st = flush();
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

// The two-pass fused QDQ: per group of at most group_bytes of input (<= 0: one group), one amax
// launch, then the group's QDQ. Measured on an H200, per-weight groups meant to reuse L2 between
// the two passes were slower than one group (8 x 48 MiB bf16: 400 us vs 320 us).
KernelStatus RunQdqTwoPass(const QdqJob* jobs, int num_jobs, QuantMode mode, int64_t group_bytes,
                           float* amax, int64_t* counts, cudaStream_t stream,
                           std::string* message) {
  if (group_bytes <= 0) group_bytes = INT64_MAX;
  constexpr int kChunk = 64;
  WeightDesc weights[kChunk];
  int64_t offsets[kChunk];
  const float* amax_ptrs[kChunk];
  int64_t slot = 0;
  int begin = 0;
  while (begin < num_jobs) {
    int n = 0;
    int64_t in_group = 0;
    const int64_t first_slot = slot;
    while (begin + n < num_jobs && n < kChunk) {
      const WeightDesc& w = jobs[begin + n].weight;
      const int64_t bytes = w.num_slices * w.rows() * w.cols() * 2;
      if (n > 0 && in_group + bytes > group_bytes) break;
      weights[n] = w;
      offsets[n] = slot - first_slot;
      amax_ptrs[n] = amax + slot;
      slot += w.num_slices;
      in_group += bytes;
      ++n;
    }
    KernelStatus st = LaunchAmax(weights, n, offsets, slot - first_slot, amax + first_slot,
                                 counts + first_slot, stream, message);
    if (st != KernelStatus::kOk) return st;
    st = RunQdq(jobs + begin, n, amax_ptrs, mode, stream, message);
    if (st != KernelStatus::kOk) return st;
    begin += n;
  }
  return KernelStatus::kOk;
}

}  // namespace

KernelStatus LaunchQuantize(const QuantizeJob* jobs, int num_jobs, QuantMode mode,
                            cudaStream_t stream, std::string* message, const LaunchLimits& limits) {
  KernelStatus st = CheckModeForType(mode, message);
  if (st != KernelStatus::kOk) return st;
  if (num_jobs < 0 || (num_jobs > 0 && jobs == nullptr)) {
    return Invalid(message, "quantize: null or negative job list");
  }
  for (int i = 0; i < num_jobs; ++i) {
    const QuantizeJob& job = jobs[i];
    st = detail::ValidateDeviceWeight(job.weight, i, detail::kAllInputTypes, message);
    if (st != KernelStatus::kOk) return st;
    const std::string who = "weight " + std::to_string(i);
    if (job.amax == nullptr) return Invalid(message, who + ": amax is null");
    if (job.out.packed == nullptr || job.out.scales == nullptr) {
      return Invalid(message, who + ": packed or scales output is null");
    }
    if (!detail::Aligned(job.out.packed, detail::kVectorAlign)) {
      return Unsupported(message, who + ": packed output is not 16-byte aligned");
    }
  }
  // Zero the swizzled padding first (only layouts that have padding).
  for (int i = 0; i < num_jobs; ++i) {
    const QuantizeJob& job = jobs[i];
    if (job.out.swizzled == nullptr) continue;
    const int64_t rows = job.weight.rows();
    const int64_t kv = job.weight.cols() / kBlockSize;
    if (rows % 128 == 0 && kv % 4 == 0) continue;
    st = CheckCuda(cudaMemsetAsync(job.out.swizzled, 0,
                                   job.weight.num_slices * SwizzledScaleSize(rows, kv), stream),
                   "quantize: zeroing swizzled scale padding", message);
    if (st != KernelStatus::kOk) return st;
  }
  for (ElemType type : {ElemType::kBF16, ElemType::kF16, ElemType::kF32}) {
    st = DispatchQuantMode(mode, [&]<class Traits>() {
      return EnqueueQuantize<Traits>(jobs, num_jobs, type, limits, stream, message);
    });
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

KernelStatus LaunchDequantize(const DequantizeJob* jobs, int num_jobs, QuantMode mode,
                              cudaStream_t stream, std::string* message) {
  KernelStatus st = CheckModeForType(mode, message);
  if (st != KernelStatus::kOk) return st;
  if (num_jobs < 0 || (num_jobs > 0 && jobs == nullptr)) {
    return Invalid(message, "dequantize: null or negative job list");
  }
  for (int i = 0; i < num_jobs; ++i) {
    const DequantizeJob& job = jobs[i];
    const std::string who = "weight " + std::to_string(i);
    const QuantizedView& v = job.in;
    if (v.packed == nullptr || v.scales == nullptr || v.amax == nullptr || job.out == nullptr) {
      return Invalid(message, who + ": null packed, scales, amax or output pointer");
    }
    if (v.rows < 1 || v.cols < 1 || v.num_slices < 1) {
      return Invalid(message, who + ": non-positive extents");
    }
    if (v.cols % kBlockSize != 0) {
      return Invalid(message, who + ": last dimension " + std::to_string(v.cols) +
                                  " is not a multiple of 16 (the NVFP4 block size)");
    }
    if (job.out_type != ElemType::kBF16 && job.out_type != ElemType::kF16) {
      return Unsupported(message, who + ": dequantize writes bf16 or fp16");
    }
    if (!detail::Aligned(v.packed, 8) || !detail::Aligned(job.out, detail::kVectorAlign)) {
      return Unsupported(message, who + ": packed (8-byte) or output (16-byte) misaligned");
    }
    if (v.rows * (v.cols / kBlockSize) >= (int64_t{1} << 31)) {
      return Unsupported(message, who + ": more than 2^31 blocks per slice");
    }
  }
  for (ElemType type : {ElemType::kBF16, ElemType::kF16}) {
    auto launch = [&](const detail::DequantParams& p) {
      return detail::LaunchDequantizeKernel(type, mode.e4m3_max, p, stream, message);
    };
    ItemBatcher<detail::DequantParams, decltype(launch)> batch(launch);
    for (int i = 0; i < num_jobs; ++i) {
      const DequantizeJob& job = jobs[i];
      if (job.out_type != type) continue;
      const QuantizedView& v = job.in;
      const int64_t blocks = v.rows * (v.cols / kBlockSize);
      for (int64_t s = 0; s < v.num_slices; ++s) {
        detail::DequantItem item{};
        item.packed = v.packed + s * blocks * (kBlockSize / 2);
        item.scales = v.scales + s * blocks;
        item.amax = v.amax + s;
        item.out = static_cast<uint8_t*>(job.out) + s * blocks * kBlockSize * 2;
        item.num_blocks = static_cast<uint32_t>(blocks);
        st = batch.Add(item, static_cast<uint32_t>(CeilDiv(blocks, detail::kDequantBlocksPerCta)));
        if (st != KernelStatus::kOk) return st;
      }
    }
    st = batch.Flush();
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

KernelStatus LaunchQdq(const QdqJob* jobs, int num_jobs, QuantMode mode, cudaStream_t stream,
                       std::string* message) {
  KernelStatus st = CheckModeForType(mode, message);
  if (st != KernelStatus::kOk) return st;
  st = ValidateQdqJobs(jobs, num_jobs, /*need_amax=*/true, message);
  if (st != KernelStatus::kOk) return st;
  // The per-job amax pointers, gathered so RunQdq serves both entry points.
  constexpr int kChunk = 256;
  const float* amax[kChunk];
  for (int begin = 0; begin < num_jobs; begin += kChunk) {
    const int n = num_jobs - begin < kChunk ? num_jobs - begin : kChunk;
    for (int i = 0; i < n; ++i) amax[i] = jobs[begin + i].amax;
    st = RunQdq(jobs + begin, n, amax, mode, stream, message);
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

size_t QdqWorkspaceCountOffset(const QdqJob* jobs, int num_jobs) {
  return AlignUp256(static_cast<size_t>(TotalSlices(jobs, num_jobs)) * sizeof(float));
}

namespace {

// The grid-barrier counter of the resident path sits after the non-finite counts.
size_t QdqWorkspaceBarrierOffset(const QdqJob* jobs, int num_jobs) {
  return QdqWorkspaceCountOffset(jobs, num_jobs) +
         AlignUp256(static_cast<size_t>(TotalSlices(jobs, num_jobs)) * sizeof(int64_t));
}

}  // namespace

size_t QdqComputeAmaxWorkspaceBytes(const QdqJob* jobs, int num_jobs) {
  return QdqWorkspaceBarrierOffset(jobs, num_jobs) + 256;
}

KernelStatus LaunchQdqComputeAmax(const QdqJob* jobs, int num_jobs, QuantMode mode, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream, std::string* message,
                                  const QdqAmaxOptions& options) {
  KernelStatus st = CheckModeForType(mode, message);
  if (st != KernelStatus::kOk) return st;
  st = ValidateQdqJobs(jobs, num_jobs, /*need_amax=*/false, message);
  if (st != KernelStatus::kOk) return st;
  if (num_jobs == 0) return KernelStatus::kOk;
  const size_t need = QdqComputeAmaxWorkspaceBytes(jobs, num_jobs);
  if (workspace == nullptr || workspace_bytes < need) {
    if (message != nullptr) {
      *message = "QDQ: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                 std::to_string(need);
    }
    return KernelStatus::kWorkspaceTooSmall;
  }
  if (!detail::Aligned(workspace, 256)) return Invalid(message, "QDQ: workspace not 256-aligned");
  auto* base = static_cast<uint8_t*>(workspace);
  float* amax = static_cast<float*>(workspace);
  auto* counts = reinterpret_cast<int64_t*>(base + QdqWorkspaceCountOffset(jobs, num_jobs));
  auto* barrier = reinterpret_cast<unsigned int*>(base + QdqWorkspaceBarrierOffset(jobs, num_jobs));

  // kAuto takes the resident path where it measured faster (bench/RESULTS.md): standard NVFP4,
  // which is memory-bound, on slices up to kAutoMaxStashes grid stashes. The 4over6 modes are
  // bound by their arithmetic, which the resident kernel runs at 1 CTA per SM and not beside the
  // loads: two-pass is faster for them.
  const bool forced = options.path == QdqAmaxPath::kResident;
  if (forced || (options.path == QdqAmaxPath::kAuto && mode.algo == QuantAlgo::kStandard)) {
    std::string why;
    st = DispatchQuantMode(mode, [&]<class Traits>() {
      return RunQdqResident<Traits>(jobs, num_jobs, options.resident_cta_bytes, !forced, amax,
                                    counts, barrier, need, stream, &why);
    });
    if (st != KernelStatus::kUnsupported || forced) {
      if (st != KernelStatus::kOk && message != nullptr) *message = why;
      return st;
    }
  }
  return RunQdqTwoPass(jobs, num_jobs, mode, options.group_bytes, amax, counts, stream, message);
}

}  // namespace wpub::kernels::cuda
