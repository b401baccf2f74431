// Multi-tensor global amax with a non-finite count, and the global encode/decode scales, all
// on the device (spec "Global (per-tensor) scale").
#include <cuda_runtime.h>

#include <vector>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::kernels::cuda {
namespace detail {
namespace {

// 16-byte vectors each thread loads before reducing: 8 x 16 B = 128 B in flight per thread.
constexpr int kAmaxVecsPerThread = 8;
constexpr uint32_t kAmaxVecsPerChunk = kAmaxVecsPerThread * kThreads;
static_assert(kAmaxVecsPerChunk * 16 == 32768, "one amax chunk is 32 KiB");
// Chunks per CTA, reduced once. Alone on the GPU one chunk per CTA reads fastest; under an
// occupancy cap (beside a broadcast) the CTAs are few and each one's start, reduction and
// atomics pace the kernel, so they are paid per 4 chunks (128 KiB).
constexpr uint32_t kAmaxChunksPerCtaCapped = 4;
constexpr uint32_t kAmaxMaxVecsPerCta = kAmaxVecsPerChunk * kAmaxChunksPerCtaCapped;

struct AmaxItem {
  const uint4* data;
  uint32_t num_vecs;  // whole 16-byte vectors (a weight slice part is a multiple of 32 bytes)
  int32_t slot;
};

// An amax item is small (20 bytes with its CTA offset), so one launch carries 8x the other
// kernels' kMaxItemsPerLaunch: a list of a thousand expert matrices (a 1 GiB NVFP4 bucket's,
// 3.3 GB of bf16) is one launch instead of nine, without the gaps and tails between them.
constexpr int kAmaxItemsPerLaunch = 8 * kMaxItemsPerLaunch;

struct AmaxParams {
  AmaxItem items[kAmaxItemsPerLaunch];
  uint32_t cta_begin[kAmaxItemsPerLaunch + 1];
  int num_items;
  float* amax;
  unsigned long long* nonfinite;
  uint32_t chunks_per_cta;  // 1 or kAmaxChunksPerCtaCapped
};
static_assert(sizeof(AmaxParams) < 32764, "kernel parameters are limited to 32764 bytes");

template <ElemType kType>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ AmaxParams p) {
  const int idx = FindItem(p.cta_begin, p.num_items);
  const AmaxItem& item = p.items[idx];
  const uint32_t first =
      (blockIdx.x - p.cta_begin[idx]) * (kAmaxVecsPerChunk * p.chunks_per_cta) + threadIdx.x;

  float m = 0.0f;
  uint32_t bad = 0;
  for (uint32_t c = 0; c < p.chunks_per_cta; ++c) {
    const uint32_t base = first + c * kAmaxVecsPerChunk;
    if (base >= item.num_vecs) break;
    uint4 v[kAmaxVecsPerThread];
#pragma unroll
    for (int u = 0; u < kAmaxVecsPerThread; ++u) {
      const uint32_t i = base + u * kThreads;
      // Default caching (not streaming): a fused QDQ right after may find the data in L2.
      v[u] = i < item.num_vecs ? __ldg(item.data + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kAmaxVecsPerThread; ++u) AccumulateAmax<kType>(v[u], m, bad);
  }

  CtaAmaxAtomics<kThreads>(m, bad, p.amax + item.slot,
                           p.nonfinite != nullptr ? p.nonfinite + item.slot : nullptr);
}

__global__ void GlobalScalesKernel(const float* amax, int64_t n, float e4m3_max, float* s_enc,
                                   float* s_dec) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float enc = GlobalEncodeScale(amax[i], e4m3_max);
    if (s_enc != nullptr) s_enc[i] = enc;
    if (s_dec != nullptr) s_dec[i] = GlobalDecodeScale(enc);
  }
}

template <ElemType kType>
KernelStatus LaunchAmaxOf(const AmaxParams& params, const LaunchLimits& limits, cudaStream_t stream,
                          std::string* message) {
  size_t smem = 0;
  const KernelStatus st = PrepareOccupancyCap(AmaxKernel<kType>, limits, &smem, message);
  if (st != KernelStatus::kOk) return st;
  AmaxKernel<kType><<<dim3(params.cta_begin[params.num_items]), kThreads, smem, stream>>>(params);
  return CheckLaunch("amax kernel launch", message);
}

KernelStatus LaunchAmaxParams(ElemType type, const AmaxParams& params, const LaunchLimits& limits,
                              cudaStream_t stream, std::string* message) {
  switch (type) {
    case ElemType::kBF16:
      return LaunchAmaxOf<ElemType::kBF16>(params, limits, stream, message);
    case ElemType::kF16:
      return LaunchAmaxOf<ElemType::kF16>(params, limits, stream, message);
    case ElemType::kF32:
      return LaunchAmaxOf<ElemType::kF32>(params, limits, stream, message);
  }
  return Invalid(message, "amax: unknown input type");
}

}  // namespace
}  // namespace detail

