// CUDA IPC cache error paths: UUID parsing and source validation (no GPU needed), a clear
// FAILED_PRECONDITION without a device, and with a device: a handle of another GPU, a garbage
// (stale) handle, and bounds. Nothing here may crash the process.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "core/gpu/ipc_cache.h"

namespace wpub::gpu {
namespace {

engine::CudaIpcSource Source() {
  engine::CudaIpcSource s;
  for (size_t i = 0; i < s.handle.size(); ++i) s.handle[i] = static_cast<uint8_t>(i + 1);
  s.device_uuid = "GPU-0123abcd-4567-89ab-cdef-0123456789ab";
  s.offset = 0;
  s.length = 64;
  return s;
}

TEST(DeviceUuid, ParsesNvidiaSmiAndHexForms) {
  auto a = ParseDeviceUuid("GPU-0123abcd-4567-89ab-cdef-0123456789ab", "t");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)[0], 0x01);
  EXPECT_EQ((*a)[15], 0xab);
  EXPECT_EQ(FormatDeviceUuid(*a), "GPU-0123abcd-4567-89ab-cdef-0123456789ab");
  auto b = ParseDeviceUuid("0123ABCD456789ABCDEF0123456789AB", "t");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*a, *b);
  for (const char* bad : {"", "GPU-", "GPU-0123", "xyz0abcd456789abcdef0123456789ab",
                          "0123abcd456789abcdef0123456789ab00"}) {
    auto r = ParseDeviceUuid(bad, "model.layers.0.mlp.experts.3.up_proj.weight");
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << bad;
    EXPECT_NE(r.status().message().find("experts.3.up_proj"), std::string::npos);
  }
}

TEST(ValidateIpcSource, RejectsMalformedSources) {
  EXPECT_TRUE(ValidateIpcSource(Source(), 64, "t").ok());
  engine::CudaIpcSource zero = Source();
  zero.handle.fill(0);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateIpcSource(zero, 64, "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateIpcSource(Source(), 65, "t")));
  engine::CudaIpcSource wrap = Source();
  wrap.offset = UINT64_MAX - 10;
  const absl::Status s = ValidateIpcSource(wrap, 64, "w");
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  engine::CudaIpcSource uuid = Source();
  uuid.device_uuid = "not-a-uuid";
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateIpcSource(uuid, 64, "t")));
}

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

TEST(IpcCache, CreateWithoutDeviceIsAClearError) {
  if (HaveGpu()) {
    IpcCacheOptions o;
    o.device = 1000;
    auto c = IpcCache::Create(o);
    EXPECT_TRUE(absl::IsFailedPrecondition(c.status())) << c.status();
    return;
  }
  auto c = IpcCache::Create({});
  EXPECT_TRUE(absl::IsFailedPrecondition(c.status())) << c.status();
  EXPECT_NE(c.status().message().find("CUDA device 0"), std::string::npos) << c.status();
}

TEST(IpcCache, ForeignAndStaleHandlesAreErrorsNotCrashes) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto c = IpcCache::Create({});
  ASSERT_TRUE(c.ok()) << c.status();
  // A handle of another GPU (a UUID that is not this device's).
  engine::CudaIpcSource foreign = Source();
  auto r = (*c)->Resolve(foreign, 64, "model.layers.1.mlp.experts.0.down_proj.weight");
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("belongs to device"), std::string::npos) << r.status();
  // This device, but garbage handle bytes (as a handle of a freed allocation looks).
  engine::CudaIpcSource stale = Source();
  stale.device_uuid = FormatDeviceUuid((*c)->device_uuid());
  r = (*c)->Resolve(stale, 64, "stale.weight");
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("stale or foreign"), std::string::npos) << r.status();
  EXPECT_EQ((*c)->size(), 0u);
  // The runtime is still usable afterwards.
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 1024), cudaSuccess);
  cudaFree(p);
}

}  // namespace
}  // namespace wpub::gpu
