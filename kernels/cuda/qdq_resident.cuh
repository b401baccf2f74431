// The resident fused QDQ with computed amax: one cooperative launch that reads each weight slice
// once for its amax, keeps as much of it as the SMs' shared memory holds, waits at a grid
// barrier for the amax to be complete, and fake-quantizes from shared memory. Only what does not
// fit (the "spill") is read a second time, last in the amax pass and first in the QDQ pass so
// that it is still in L2. The two-pass path (amax kernel, then QDQ kernel) reads every element
// twice from memory: 6 bytes per bf16 element against 4 here when a round fits.
//
// Rounds: consecutive slices are grouped while they fit in the grid's shared memory
// (PlanRounds); a larger slice is a round of its own with a spill. Per round, each CTA
//   1. reads its stash share (ShareOfCta) into shared memory and its spill share, folding both
//      into the slices' amax and non-finite counts (device atomics, order independent);
//   2. arrives at the grid barrier (a counter in the caller's workspace; the cooperative launch
//      guarantees that every CTA is resident, so the wait cannot deadlock);
//   3. fake-quantizes its spill share from memory and its stash share from shared memory with the
//      same block functions as QdqKernel (quantize_kernels.cuh), hence the same bytes.
// Included by quantize_modes_*.cu only.
#pragma once

#include <cuda_runtime.h>
#include <cuda/atomic>

#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/cuda/resident_plan.h"

namespace wpub::kernels::cuda::detail {

// One CTA per SM, so the whole SM's shared memory is one CTA's stash: 1024 threads (64 registers
// each) for standard NVFP4; 768 (80 registers) for 4over6, whose block arithmetic would spill at
// 64 with the loop state of this kernel around it.
template <class Traits>
inline constexpr int kResidentThreads = Traits::kFourOverSix ? 768 : 1024;
// Blocks per thread per batch of loads in the amax pass (all issued before any is used).
inline constexpr int kResidentUnroll = 4;

// Waits until `target` arrivals (this one included) have reached the counter. Every CTA of the
// grid must call it the same number of times.
__device__ __forceinline__ void GridBarrier(unsigned int* counter, unsigned int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<unsigned int, ::cuda::thread_scope_device> arrived(*counter);
    __threadfence();
    arrived.fetch_add(1u, ::cuda::memory_order_release);
    while (arrived.load(::cuda::memory_order_acquire) < target) __nanosleep(100);
    __threadfence();
  }
  __syncthreads();
}

// Calls fn(item, b0, b1, flat) for every piece of the range [lo, hi) of a round's concatenated
// slices (items i0..i1): blocks [b0, b1) of `item`, which start at `flat` in the round. Block
// indices of a round fit in 32 bits: a round is one slice (< 2^31 blocks, ValidateDeviceWeight)
// or at most the grid's stash.
template <class Fn>
__device__ __forceinline__ void ForEachSegment(const QdqResidentParams& p, int i0, int i1,
                                               uint32_t lo, uint32_t hi, Fn fn) {
  uint32_t start = 0;
  for (int i = i0; i < i1 && start < hi; ++i) {
    const uint32_t end = start + p.items[i].num_blocks;
    if (end > lo) {
      const uint32_t b0 = (lo > start ? lo : start) - start;
      const uint32_t b1 = (hi < end ? hi : end) - start;
      if (b0 < b1) fn(i, b0, b1, start + b0);
    }
    start = end;
  }
}

// Pass 1 over blocks [b0, b1) of one slice: amax and non-finite count into the slice's slots
// (every thread of the CTA must call it: the reduction synchronizes the CTA). With kStash the raw
// blocks also go to the stash planes, block b at index b - b0 (two planes of 16-byte vectors keep
// the warp's shared-memory stores free of bank conflicts).
template <ElemType kType, bool kStash, int kCtaThreads>
__device__ __forceinline__ void AmaxPass(const char* in, uint32_t b0, uint32_t b1, uint4* plane0,
                                         uint4* plane1, float* amax,
                                         unsigned long long* bad_count) {
  constexpr uint32_t kBlockBytes = kBlockSize * ElemSize(kType);
  float m = 0.0f;
  uint32_t bad = 0;
  for (uint32_t base = b0 + threadIdx.x; base < b1; base += kResidentUnroll * kCtaThreads) {
    RawBlock<kType> raw[kResidentUnroll];
#pragma unroll
    for (int u = 0; u < kResidentUnroll; ++u) {
      const uint32_t b = base + u * kCtaThreads;
      if (b >= b1) break;
      const uint4* src = reinterpret_cast<const uint4*>(in + uint64_t{b} * kBlockBytes);
      // Stashed blocks are not read from memory again (streaming, evict first); spilled ones are
      // (default caching, so the QDQ pass finds them in L2).
#pragma unroll
      for (int v = 0; v < kVecsPerBlock<kType>; ++v)
        raw[u].v[v] = kStash ? __ldcs(src + v) : src[v];
    }
#pragma unroll
    for (int u = 0; u < kResidentUnroll; ++u) {
      const uint32_t b = base + u * kCtaThreads;
      if (b >= b1) break;
#pragma unroll
      for (int v = 0; v < kVecsPerBlock<kType>; ++v) AccumulateAmax<kType>(raw[u].v[v], m, bad);
      if constexpr (kStash) {
        plane0[b - b0] = raw[u].v[0];
        plane1[b - b0] = raw[u].v[1];
      }
    }
  }
  // One atomic per CTA and slice (per-warp atomics on one address queue up at its L2 slice).
  CtaAmaxAtomics<kCtaThreads>(m, bad, amax, bad_count);
}