KernelStatus LaunchAmax(const WeightDesc* weights, int num_weights, const int64_t* slot_offsets,
                        int64_t num_slots, float* amax, int64_t* nonfinite, cudaStream_t stream,
                        std::string* message, const LaunchLimits& limits) {
  using namespace detail;
  if (num_weights < 0 || (num_weights > 0 && weights == nullptr)) {
    return Invalid(message, "amax: null or negative weight list");
  }
  if (amax == nullptr || num_slots < 1) return Invalid(message, "amax: no output slots");
  int64_t next_slot = 0;
  for (int i = 0; i < num_weights; ++i) {
    const KernelStatus st = ValidateDeviceWeight(weights[i], i, kAllInputTypes, message);
    if (st != KernelStatus::kOk) return st;
    const int64_t off = slot_offsets != nullptr ? slot_offsets[i] : next_slot;
    if (off < 0 || off + weights[i].num_slices > num_slots) {
      return Invalid(message, "weight " + std::to_string(i) + ": amax slots [" +
                                  std::to_string(off) + ", " +
                                  std::to_string(off + weights[i].num_slices) +
                                  ") exceed num_slots " + std::to_string(num_slots));
    }
    next_slot = off + weights[i].num_slices;
  }
  if (num_slots >= (int64_t{1} << 31)) return Invalid(message, "amax: too many slots");

  KernelStatus st = CheckCuda(cudaMemsetAsync(amax, 0, num_slots * sizeof(float), stream),
                              "amax: zeroing the amax slots", message);
  if (st != KernelStatus::kOk) return st;
  if (nonfinite != nullptr) {
    st = CheckCuda(cudaMemsetAsync(nonfinite, 0, num_slots * sizeof(int64_t), stream),
                   "amax: zeroing the non-finite counts", message);
    if (st != KernelStatus::kOk) return st;
  }

  // One launch per element type (and per kAmaxItemsPerLaunch items); a mixed-type list costs at
  // most three launches.
  for (ElemType type : {ElemType::kBF16, ElemType::kF16, ElemType::kF32}) {
    AmaxParams params{};
    params.amax = amax;
    params.nonfinite = reinterpret_cast<unsigned long long*>(nonfinite);
    params.chunks_per_cta = limits.max_ctas_per_sm > 0 ? kAmaxChunksPerCtaCapped : 1;
    uint32_t ctas = 0;
    auto flush = [&]() -> KernelStatus {
      if (params.num_items == 0) return KernelStatus::kOk;
      params.cta_begin[params.num_items] = ctas;
      const KernelStatus s = LaunchAmaxParams(type, params, limits, stream, message);
      params.num_items = 0;
      ctas = 0;
      return s;
    };
    next_slot = 0;
    for (int i = 0; i < num_weights; ++i) {
      const WeightDesc& w = weights[i];
      const int64_t off = slot_offsets != nullptr ? slot_offsets[i] : next_slot;
      next_slot = off + w.num_slices;
      if (w.type != type) continue;
      for (int64_t s = 0; s < w.num_slices; ++s) {
        for (int p = 0; p < w.num_parts; ++p) {
          const int64_t bytes =
              w.parts[p].rows * w.parts[p].cols * static_cast<int64_t>(ElemSize(type));
          const int64_t vecs = bytes / 16;  // cols % 16 == 0: always whole vectors
          if (vecs >= (int64_t{1} << 32) - kAmaxMaxVecsPerCta) {
            return Unsupported(message, "weight " + std::to_string(i) + ": a part over 64 GiB");
          }
          const uint32_t need =
              static_cast<uint32_t>(CeilDiv(vecs, kAmaxVecsPerChunk * params.chunks_per_cta));
          if (params.num_items == kAmaxItemsPerLaunch || ctas + uint64_t{need} >= (1u << 31)) {
            st = flush();
            if (st != KernelStatus::kOk) return st;
          }
          AmaxItem& item = params.items[params.num_items];
          item.data = static_cast<const uint4*>(PartSlice(w, p, s));
          item.num_vecs = static_cast<uint32_t>(vecs);
          item.slot = static_cast<int32_t>(off + s);
          params.cta_begin[params.num_items] = ctas;
          ++params.num_items;
          ctas += need;
        }
      }
    }
    st = flush();
    if (st != KernelStatus::kOk) return st;
  }
  return KernelStatus::kOk;
}

KernelStatus LaunchAmax(const WeightDesc& weight, float* amax, int64_t* nonfinite,
                        cudaStream_t stream, std::string* message) {
  return LaunchAmax(&weight, 1, nullptr, weight.num_slices, amax, nonfinite, stream, message);
}

KernelStatus LaunchAmaxPair(const WeightDesc& gate, const WeightDesc& up, float* amax,
                            int64_t* nonfinite, cudaStream_t stream, std::string* message) {
  if (gate.num_slices != up.num_slices) {
    return detail::Invalid(message, "amax pair: gate has " + std::to_string(gate.num_slices) +
                                        " slices, up has " + std::to_string(up.num_slices));
  }
  const WeightDesc pair[2] = {gate, up};
  const int64_t offsets[2] = {0, 0};
  return LaunchAmax(pair, 2, offsets, gate.num_slices, amax, nonfinite, stream, message);
}

KernelStatus LaunchGlobalScales(const float* amax, int64_t n, int e4m3_max, float* s_enc,
                                float* s_dec, cudaStream_t stream) {
  if (n < 0 || (n > 0 && amax == nullptr) || (e4m3_max != 448 && e4m3_max != 256)) {
    return KernelStatus::kInvalidArgument;
  }
  if (n == 0 || (s_enc == nullptr && s_dec == nullptr)) return KernelStatus::kOk;
  constexpr int kScaleThreads = 128;
  const int64_t blocks = detail::CeilDiv(n, kScaleThreads);
  const unsigned grid = static_cast<unsigned>(blocks < 4096 ? blocks : 4096);
  detail::GlobalScalesKernel<<<grid, kScaleThreads, 0, stream>>>(
      amax, n, static_cast<float>(e4m3_max), s_enc, s_dec);
  return detail::CheckLaunch("global scales kernel launch", nullptr);
}

}  // namespace wpub::kernels::cuda
