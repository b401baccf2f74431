// The GPU path's clear error without a CUDA device (CI) and a receiving rank's unique-id lookup
// against wpub's TCPStore server. (The engine list syntax is tested with the SGLang driver.)
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <thread>

#include "clients/recv/nccl/group_member.h"
#include "core/rendezvous/tcp_store_server.h"
#include "core/rollout/gpu_path.h"

namespace wpub::nccl {
namespace {

TEST(MakeGpuPathComponents, NeedsTheDevice) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  rollout::GpuPathOptions o;
  o.engines = {{"http://127.0.0.1:1", 1}};
  o.store_bind_address = "127.0.0.1";
  o.device = n;  // one past the last device
  auto c = rollout::MakeGpuPathComponents(o);
  EXPECT_FALSE(c.ok());
}

TEST(FetchUniqueId, FindsTheIdUnderTheFirstTemplateThatAppears) {
  rendezvous::TcpStoreServerOptions so;
  so.bind_address = "127.0.0.1";
  auto server = rendezvous::TcpStoreServer::Create(so);
  ASSERT_TRUE(server.ok());
  wpub::recv::nccl::GroupMemberOptions o;
  o.master_port = (*server)->port();
  o.group_name = "wpub_weights_3";
  o.timeout = absl::Seconds(5);
  std::vector<uint8_t> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(255 - i);
  // The publisher sets it a little later, under the legacy layout only.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*server)->Set("/wpub_weights_3/wpub_weights_3/0", id);
  });
  auto got = wpub::recv::nccl::FetchUniqueId(o);
  setter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(std::equal(got->begin(), got->end(), id.begin()));
  EXPECT_EQ((*server)->Get("init/"), std::vector<uint8_t>({'1'}));  // torch's worker count

  o.group_name = "absent";
  o.timeout = absl::Milliseconds(200);
  auto missing = FetchUniqueId(o);
  EXPECT_TRUE(absl::IsDeadlineExceeded(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find("/absent/absent//cuda//0"), std::string::npos);

  (*server)->Set("/short/short//cuda//0", {1, 2, 3});
  o.group_name = "short";
  EXPECT_TRUE(absl::IsInvalidArgument(FetchUniqueId(o).status()));
  o.rank = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(wpub::recv::nccl::GroupMember::Join(o).status()));
}

}  // namespace
}  // namespace wpub::nccl
