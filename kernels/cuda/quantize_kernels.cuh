// Kernel templates of quantize and fused QDQ, specialized at compile time on the input type
// and the quantization mode (Traits from nvfp4_math.h). Every block's arithmetic is
// the cheap formulation of fast_4over6.h (standard and 4over6) where a block admits it, else
// QuantizeBlockFast (fast_block.cuh: the shared QuantizeBlock of nvfp4_math.h on proven
// bit-identical primitives) and DecodeFactor, so the kernels are the CPU reference byte for byte.
// One chunk (kQuantBlocksPerCta blocks of one work item) per CTA: on an H200 this beat both a
// persistent grid-stride loop and a persistent loop that prefetches its next chunk while computing
// (by 10-15% on 1 GiB and on 128 experts): the hardware already overlaps one CTA's loads with
// another's arithmetic. Included by quantize_modes_*.cu only.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/fast_4over6.h"
#include "kernels/cuda/fast_block.cuh"
#include "kernels/cuda/kernel_params.h"
#include "kernels/cuda/launch_util.h"

namespace wpub::kernels::cuda::detail {

static_assert(kThreads == 256, "kQuantBlocksPerCta assumes 256 threads per CTA");

// Reloads one block of the input (plain load: the streaming load of the same bytes just passed).
template <ElemType kIn>
__device__ __forceinline__ void ReloadBlock(const char* block, float (&x)[kBlockSize]) {
  RawBlock<kIn> raw;
  const uint4* p = reinterpret_cast<const uint4*>(block);
#pragma unroll
  for (int i = 0; i < kVecsPerBlock<kIn>; ++i) raw.v[i] = p[i];
  Unpack<kIn>(raw, x);
}

// The step-for-step block quantizer, packed, for the rare blocks the 4over6 cheap path declines.
// Out of line, so that its registers do not cap the occupancy of the whole kernel, and fed from
// memory, so that the call site keeps no block data live across the call.
template <ElemType kIn, class Traits>
__device__ __noinline__ PackedBlock QuantizeBlockStepwise(const char* block, SliceScales ss) {
  float x[kBlockSize];
  ReloadBlock<kIn>(block, x);
  QuantBlock qb;
  QuantizeBlockFast<Traits>(x, ss, qb);
  const uint2 p = PackBlockCodes(qb);
  return PackedBlock{p.x, p.y, qb.sf};
}

// One block's packed codes and scale byte through the cheap formulations of fast_4over6.h where
// they apply (almost every block of real weights), everything else step for step
// (QuantizeBlockFast, out of line). block is x's bytes in the input.
template <ElemType kIn, class Traits>
__device__ __forceinline__ PackedBlock QuantizeBlockPackedFast(const float (&x)[kBlockSize],
                                                               const char* block,
                                                               const SliceScales& ss,
                                                               const CheapSlice& fs,
                                                               const Candidate* table) {
  PackedBlock pb;
  if constexpr (Traits::kFourOverSix) {
    if (QuantizeBlockFourOverSixCheap<Traits>(x, fs, CandidateTable{table}, pb)) return pb;
  } else {
    if (QuantizeBlockStandardCheap(x, fs, pb)) return pb;
  }
  return QuantizeBlockStepwise<kIn, Traits>(block, ss);
}

// The fused QDQ's step-for-step block: quantize, then DecodeElement with the block's factor.
template <class Traits>
__device__ __forceinline__ void QdqBlockInline(const float (&x)[kBlockSize], const SliceScales& ss,
                                               float (&y)[kBlockSize]) {
  QuantBlock qb;
  QuantizeBlockFast<Traits>(x, ss, qb);
  const float factor = FastDecodeFactor<Traits>(qb.sf, ss.amax);
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) y[i] = __fmul_rn(qb.q[i], factor);  // DecodeElement
}

// The same out of line and from memory to memory, for the blocks the 4over6 cheap path declines
// (see QuantizeBlockStepwise).
template <ElemType kType, class Traits>
__device__ __noinline__ void QdqBlockStepwise(const char* in_block, char* out_block,
                                              SliceScales ss) {
  float x[kBlockSize];
  ReloadBlock<kType>(in_block, x);
  float y[kBlockSize];
  QdqBlockInline<Traits>(x, ss, y);
  StoreBlock16<kType>(out_block, y);
}

// One block's fused QDQ through the cheap formulations where they apply, else step for step (out
// of line). Writes the block's 16 outputs to out_block.
template <ElemType kType, class Traits>
__device__ __forceinline__ void QdqBlockFast(const float (&x)[kBlockSize], const char* in_block,
                                             char* out_block, const SliceScales& ss,
                                             const CheapSlice& fs, const Candidate* table) {
  float y[kBlockSize];
  if constexpr (Traits::kFourOverSix) {
    CheapBlock cb;
    if (!FourOverSixCheapCodes<Traits>(x, fs, CandidateTable{table}, cb)) {
      QdqBlockStepwise<kType, Traits>(in_block, out_block, ss);
      return;
    }
    const float factor = FastDecodeFactor<Traits>(static_cast<uint8_t>(cb.sf), ss.amax);
    DecodeCheapBlock(cb, x, __fmul_rn(factor, 64.0f), y);
  } else {
    float q[kBlockSize];
    uint32_t sf;
    if (!StandardCheapValues(x, fs, q, sf)) {
      QdqBlockStepwise<kType, Traits>(in_block, out_block, ss);
      return;
    }
    const float factor = FastDecodeFactor<Traits>(static_cast<uint8_t>(sf), ss.amax);
    DecodeStandardCheap(q, x, __fmul_rn(factor, 64.0f), y);
  }
  StoreBlock16<kType>(out_block, y);
}

