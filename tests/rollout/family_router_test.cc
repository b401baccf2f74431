// The family router (core/rollout/family_router.h) with fake per-family groups: a ConnectEngines
// mixing SGLang and vLLM engines reaches each family's group with its own engines, a family the
// request does not name is disconnected, a failure in one group leaves no group connected, and
// the merged snapshot shows every engine.
#include <gtest/gtest.h>

#include "core/rollout/family_router.h"

namespace wpub::rollout {
namespace {

class FakeGroup final : public FamilyConnector {
 public:
  explicit FakeGroup(std::string name) : name_(std::move(name)) {}
  absl::StatusOr<engine::RolloutGroupInfo> Connect(
      const engine::RolloutConnectRequest& r) override {
    requests.push_back(r);
    if (!fail.ok()) return fail;
    info_.group_name = name_ + "_1";
    info_.world_size = 1;
    info_.engines.clear();
    int rank = 1;
    for (const engine::RolloutEndpoint& e : r.engines) {
      info_.engines.push_back({e.url, e.gpus, rank, transport::ReceiverState::kIdle, 0, {}});
      info_.world_size += e.gpus;
      rank += e.gpus;
    }
    info_.healthy = true;
    info_.store_address = name_ + ":1";
    return info_;
  }
  engine::RolloutGroupInfo Group() const override { return info_; }
  absl::Status Disconnect() override {
    ++disconnects;
    info_.engines.clear();
    info_.healthy = false;
    return absl::OkStatus();
  }
  std::vector<engine::RolloutConnectRequest> requests;
  absl::Status fail = absl::OkStatus();
  int disconnects = 0;

 private:
  const std::string name_;
  engine::RolloutGroupInfo info_;
};

engine::RolloutConnectRequest Request(std::vector<engine::RolloutEndpoint> engines) {
  engine::RolloutConnectRequest r;
  r.engines = std::move(engines);
  r.group_name = "base";
  return r;
}

TEST(FamilyRouter, MixedEnginesReachTheirFamiliesGroups) {
  FakeGroup sglang("sglang"), vllm("vllm");
  FamilyRouter router({{"sglang", &sglang}, {"vllm", &vllm}});
  auto g = router.Connect(
      Request({{"http://s0:1", 2, ""}, {"http://v0:1", 1, "vllm"}, {"http://s1:1", 1, "sglang"}}));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(sglang.requests.size(), 1u);
  ASSERT_EQ(vllm.requests.size(), 1u);
  ASSERT_EQ(sglang.requests[0].engines.size(), 2u);
  EXPECT_EQ(sglang.requests[0].engines[1].url, "http://s1:1");
  EXPECT_EQ(sglang.requests[0].group_name, "base");
  ASSERT_EQ(vllm.requests[0].engines.size(), 1u);
  EXPECT_EQ(vllm.requests[0].engines[0].url, "http://v0:1");
  ASSERT_EQ(g->engines.size(), 3u);
  EXPECT_EQ(g->group_name, "sglang_1,vllm_1");
  EXPECT_EQ(g->store_address, "sglang:1,vllm:1");
  EXPECT_TRUE(g->healthy);
  EXPECT_EQ(g->world_size, 4 + 2);

  // vLLM engines only: the SGLang group is disconnected, the snapshot is the vLLM group's.
  g = router.Connect(Request({{"http://v1:1", 1, "vllm"}}));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(sglang.disconnects, 1);
  EXPECT_EQ(g->group_name, "vllm_1");
  ASSERT_EQ(g->engines.size(), 1u);
  EXPECT_EQ(g->engines[0].url, "http://v1:1");
}

TEST(FamilyRouter, AFailureInOneGroupLeavesNoGroupConnected) {
  FakeGroup sglang("sglang"), vllm("vllm");
  vllm.fail = absl::UnavailableError("engine http://v0:1 did not pass the vllm health check");
  FamilyRouter router({{"sglang", &sglang}, {"vllm", &vllm}});
  auto g = router.Connect(Request({{"http://s0:1", 1, "sglang"}, {"http://v0:1", 1, "vllm"}}));
  EXPECT_TRUE(absl::IsUnavailable(g.status())) << g.status();
  EXPECT_NE(g.status().message().find("http://v0:1"), std::string::npos);
  EXPECT_EQ(sglang.disconnects, 1);
  EXPECT_TRUE(router.Group().engines.empty());
}

TEST(FamilyRouter, RequestsAreValidatedFirst) {
  FakeGroup sglang("sglang");
  FamilyRouter router({{"sglang", &sglang}});
  auto g = router.Connect(Request({{"http://v0:1", 1, "vllm"}}));
  EXPECT_TRUE(absl::IsInvalidArgument(g.status()));
  EXPECT_NE(g.status().message().find("no group serves engine kind 'vllm'"), std::string::npos)
      << g.status();
  g = router.Connect(Request({{"http://x:1", 1, "trt"}}));
  EXPECT_TRUE(absl::IsInvalidArgument(g.status()));
  EXPECT_TRUE(sglang.requests.empty());
}

}  // namespace
}  // namespace wpub::rollout
