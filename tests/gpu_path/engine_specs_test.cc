// Parsing of the engine list wpubd takes ("url=gpus,url"), and the GPU path's clear error
// without a CUDA device (CI).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "core/nccl/gpu_path.h"

namespace wpub::nccl {
namespace {

TEST(ParseEngineSpecs, UrlsWithGpuCounts) {
  auto e = ParseEngineSpecs("http://a:30000=4, http://b:30000,http://c=1");
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->size(), 3u);
  EXPECT_EQ((*e)[0].url, "http://a:30000");
  EXPECT_EQ((*e)[0].gpus, 4);
  EXPECT_EQ((*e)[1].url, " http://b:30000");  // whitespace is the caller's (flags have none)
  EXPECT_EQ((*e)[1].gpus, 1);
  EXPECT_EQ((*e)[2].gpus, 1);
  for (const char* bad : {"", "http://a=0", "http://a=-2", "http://a=x", "=3"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseEngineSpecs(bad).status())) << bad;
  }
}

TEST(MakeGpuPathComponents, NeedsTheDevice) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  GpuPathOptions o;
  o.engines = {{"http://127.0.0.1:1", 1}};
  o.store_bind_address = "127.0.0.1";
  o.device = n;  // one past the last device
  auto c = MakeGpuPathComponents(o);
  EXPECT_FALSE(c.ok());
}

}  // namespace
}  // namespace wpub::nccl
