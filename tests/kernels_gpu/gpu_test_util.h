// Helpers of the GPU kernel tests: the skip-without-device guard, device upload/download over
// the RAII buffers, and byte comparisons that report the first mismatch.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/nvfp4.h"

namespace wpub::kernels::cuda::testing {

// Empty when a CUDA device is usable, else the reason (for GTEST_SKIP).
inline std::string NoCudaReason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
  if (n == 0) return "cudaGetDeviceCount returned 0";
  return "";
}

#define WPUB_REQUIRE_CUDA()                                                          \
  do {                                                                               \
    const std::string wpub_no_cuda = ::wpub::kernels::cuda::testing::NoCudaReason(); \
    if (!wpub_no_cuda.empty()) GTEST_SKIP() << "no CUDA device: " << wpub_no_cuda;   \
  } while (0)

#define WPUB_CUDA_OK(expr)                                                             \
  do {                                                                                 \
    const cudaError_t wpub_err = (expr);                                               \
    ASSERT_EQ(wpub_err, cudaSuccess) << #expr << ": " << cudaGetErrorString(wpub_err); \
  } while (0)

// expr must pass &msg (a std::string in scope) as its message argument.
#define WPUB_KERNEL_OK(expr)                                                             \
  do {                                                                                   \
    msg.clear();                                                                         \
    const ::wpub::kernels::KernelStatus wpub_st = (expr);                                \
    ASSERT_EQ(wpub_st, ::wpub::kernels::KernelStatus::kOk)                               \
        << #expr << ": " << ::wpub::kernels::KernelStatusString(wpub_st) << ": " << msg; \
  } while (0)

// A device copy of host bytes (aborts the test on failure through the returned flag).
inline DeviceBuffer Upload(const void* host, size_t bytes) {
  DeviceBuffer buf;
  if (DeviceBuffer::Create(bytes, &buf) != cudaSuccess) return DeviceBuffer();
  if (bytes != 0) cudaMemcpy(buf.data(), host, bytes, cudaMemcpyHostToDevice);
  // The tests launch on non-blocking streams, which do not wait for legacy-stream work: make
  // the copy (whose pageable DMA may still be in flight) complete first.
  cudaDeviceSynchronize();
  return buf;
}

template <class T>
DeviceBuffer Upload(const std::vector<T>& v) {
  return Upload(v.data(), v.size() * sizeof(T));
}

// A device buffer filled with `byte` (so unwritten outputs show up as mismatches).
inline DeviceBuffer Poisoned(size_t bytes, int byte = 0xA5) {
  DeviceBuffer buf;
  if (DeviceBuffer::Create(bytes, &buf) != cudaSuccess) return DeviceBuffer();
  if (bytes != 0) cudaMemset(buf.data(), byte, bytes);
  cudaDeviceSynchronize();  // see Upload: the memset must land before non-blocking-stream work
  return buf;
}

template <class T>
std::vector<T> Download(const void* dev, size_t count) {
  std::vector<T> v(count);
  if (count != 0) cudaMemcpy(v.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

inline std::string ToHex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
  return buf;
}

// "" when equal, else where and how they first differ (and how many elements differ).
template <class T>
std::string FirstMismatch(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  }
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return "";
  size_t first = got.size();
  size_t count = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (first == got.size()) first = i;
      ++count;
    }
  }
  uint64_t g = 0;
  uint64_t w = 0;
  std::memcpy(&g, &got[first], sizeof(T));
  std::memcpy(&w, &want[first], sizeof(T));
  return "element " + std::to_string(first) + ": got 0x" + ToHex(g) + " want 0x" + ToHex(w) + " (" +
         std::to_string(count) + " of " + std::to_string(got.size()) + " differ)";
}

}  // namespace wpub::kernels::cuda::testing
