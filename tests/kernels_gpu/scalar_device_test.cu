// The shared scalar arithmetic of nvfp4_math.h evaluated on the device equals the host
// evaluation bit for bit: every bf16 and fp16 bit pattern (widened) and a strided sweep of
// fp32 patterns through the E2M1/E4M3/bf16/fp16 conversions and the global scale; all 256
// E4M3 and 16 E2M1 codes through the decoders. Guards against the device compiler contracting
// or approximating what the host does in single IEEE operations.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/nvfp4_math.h"
#include "tests/kernels_gpu/gpu_test_util.h"

namespace wpub::kernels::cuda::testing {
namespace {

constexpr int kOutputsPerInput = 6;

// Input i -> fp32 value: one of the 16-bit formats widened, or raw fp32 bits.
enum class Source : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

__host__ __device__ float SourceValue(Source src, uint32_t bits) {
  if (src == Source::kBf16) return Bf16ToFloat(static_cast<uint16_t>(bits));
  if (src == Source::kFp16) return Fp16ToFloat(static_cast<uint16_t>(bits));
  return BitsFloat(bits);
}

__host__ __device__ void Evaluate(Source src, uint32_t bits, uint32_t* out) {
  const float x = SourceValue(src, bits);
  out[0] = FloatBits(x);
  out[1] = FloatToE2M1(x);
  out[2] = FloatToE4M3(x);
  out[3] = FloatToBf16(x) | (static_cast<uint32_t>(FloatToFp16(x)) << 16);
  out[4] = FloatBits(GlobalEncodeScale(x, 448.0f));
  out[5] = FloatBits(GlobalDecodeScale(GlobalEncodeScale(x, 256.0f)));
}

__global__ void EvaluateKernel(Source src, const uint32_t* bits, int64_t n, uint32_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    Evaluate(src, bits[i], out + i * kOutputsPerInput);
  }
}

__global__ void DecodeKernel(uint32_t* out) {
  const int c = threadIdx.x;  // 256 threads
  out[c] = FloatBits(E4M3ToFloat(static_cast<uint8_t>(c)));
  if (c < 16) out[256 + c] = FloatBits(E2M1ToFloat(static_cast<uint8_t>(c)));
}

void CheckSource(Source src, const std::vector<uint32_t>& bits) {
  const int64_t n = static_cast<int64_t>(bits.size());
  DeviceBuffer d_bits = Upload(bits);
  DeviceBuffer d_out = Poisoned(n * kOutputsPerInput * sizeof(uint32_t));
  EvaluateKernel<<<1024, 256>>>(src, d_bits.as<uint32_t>(), n, d_out.as<uint32_t>());
  WPUB_CUDA_OK(cudaGetLastError());
  WPUB_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> got = Download<uint32_t>(d_out.data(), n * kOutputsPerInput);
  static const char* kNames[kOutputsPerInput] = {
      "widen", "FloatToE2M1", "FloatToE4M3", "FloatToBf16|Fp16", "S_enc(448)", "S_dec(256)"};
  for (int64_t i = 0; i < n; ++i) {
    uint32_t want[kOutputsPerInput];
    Evaluate(src, bits[i], want);
    for (int k = 0; k < kOutputsPerInput; ++k) {
      uint32_t g = got[i * kOutputsPerInput + k];
      uint32_t w = want[k];
      if (k >= 4 && (g & 0x7FFFFFFFu) > 0x7F800000u && (w & 0x7FFFFFFFu) > 0x7F800000u) {
        // Global scales of a NaN amax: NaN == NaN (spec), the payloads differ (the device's
        // division returns the canonical NaN, the host's keeps the operand's).
        g = w;
      }
      ASSERT_EQ(g, w) << kNames[k] << " of input bits 0x" << ToHex(bits[i]) << " (source "
                      << static_cast<int>(src) << ")";
    }
  }
}

TEST(ScalarDeviceTest, ConversionsAndScalesMatchHostBitForBit) {
  WPUB_REQUIRE_CUDA();
  std::vector<uint32_t> all16(1u << 16);
  for (uint32_t i = 0; i < all16.size(); ++i) all16[i] = i;
  CheckSource(Source::kBf16, all16);
  CheckSource(Source::kFp16, all16);
  // fp32: a stride coprime with 2^32 visits patterns of every exponent and sign.
  std::vector<uint32_t> sweep;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099)
    sweep.push_back(static_cast<uint32_t>(b));
  for (uint32_t special : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u, 0x00000001u,
                           0x7F7FFFFFu, 0x3E800000u, 0x3F400000u, 0x40A00000u, 0x43E80000u}) {
    sweep.push_back(special);
  }
  CheckSource(Source::kFp32, sweep);

  DeviceBuffer d_dec = Poisoned(272 * 4);
  DecodeKernel<<<1, 256>>>(d_dec.as<uint32_t>());
  WPUB_CUDA_OK(cudaGetLastError());
  const std::vector<uint32_t> got = Download<uint32_t>(d_dec.data(), 272);
  for (int c = 0; c < 256; ++c) EXPECT_EQ(got[c], FloatBits(E4M3ToFloat(c))) << c;
  for (int c = 0; c < 16; ++c) EXPECT_EQ(got[256 + c], FloatBits(E2M1ToFloat(c))) << c;
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
