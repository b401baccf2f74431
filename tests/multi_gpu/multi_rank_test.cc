// One publisher, many receiving ranks (label multi_gpu): wpub's GPU backend + NCCL transport on
// GPU 0 publishing to C++ engines (multi_gpu_cpp_receiver: SGLang's weight-update routes over
// wpub::recv::nccl::ReceiverEndpoint) on every other visible GPU, in two layouts: one engine per
// GPU, and engines of two GPUs each (the ranks of an SGLang TP=2 engine join from its rank_offset).
// On a machine of one GPU (or with WPUB_TEST_ENGINE_GPU=0) every engine rank shares GPU 0 with the
// publisher (shared_gpu.h): 2 engines of one rank, 2 TP=2 engines (each rank a process of its
// own), 3 engines for the fault test; WPUB_TEST_SHARED_ENGINES sets how many.
//  1. Several versions; every engine's every bucket checksum (computed on each of its GPUs,
//     which must agree) equals the publisher's.
//  2. One engine killed mid-publication: the publication aborts within the deadline, the next
//     publication re-forms the group with the survivors and commits on them.
// With several GPUs: 2 for the one-engine-per-GPU layout (then a single receiving rank), 3 for the
// TP=2 layout and for the fault test (a survivor must remain); skips with the reason otherwise.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/gpu/gpu_backend.h"
#include "core/rollout/rollout_group.h"
#include "nlohmann/json.hpp"
#include "tests/multi_gpu/device_model.h"
#include "tests/multi_gpu/loopback_transport.h"
#include "tests/multi_gpu/moe_fixture.h"
#include "tests/multi_gpu/shared_gpu.h"

namespace wpub::testing {
namespace {

using json = nlohmann::json;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// GPUs 1..n-1 grouped into engines of `tp` GPUs (a last, smaller engine takes the rest).
std::vector<std::vector<int>> Engines(int devices, int tp) {
  std::vector<std::vector<int>> out;
  for (int g = 1; g < devices; g += tp) {
    out.emplace_back();
    for (int i = g; i < std::min(devices, g + tp); ++i) out.back().push_back(i);
  }
  return out;
}

// `count` engines of `tp` ranks, every rank on `gpu` (shared with the publisher).
std::vector<std::vector<int>> SharedEngines(int gpu, int count, int tp) {
  return std::vector<std::vector<int>>(static_cast<size_t>(count),
                                       std::vector<int>(static_cast<size_t>(tp), gpu));
}

// How many engines share the GPU: WPUB_TEST_SHARED_ENGINES, else `fallback`.
int SharedEngineCount(int fallback) {
  const char* v = std::getenv("WPUB_TEST_SHARED_ENGINES");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : fallback;
}

class MultiRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = DeviceCount();
    engine_gpu_ = EngineGpu();
    if (engine_gpu_ < 0) GTEST_SKIP() << "needs a CUDA device";
    shared_ = SharesPublisherGpu(engine_gpu_);
    AdoptOwnNcclHost(shared_);  // before this process's first NCCL communicator
    dir_ = TestWorkDir("wpub_multi_rank_",
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_FALSE(dir_.empty());
  }

  struct Running {
    std::vector<int> gpus;
    int port = 0;
    std::unique_ptr<Child> child;
  };

  // Starts one C++ engine per entry; `die_after[i]` > 0 makes engine i kill itself then.
  std::vector<Running> StartEngines(const std::vector<std::vector<int>>& layout,
                                    const std::vector<long>& die_after = {}) {
    std::vector<Running> out;
    for (size_t i = 0; i < layout.size(); ++i) {
      Running r;
      r.gpus = layout[i];
      r.port = FreePort();
      std::vector<std::string> args = {"device"};
      if (i < die_after.size() && die_after[i] > 0) args.push_back(std::to_string(die_after[i]));
      auto c = SpawnCppReceiver(r.port, r.gpus, args, absl::StrCat(dir_, "/engine", i, ".log"), "",
                                OwnNcclHostEnv(shared_));
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok()) return {};
      r.child = std::move(*c);
      out.push_back(std::move(r));
    }
    for (size_t i = 0; i < out.size(); ++i) {
      const absl::Status up =
          WaitForHealth(*out[i].child, out[i].port, absl::Seconds(30), absl::StrCat("engine ", i),
                        absl::StrCat(dir_, "/engine", i, ".log"));
      EXPECT_TRUE(up.ok()) << up;
    }
    return out;
  }

  std::unique_ptr<rollout::RolloutGroup> Transport(const std::vector<Running>& engines,
                                                   absl::Duration deadline, int in_flight = 1) {
    std::vector<rollout::EngineSpec> specs;
    for (const Running& r : engines) {
      specs.push_back({absl::StrCat("http://127.0.0.1:", r.port), static_cast<int>(r.gpus.size())});
    }
    rollout::RolloutGroupOptions o =
        LoopbackTransportOptions(std::move(specs), "wpub_multi_rank", in_flight, deadline);
    o.join_timeout = absl::Seconds(60);
    auto t = rollout::RolloutGroup::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }

  // Every engine's record of `version` equals what the backend sent.
  void ExpectEveryEngineGot(const std::vector<Running>& engines, uint64_t version,
                            const BuiltPlan& built, const std::vector<uint64_t>& checksums) {
    for (const Running& r : engines) {
      auto body = HttpGet(r.port, "/stats");
      ASSERT_TRUE(body.ok()) << body.status();
      json s = json::parse(*body)[std::to_string(version)];
      ASSERT_FALSE(s.is_null()) << "engine on GPUs " << absl::StrJoin(r.gpus, ",")
                                << " has no version " << version;
      EXPECT_EQ(s["bytes"].get<uint64_t>(), built.bytes_out);
      EXPECT_EQ(s["checksums"].get<std::vector<uint64_t>>(), checksums)
          << "engine on GPUs " << absl::StrJoin(r.gpus, ",");
    }
  }

