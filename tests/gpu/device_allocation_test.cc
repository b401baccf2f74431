// kernels::cuda::DeviceAllocationBytes: what every device allocation asks cudaMalloc for (no GPU
// needed; the function only sizes the request).
#include <gtest/gtest.h>

#include <cstddef>

#include "kernels/cuda/cuda_raii.h"

namespace wpub::kernels::cuda {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// From 2 MiB up an allocation is whole 2 MiB pages, so a colocated engine's CUDA IPC open of it
// maps no partial page; smaller ones are asked for as they are.
TEST(DeviceAllocationBytes, RoundsAllocationsFrom2MiBUpToWholePages) {
  EXPECT_EQ(DeviceAllocationBytes(0), 0u);
  EXPECT_EQ(DeviceAllocationBytes(64), 64u);
  EXPECT_EQ(DeviceAllocationBytes(2 * kMiB - 1), 2 * kMiB - 1);
  EXPECT_EQ(DeviceAllocationBytes(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(DeviceAllocationBytes(2 * kMiB + 1), 4 * kMiB);
  EXPECT_EQ(DeviceAllocationBytes(512 * kMiB), 512 * kMiB);
  EXPECT_EQ(DeviceAllocationBytes(513 * kMiB), 514 * kMiB);  // GrowBuffer's 1 MiB steps
  EXPECT_EQ(DeviceAllocationBytes(512 * kMiB + 12340), 514 * kMiB);
  EXPECT_EQ(DeviceAllocationBytes(2049 * kMiB), 2050 * kMiB);
}

}  // namespace
}  // namespace wpub::kernels::cuda