// Builds a 4over6 kernel's table of candidate constants (one entry per scale byte) in shared
// memory; every thread of the CTA must call it (it synchronizes the CTA).
template <class Traits>
__device__ __forceinline__ void BuildCandidateTable(Candidate* table, const CheapSlice& fs) {
  if constexpr (Traits::kFourOverSix) {
    if (threadIdx.x < kCandidateTableSize)
      table[threadIdx.x] = MakeCandidate<Traits>(threadIdx.x, fs);
    __syncthreads();
  }
}

// Fused QDQ kernels (16-bit inputs only) are held to 64 registers (4 CTAs of 256 threads per SM):
// left alone, ptxas gives the 4over6 FP16-error modes 72-75 since the cheap path, and the
// occupancy would drop to 3 CTAs.
inline constexpr int kQdqMinCtasPerSm = 4;

// Quantize kernels: standard and the 4over6 FP16-error modes on 16-bit inputs as the QDQ kernels;
// the 4over6 exact-error modes on 16-bit inputs held to 48 registers (5 CTAs): ptxas then keeps
// 84-88 bytes per thread in local memory, but the fifth CTA hides more of each CTA's prologue
// (slice scales, candidate table, barrier). Measured on an H200 (bench/RESULTS.md, tenth
// session): exact modes 1-4% faster at 5 CTAs, FP16-error modes 6-10% slower on 1 GiB, every
// QDQ kernel slower; 6 CTAs (40 registers, one block per thread) slower on 1 GiB and on 128
// experts. fp32 inputs carry twice the raw registers per block: standard is left to ptxas, 4over6
// held to 3 CTAs (it would take 128 registers otherwise).
template <ElemType kIn, class Traits>
inline constexpr int kQuantMinCtasPerSm =
    kIn == ElemType::kF32 ? (Traits::kFourOverSix ? 3 : 1)
                          : (Traits::kErr == ErrKind::kExact && Traits::kFourOverSix ? 5 : 4);

// One thread = kQuantBlocksPerThread blocks of 16 elements, strided by kThreads blocks so that
// each warp-wide load covers 32 consecutive blocks (1 KiB of bf16).
template <ElemType kIn, class Traits>
__global__ void __launch_bounds__(kThreads, kQuantMinCtasPerSm<kIn, Traits>)
    QuantizeKernel(const __grid_constant__ QuantParams p) {
  constexpr int kBpt = kQuantBlocksPerThread<Traits>;
  constexpr uint32_t kInBlockBytes = kBlockSize * ElemSize(kIn);
  const int idx = FindItem(p.cta_begin, p.num_items);
  const QuantItem& it = p.items[idx];
  const uint32_t num_blocks = it.part_rows * it.part_colblks;
  const uint32_t first = (blockIdx.x - p.cta_begin[idx]) * kQuantBlocksPerCta<Traits> + threadIdx.x;
  // Input loads go out first: the amax load, the two divisions of the global scales and the
  // decode-scale store would otherwise sit in front of them (the store may alias the input, so
  // the compiler cannot hoist loads above it).
  const char* in = static_cast<const char*>(it.in);
  RawBlock<kIn> raw[kBpt];
#pragma unroll
  for (int u = 0; u < kBpt; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b < num_blocks) LoadRaw<kIn>(in + uint64_t{b} * kInBlockBytes, raw[u]);
  }
  const SliceScales ss = MakeSliceScales<Traits>(*it.amax);
  const CheapSlice fs = MakeCheapSlice<Traits>(TensorScales{ss.amax, ss.s_enc, ss.s_dec});
  if (first == 0 && it.decode_scale != nullptr) *it.decode_scale = ss.s_dec;
  // 4over6: the candidate constants of every scale byte, once per CTA (see fast_4over6.h).
  __shared__ Candidate table[Traits::kFourOverSix ? kCandidateTableSize : 1];
  BuildCandidateTable<Traits>(table, fs);
  const bool dense = it.part_colblks == it.kv;
