// Instantiates quantize and fused QDQ for standard NVFP4, and the dequantize kernels.
#include "kernels/cuda/qdq_resident.cuh"

namespace wpub::kernels::cuda::detail {

WPUB_INSTANTIATE_QUANT_MODE(StandardTraits);
WPUB_INSTANTIATE_QDQ_RESIDENT(StandardTraits);

namespace {

// One thread decodes kDequantBlocksPerThread blocks: 8 code bytes + 1 scale byte in, 16
// outputs (32 bytes) out per block.
template <ElemType kOut, int kE4M3Max>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const __grid_constant__ DequantParams p) {
  constexpr uint32_t kInvSixE = kE4M3Max == 448 ? kInv2688Bits : kInv1536Bits;
  const int idx = FindItem(p.cta_begin, p.num_items);
  const DequantItem& it = p.items[idx];
  const uint32_t first = (blockIdx.x - p.cta_begin[idx]) * kDequantBlocksPerCta + threadIdx.x;
  const float amax = *it.amax;
  uint2 packed[kDequantBlocksPerThread];
  uint8_t sf[kDequantBlocksPerThread];
#pragma unroll
  for (int u = 0; u < kDequantBlocksPerThread; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b < it.num_blocks) {
      packed[u] = __ldcs(reinterpret_cast<const uint2*>(it.packed) + b);
      sf[u] = __ldcs(it.scales + b);
    }
  }
  char* out = static_cast<char*>(it.out);
#pragma unroll
  for (int u = 0; u < kDequantBlocksPerThread; ++u) {
    const uint32_t b = first + u * kThreads;
    if (b >= it.num_blocks) break;
    uint8_t codes[kBlockSize];
    UnpackCodes(packed[u], codes);
    const float factor = DecodeFactor(sf[u], amax, kInvSixE);
    float y[kBlockSize];
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) y[i] = DecodeElement(codes[i], factor);
    StoreBlock16<kOut>(out + uint64_t{b} * 32, y);
  }
}

}  // namespace

KernelStatus LaunchDequantizeKernel(ElemType out_type, int e4m3_max, const DequantParams& params,
                                    cudaStream_t stream, std::string* message) {
  const dim3 grid(params.cta_begin[params.num_items]);
  const bool e448 = e4m3_max == 448;
  if (out_type == ElemType::kBF16) {
    if (e448) {
      DequantizeKernel<ElemType::kBF16, 448><<<grid, kThreads, 0, stream>>>(params);
    } else {
      DequantizeKernel<ElemType::kBF16, 256><<<grid, kThreads, 0, stream>>>(params);
    }
  } else if (out_type == ElemType::kF16) {
    if (e448) {
      DequantizeKernel<ElemType::kF16, 448><<<grid, kThreads, 0, stream>>>(params);
    } else {
      DequantizeKernel<ElemType::kF16, 256><<<grid, kThreads, 0, stream>>>(params);
    }
  } else {
    return Unsupported(message, "dequantize writes bf16 or fp16");
  }
  return CheckLaunch("dequantize kernel launch", message);
}

}  // namespace wpub::kernels::cuda::detail