// Pass 2 over blocks [b0, b1) of one slice with its complete amax: fused QDQ (QdqBlockFast) of
// blocks read from the stash planes (kStash) or from memory, as many per thread per batch of
// loads as QdqKernel takes (4over6 holds fewer raw blocks: its arithmetic needs the registers).
template <ElemType kType, class Traits, bool kStash>
__device__ __forceinline__ void QdqPass(const char* in, char* out, uint32_t b0, uint32_t b1,
                                        const uint4* plane0, const uint4* plane1, float amax,
                                        Candidate* table) {
  constexpr uint32_t kBlockBytes = kBlockSize * ElemSize(kType);
  constexpr int kUnroll = kQuantBlocksPerThread<Traits>;
  const SliceScales ss = MakeSliceScales<Traits>(amax);
  const CheapSlice fs = MakeCheapSlice<Traits>(TensorScales{ss.amax, ss.s_enc, ss.s_dec});
  if constexpr (Traits::kFourOverSix) __syncthreads();  // the previous slice's readers are done
  BuildCandidateTable<Traits>(table, fs);
  for (uint32_t base = b0 + threadIdx.x; base < b1; base += kUnroll * kResidentThreads<Traits>) {
    RawBlock<kType> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t b = base + u * kResidentThreads<Traits>;
      if (b >= b1) break;
      if constexpr (kStash) {
        raw[u].v[0] = plane0[b - b0];
        raw[u].v[1] = plane1[b - b0];
      } else {
        LoadRaw<kType>(in + uint64_t{b} * kBlockBytes, raw[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t b = base + u * kResidentThreads<Traits>;
      if (b >= b1) break;
      float x[kBlockSize];
      Unpack<kType>(raw[u], x);
      QdqBlockFast<kType, Traits>(x, in + uint64_t{b} * kBlockBytes,
                                  out + uint64_t{b} * kBlockBytes, ss, fs, table);
    }
  }
}

template <ElemType kType, class Traits>
__global__ void __launch_bounds__(kResidentThreads<Traits>, 1)
    QdqResidentKernel(const __grid_constant__ QdqResidentParams p) {
  static_assert(kVecsPerBlock<kType> == 2, "the resident QDQ takes 16-bit types");
  extern __shared__ uint4 stash[];
  __shared__ Candidate table[Traits::kFourOverSix ? kCandidateTableSize : 1];
  uint4* plane0 = stash;
  uint4* plane1 = stash + p.stash_blocks;
  unsigned int target = p.barrier_base;
  for (int r = 0; r < p.num_rounds; ++r) {
    const int i0 = static_cast<int>(p.round_begin[r]);
    const int i1 = static_cast<int>(p.round_begin[r + 1]);
    uint32_t n = 0;
    for (int i = i0; i < i1; ++i) n += p.items[i].num_blocks;
    const ResidentShare share = ShareOfCta(n, gridDim.x, p.stash_blocks, blockIdx.x);
    const uint32_t stash_begin = static_cast<uint32_t>(share.stash_begin);
    const uint32_t stash_end = static_cast<uint32_t>(share.stash_end);
    const uint32_t spill_begin = static_cast<uint32_t>(share.spill_begin);
    const uint32_t spill_end = static_cast<uint32_t>(share.spill_end);
    auto in_of = [&](int i) { return static_cast<const char*>(p.items[i].in); };
    auto out_of = [&](int i) { return static_cast<char*>(p.items[i].out); };
    auto bad_of = [&](int i) {
      return p.nonfinite != nullptr ? p.nonfinite + p.items[i].slot : nullptr;
    };

    ForEachSegment(
        p, i0, i1, stash_begin, stash_end, [&](int i, uint32_t b0, uint32_t b1, uint32_t flat) {
          const uint32_t at = flat - stash_begin;
          AmaxPass<kType, true, kResidentThreads<Traits>>(
              in_of(i), b0, b1, plane0 + at, plane1 + at, p.amax + p.items[i].slot, bad_of(i));
        });
    ForEachSegment(p, i0, i1, spill_begin, spill_end,
                   [&](int i, uint32_t b0, uint32_t b1, uint32_t) {
                     AmaxPass<kType, false, kResidentThreads<Traits>>(
                         in_of(i), b0, b1, nullptr, nullptr, p.amax + p.items[i].slot, bad_of(i));
                   });
    target += gridDim.x;
    GridBarrier(p.barrier, target);
    ForEachSegment(p, i0, i1, spill_begin, spill_end,
                   [&](int i, uint32_t b0, uint32_t b1, uint32_t) {
                     QdqPass<kType, Traits, false>(in_of(i), out_of(i), b0, b1, nullptr, nullptr,
                                                   __ldcg(p.amax + p.items[i].slot), table);
                   });
    ForEachSegment(
        p, i0, i1, stash_begin, stash_end, [&](int i, uint32_t b0, uint32_t b1, uint32_t flat) {
          const uint32_t at = flat - stash_begin;
          QdqPass<kType, Traits, true>(in_of(i), out_of(i), b0, b1, plane0 + at, plane1 + at,
                                       __ldcg(p.amax + p.items[i].slot), table);
        });
    __syncthreads();  // the stash is refilled by the next round
  }
}

template <ElemType kType, class Traits>
KernelStatus PrepareQdqResidentOf(int64_t cta_bytes, ResidentLaunch* out, std::string* message) {
  const void* fn = reinterpret_cast<const void*>(QdqResidentKernel<kType, Traits>);
  int device = 0, sms = 0, optin = 0, coop = 0;
  cudaFuncAttributes attr{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, fn);
  KernelStatus st = CheckCuda(err, "resident QDQ: device and kernel attributes", message);
  if (st != KernelStatus::kOk) return st;
  if (coop == 0) return Unsupported(message, "resident QDQ: the device has no cooperative launch");
  const int64_t most = int64_t{optin} - static_cast<int64_t>(attr.sharedSizeBytes);
  const int64_t want = cta_bytes > 0 && cta_bytes < most ? cta_bytes : most;
  constexpr int64_t kStashBlockBytes = kBlockSize * 2;
  const int64_t blocks = want / kStashBlockBytes / int64_t{kResidentAlign} * kResidentAlign;
  if (blocks < int64_t{kResidentAlign}) {
    return Unsupported(message, "resident QDQ: less than one stash share of shared memory");
  }
  err =
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most));
  int per_sm = 0;
  const size_t smem = static_cast<size_t>(blocks * kStashBlockBytes);
  if (err == cudaSuccess) {
    err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kResidentThreads<Traits>, smem);
  }
  st = CheckCuda(err, "resident QDQ: shared memory and occupancy", message);
  if (st != KernelStatus::kOk) return st;
  if (per_sm < 1) return Unsupported(message, "resident QDQ: the kernel cannot be resident");
  out->ctas = static_cast<uint32_t>(sms * per_sm);
  out->stash_blocks = static_cast<uint32_t>(blocks);
  out->smem = smem;
  return KernelStatus::kOk;
}

