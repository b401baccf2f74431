// Probe kernels for counting the SASS instructions one 16-element block costs (compiled to a
// cubin by sass_count.sh, never linked): each kernel quantizes kN bf16 blocks per thread with one
// block routine, so the instruction count of the kN = 2 kernel minus that of the kN = 1 kernel
// is the routine's cost per block, loads, unpacking and stores included, the per-kernel prologue
// excluded.
//   ProbeCheap:    4over6 through fast_4over6.h (the cheap path; declined blocks store zeros).
//   ProbeStepwise: the step-for-step path of fast_block.cuh (QuantizeBlockFast + packing), with
//                  the slice's fast division assumed, i.e. the 4over6 path before fast_4over6.h.
#include <cuda_runtime.h>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/fast_4over6.h"
#include "kernels/cuda/fast_block.cuh"

namespace wpub::kernels::cuda::detail {

template <class Traits, int kN>
__global__ void ProbeCheap(const char* in, uint2* packed, uint8_t* scales, const float* amax) {
  const CheapSlice fs = MakeCheapSlice<Traits>(MakeTensorScales(*amax, Traits::kE4M3Max));
  __shared__ Candidate table[kCandidateTableSize];
  if (threadIdx.x < kCandidateTableSize)
    table[threadIdx.x] = MakeCandidate<Traits>(threadIdx.x, fs);
  __syncthreads();
  const uint32_t first = blockIdx.x * kN * 256 + threadIdx.x;
  RawBlock<ElemType::kBF16> raw[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) LoadRaw<ElemType::kBF16>(in + (first + u * 256) * 32ull, raw[u]);
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    float x[kBlockSize];
    Unpack<ElemType::kBF16>(raw[u], x);
    PackedBlock pb{0, 0, 0};
    if (!QuantizeBlockFourOverSixCheap<Traits>(x, fs, CandidateTable{table}, pb)) {
      pb = PackedBlock{0, 0, 0};
    }
    packed[first + u * 256] = make_uint2(pb.lo, pb.hi);
    scales[first + u * 256] = static_cast<uint8_t>(pb.sf);
  }
}

template <class Traits, int kN>
__global__ void ProbeStepwise(const char* in, uint2* packed, uint8_t* scales, const float* amax) {
  SliceScales ss = MakeSliceScales<Traits>(*amax);
  ss.fast_div = true;
  const uint32_t first = blockIdx.x * kN * 256 + threadIdx.x;
  RawBlock<ElemType::kBF16> raw[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) LoadRaw<ElemType::kBF16>(in + (first + u * 256) * 32ull, raw[u]);
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    float x[kBlockSize];
    Unpack<ElemType::kBF16>(raw[u], x);
    QuantBlock qb;
    QuantizeBlockFast<Traits>(x, ss, qb);
    packed[first + u * 256] = PackBlockCodes(qb);
    scales[first + u * 256] = qb.sf;
  }
}

#define WPUB_PROBE(TRAITS)                                                                        \
  template __global__ void ProbeCheap<TRAITS, 1>(const char*, uint2*, uint8_t*, const float*);    \
  template __global__ void ProbeCheap<TRAITS, 2>(const char*, uint2*, uint8_t*, const float*);    \
  template __global__ void ProbeStepwise<TRAITS, 1>(const char*, uint2*, uint8_t*, const float*); \
  template __global__ void ProbeStepwise<TRAITS, 2>(const char*, uint2*, uint8_t*, const float*)

using Mse448Exact = FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kExact>;
using Mae256Exact = FourOverSixTraits<ErrMetric::kMAE, 256, ErrKind::kExact>;
using Mse448Fp16 = FourOverSixTraits<ErrMetric::kMSE, 448, ErrKind::kFP16>;
using Mae448Fp16 = FourOverSixTraits<ErrMetric::kMAE, 448, ErrKind::kFP16>;
WPUB_PROBE(Mse448Exact);
WPUB_PROBE(Mae256Exact);
WPUB_PROBE(Mse448Fp16);
WPUB_PROBE(Mae448Fp16);

}  // namespace wpub::kernels::cuda::detail
