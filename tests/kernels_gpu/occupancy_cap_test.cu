// The occupancy cap of kernels/cuda (LaunchLimits): the shared-memory padding that
// PrepareOccupancyCap requests holds a kernel to exactly the asked number of CTAs per SM, as the
// CUDA occupancy calculator counts them, for kernels with and without static shared memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda/launch_util.h"
#include "tests/kernels_gpu/gpu_test_util.h"

namespace wpub::kernels::cuda::testing {
namespace {

__global__ void PlainKernel(float* out) {
  if (out != nullptr) out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

__global__ void StaticSmemKernel(float* out) {
  __shared__ float tile[2048];  // 8 KiB of static shared memory
  tile[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  if (out != nullptr) out[blockIdx.x * blockDim.x + threadIdx.x] = tile[255 - threadIdx.x];
}

template <class Kernel>
void ExpectCaps(Kernel kernel, const char* name) {
  constexpr int kThreadsPerCta = 256;
  int natural = 0;
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&natural, kernel, kThreadsPerCta, 0),
            cudaSuccess);
  for (int cap = 1; cap <= 4 && cap <= natural; ++cap) {
    size_t smem = 0;
    std::string msg;
    ASSERT_EQ(detail::PrepareOccupancyCap(kernel, LaunchLimits{cap}, &smem, &msg),
              KernelStatus::kOk)
        << msg;
    int got = 0;
    ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&got, kernel, kThreadsPerCta, smem),
              cudaSuccess);
    EXPECT_EQ(got, cap) << name << ": " << smem << " bytes of padding";
    // The launch itself is accepted with that padding.
    kernel<<<4, kThreadsPerCta, smem>>>(nullptr);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << name << " cap " << cap;
  }
  size_t none = 1;
  std::string msg;
  ASSERT_EQ(detail::PrepareOccupancyCap(kernel, LaunchLimits{}, &none, &msg), KernelStatus::kOk);
  EXPECT_EQ(none, 0u);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(OccupancyCapTest, PaddingHoldsKernelsToTheCap) {
  const std::string reason = NoCudaReason();
  if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
  ASSERT_NO_FATAL_FAILURE(ExpectCaps(PlainKernel, "plain kernel"));
  ASSERT_NO_FATAL_FAILURE(
      ExpectCaps(StaticSmemKernel, "kernel with 8 KiB of static shared memory"));
}

TEST(OccupancyCapTest, ArithmeticOnAnH100SizedSm) {
  // 228 KiB per SM, 1 KiB reserved per CTA: 2 CTAs fit and 3 do not.
  const size_t sm = 233472, reserved = 1024;
  for (const size_t static_smem : {size_t{0}, size_t{8192}}) {
    for (int cap = 1; cap <= 8; ++cap) {
      const size_t pad = detail::OccupancyCapSharedMemory(cap, sm, reserved, static_smem);
      const size_t per_cta = pad + static_smem + reserved;
      EXPECT_LE(cap * per_cta, sm) << cap;
      EXPECT_GT((cap + 1) * per_cta, sm) << cap;
    }
  }
  EXPECT_EQ(detail::OccupancyCapSharedMemory(0, sm, reserved, 0), 0u);
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