#pragma unroll
  for (int u = 0; u < kBpt; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b >= num_blocks) break;
    float x[kBlockSize];
    Unpack<kIn>(raw[u], x);
    const PackedBlock pb =
        QuantizeBlockPackedFast<kIn, Traits>(x, in + uint64_t{b} * kInBlockBytes, ss, fs, table);
    const uint8_t sf = static_cast<uint8_t>(pb.sf);

    uint64_t ob;  // block index in the slice's [rows, kv] grid
    uint32_t m = 0;
    uint32_t k = 0;
    if (dense && it.swizzled == nullptr) {
      ob = uint64_t{it.row0} * it.kv + b;
    } else {
      const uint32_t r = b / it.part_colblks;
      m = it.row0 + r;
      k = it.colblk0 + (b - r * it.part_colblks);
      ob = uint64_t{m} * it.kv + k;
    }
    *reinterpret_cast<uint2*>(it.packed + ob * (kBlockSize / 2)) = make_uint2(pb.lo, pb.hi);
    it.scales[ob] = sf;
    if (it.swizzled != nullptr) it.swizzled[SwizzledScaleIndex(m, k, it.kv)] = sf;
  }
}

// Fused QDQ: quantize one block into registers and decode it straight back; codes and scales
// never reach global memory.
template <ElemType kType, class Traits>
__global__ void __launch_bounds__(kThreads, kQdqMinCtasPerSm)
    QdqKernel(const __grid_constant__ QdqParams p) {
  constexpr int kBpt = kQuantBlocksPerThread<Traits>;
  constexpr uint32_t kBlockBytes = kBlockSize * ElemSize(kType);
  const int idx = FindItem(p.cta_begin, p.num_items);
  const QdqItem& it = p.items[idx];
  const uint32_t first = (blockIdx.x - p.cta_begin[idx]) * kQuantBlocksPerCta<Traits> + threadIdx.x;
  const char* in = static_cast<const char*>(it.in);
  char* out = static_cast<char*>(it.out);
  RawBlock<kType> raw[kBpt];
#pragma unroll
  for (int u = 0; u < kBpt; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b < it.num_blocks) LoadRaw<kType>(in + uint64_t{b} * kBlockBytes, raw[u]);
  }
  const SliceScales ss = MakeSliceScales<Traits>(*it.amax);  // after the loads, see above
  const CheapSlice fs = MakeCheapSlice<Traits>(TensorScales{ss.amax, ss.s_enc, ss.s_dec});
  __shared__ Candidate table[Traits::kFourOverSix ? kCandidateTableSize : 1];
  BuildCandidateTable<Traits>(table, fs);
#pragma unroll
  for (int u = 0; u < kBpt; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b >= it.num_blocks) break;
    float x[kBlockSize];
    Unpack<kType>(raw[u], x);
    QdqBlockFast<kType, Traits>(x, in + uint64_t{b} * kBlockBytes, out + uint64_t{b} * kBlockBytes,
                                ss, fs, table);
  }
}

// One quantize launch under `limits` (PrepareOccupancyCap).
template <ElemType kIn, class Traits>
KernelStatus LaunchQuantizeKernelOf(const QuantParams& params, const LaunchLimits& limits,
                                    cudaStream_t stream, std::string* message) {
  size_t smem = 0;
  const KernelStatus st = PrepareOccupancyCap(QuantizeKernel<kIn, Traits>, limits, &smem, message);
  if (st != KernelStatus::kOk) return st;
  QuantizeKernel<kIn, Traits>
      <<<dim3(params.cta_begin[params.num_items]), kThreads, smem, stream>>>(params);
  return CheckLaunch("quantize kernel launch", message);
}

template <class Traits>
KernelStatus LaunchQuantizeKernel(ElemType in_type, const QuantParams& params,
                                  const LaunchLimits& limits, cudaStream_t stream,
                                  std::string* message) {
  switch (in_type) {
    case ElemType::kBF16:
      return LaunchQuantizeKernelOf<ElemType::kBF16, Traits>(params, limits, stream, message);
    case ElemType::kF16:
      return LaunchQuantizeKernelOf<ElemType::kF16, Traits>(params, limits, stream, message);
    case ElemType::kF32:
      return LaunchQuantizeKernelOf<ElemType::kF32, Traits>(params, limits, stream, message);
  }
  return Invalid(message, "quantize: unknown input type");
}

template <class Traits>
KernelStatus LaunchQdqKernel(ElemType type, const QdqParams& params, cudaStream_t stream,
                             std::string* message) {
  const dim3 grid(params.cta_begin[params.num_items]);
  switch (type) {
    case ElemType::kBF16:
      QdqKernel<ElemType::kBF16, Traits><<<grid, kThreads, 0, stream>>>(params);
      break;
    case ElemType::kF16:
      QdqKernel<ElemType::kF16, Traits><<<grid, kThreads, 0, stream>>>(params);
      break;
    case ElemType::kF32:
      return Unsupported(message, "fused QDQ takes bf16 or fp16 weights");
  }
  return CheckLaunch("fused QDQ kernel launch", message);
}

// Explicit instantiation of both launchers for one mode.
#define WPUB_INSTANTIATE_QUANT_MODE(TRAITS)                                               \
  template KernelStatus LaunchQuantizeKernel<TRAITS>(                                     \
      ElemType, const QuantParams&, const LaunchLimits&, cudaStream_t, std::string*);     \
  template KernelStatus LaunchQdqKernel<TRAITS>(ElemType, const QdqParams&, cudaStream_t, \
                                                std::string*)

}  // namespace wpub::kernels::cuda::detail
