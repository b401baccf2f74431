// The synthetic model in device memory of this process (the backend reads it in place), for
// the multi-GPU tests. gtest assertions report allocation and copy failures.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tests/multi_gpu/moe_fixture.h"

namespace wpub::testing {

struct DeviceModel {
  explicit DeviceModel(const ModelLayout& layout) : layout(layout) {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&ptr, layout.total_bytes), cudaSuccess);
  }
  ~DeviceModel() { cudaFree(ptr); }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;
  // The bytes of `seed` (FillHost), copied in.
  void Fill(uint64_t seed) {
    std::vector<uint8_t> host(layout.total_bytes);
    FillHost(layout, seed, host.data());
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  const uint8_t* base() const { return static_cast<const uint8_t*>(ptr); }
  const ModelLayout& layout;
  void* ptr = nullptr;
};

}  // namespace wpub::testing