  // The engines of `tp` ranks: every other GPU's, or `shared_count` on the shared GPU.
  std::vector<std::vector<int>> Layout(int tp, int shared_count) const {
    return shared_ ? SharedEngines(engine_gpu_, SharedEngineCount(shared_count), tp)
                   : Engines(devices_, tp);
  }

  void PublishVersions(int tp, int in_flight) {
    const std::vector<std::vector<int>> layout = Layout(tp, 2);
    std::vector<Running> engines = StartEngines(layout);
    ASSERT_EQ(engines.size(), layout.size());
    auto transport = Transport(engines, absl::Seconds(60), in_flight);
    ASSERT_TRUE(transport);
    gpu::GpuBackendOptions bo;
    auto backend = gpu::GpuBackend::Create(bo);
    ASSERT_TRUE(backend.ok()) << backend.status();
    const ModelLayout model_layout = LayoutModel(shape_);
    DeviceModel model(model_layout);
    for (uint64_t version = 1; version <= 3; ++version) {
      model.Fill(300 + version);
      std::vector<engine::InputTensor> inputs;
      auto built = BuildPlan(model_layout, model.base(), true, 256 << 10, version, &inputs);
      ASSERT_TRUE(built.ok()) << built.status();
      PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
      ASSERT_TRUE(r.status.ok()) << r.status;
      ASSERT_EQ(r.outcomes.size(), engines.size());
      for (const auto& o : r.outcomes) EXPECT_TRUE(o.committed) << o.name;
      ExpectEveryEngineGot(engines, version, *built, (*backend)->last_checksums());
      std::printf("TP=%d, %zu engines, world %d, %d in flight: version %lu, %zu buckets, %.3f s\n",
                  tp, engines.size(), transport->Group().world_size, in_flight,
                  static_cast<unsigned long>(version), built->manifest.buckets.size(),
                  r.wall_seconds);
    }
  }

  int devices_ = 0;
  int engine_gpu_ = -1;
  bool shared_ = false;  // every engine rank shares the publisher's GPU
  std::string dir_;
  MoeShape shape_;  // the defaults: 2 layers, 8 experts of [128, 256], hidden 256
};

// Two update requests in flight per engine: every engine orders them by wpub_sequence.
TEST_F(MultiRankTest, EveryEngineOfOneGpuGetsEveryVersion) { PublishVersions(1, 2); }

TEST_F(MultiRankTest, EveryTp2EngineGetsEveryVersionOnBothRanks) {
  if (!shared_ && devices_ < 3)
    GTEST_SKIP() << "a TP=2 engine needs GPUs 1 and 2; found " << devices_;
  PublishVersions(2, 1);
}

TEST_F(MultiRankTest, KilledEngineAbortsThenSurvivorsCommit) {
  if (!shared_ && devices_ < 3) {
    GTEST_SKIP() << "needs 2 receiving GPUs so one survives; found " << devices_;
  }
  const std::vector<std::vector<int>> layout = Layout(1, 3);
  // The first engine (GPU 1: next to rank 0 in NCCL's chain, so the others' receives stall
  // behind it) dies after 2 buckets of the first publication.
  std::vector<long> die(layout.size(), 0);
  die.front() = 2;
  std::vector<Running> engines = StartEngines(layout, die);
  ASSERT_EQ(engines.size(), layout.size());
  const absl::Duration deadline = absl::Seconds(20);
  auto transport = Transport(engines, deadline);
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok());
  const ModelLayout model_layout = LayoutModel(shape_);
  DeviceModel model(model_layout);
  model.Fill(401);
  std::vector<engine::InputTensor> inputs;
  auto built = BuildPlan(model_layout, model.base(), true, 256 << 10, 1, &inputs);
  ASSERT_TRUE(built.ok());
  ASSERT_GT(built->manifest.buckets.size(), 3u);
  PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
  EXPECT_FALSE(r.status.ok());
  EXPECT_LT(r.wall_seconds, absl::ToDoubleSeconds(deadline) + 5) << r.status;
  for (const auto& o : r.outcomes) EXPECT_FALSE(o.committed) << o.name;
  std::printf("%zu engines, one killed: aborted after %.3f s: %s\n", engines.size(), r.wall_seconds,
              r.status.ToString().c_str());
  EXPECT_FALSE(engines.front().child->Running());

  // The survivors: the next publication re-forms the group without the dead engine (their
  // receives still blocked on the old group end when it is destroyed).
  std::vector<Running> survivors;
  for (size_t i = 1; i < engines.size(); ++i) survivors.push_back(std::move(engines[i]));
  model.Fill(402);
  auto built2 = BuildPlan(model_layout, model.base(), true, 256 << 10, 2, &inputs);
  ASSERT_TRUE(built2.ok());
  r = Publish(**backend, *transport, *built2, absl::Seconds(60));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(transport->Group().generation, 2u);
  EXPECT_EQ(transport->Group().world_size, static_cast<int>(survivors.size()) + 1);
  ExpectEveryEngineGot(survivors, 2, *built2, (*backend)->last_checksums());
  std::printf("re-formed with %zu survivors (world %d): committed in %.3f s\n", survivors.size(),
              transport->Group().world_size, r.wall_seconds);
}

}  // namespace
}  // namespace wpub::testing