template <class Traits>
KernelStatus PrepareQdqResident(ElemType type, int64_t cta_bytes, ResidentLaunch* out,
                                std::string* message) {
  switch (type) {
    case ElemType::kBF16:
      return PrepareQdqResidentOf<ElemType::kBF16, Traits>(cta_bytes, out, message);
    case ElemType::kF16:
      return PrepareQdqResidentOf<ElemType::kF16, Traits>(cta_bytes, out, message);
    case ElemType::kF32:
      break;
  }
  return Unsupported(message, "fused QDQ takes bf16 or fp16 weights");
}

template <ElemType kType, class Traits>
KernelStatus LaunchQdqResidentOf(const QdqResidentParams& params, const ResidentLaunch& launch,
                                 cudaStream_t stream, std::string* message) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(launch.ctas);
  cfg.blockDim = dim3(kResidentThreads<Traits>);
  cfg.dynamicSmemBytes = launch.smem;
  cfg.stream = stream;
  cudaLaunchAttribute coop{};
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  cfg.attrs = &coop;
  cfg.numAttrs = 1;
  return CheckCuda(cudaLaunchKernelEx(&cfg, QdqResidentKernel<kType, Traits>, params),
                   "resident QDQ kernel launch", message);
}

template <class Traits>
KernelStatus LaunchQdqResidentKernel(ElemType type, const QdqResidentParams& params,
                                     const ResidentLaunch& launch, cudaStream_t stream,
                                     std::string* message) {
  switch (type) {
    case ElemType::kBF16:
      return LaunchQdqResidentOf<ElemType::kBF16, Traits>(params, launch, stream, message);
    case ElemType::kF16:
      return LaunchQdqResidentOf<ElemType::kF16, Traits>(params, launch, stream, message);
    case ElemType::kF32:
      break;
  }
  return Unsupported(message, "fused QDQ takes bf16 or fp16 weights");
}

// Explicit instantiation of the resident launchers for one mode.
#define WPUB_INSTANTIATE_QDQ_RESIDENT(TRAITS)                                          \
  template KernelStatus PrepareQdqResident<TRAITS>(ElemType, int64_t, ResidentLaunch*, \
                                                   std::string*);                      \
  template KernelStatus LaunchQdqResidentKernel<TRAITS>(                               \
      ElemType, const QdqResidentParams&, const ResidentLaunch&, cudaStream_t, std::string*)

}  // namespace wpub::kernels::cuda::detail
