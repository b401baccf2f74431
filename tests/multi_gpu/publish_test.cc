// Multi-GPU tests of the GPU publication path (label multi_gpu; skipped with a reason without a
// GPU or without python3+torch): wpub's GPU backend + NCCL transport on GPU 0 publishing to the
// SGLang emulator (torch.distributed as SGLang uses it) on EngineGpu() -- GPU 1 when there are
// two, else GPU 0 itself, every process then with a host identity of its own (shared_gpu.h).
//  1. A synthetic MoE read in place from trainer-owned memory (CUDA IPC), several versions,
//     every tensor byte-compared by the emulator with the CPU reference's buckets.
//  2. Non-finite weights are rejected before any bucket is sent.
//  3. The receiver dies mid-publication: the publication aborts within the deadline, the daemon
//     side keeps working, and the next version commits to a restarted receiver.
//  4. Host syncs per publication are the same for 8 and 128 experts per layer.
//  5. The same through the real engine (core/engine with EngineComponents: the GPU backend and
//     the NCCL transport), inline inputs with TP-shard parts and expert stacks, every tensor
//     checked by name against the engine tests' oracle; and 6. with every part a CUDA IPC
//     reference into a trainer process's allocation (rollout::MakeGpuPathComponents, as wpubd).
//  7. A C++ receiver (wpub::recv::nccl::GroupMember behind SGLang's routes) instead of the
//  emulator: wpub
//     end to end without Python, every bucket's checksum equal to the publisher's.
//  8. A C++ receiver that keeps its weights (wpub-recv --engine_patches) taking each version
//     after the first as format 3 bucket patches made on the device against the retained copy,
//     holding what a receiver of whole versions holds; restarted, it gets whole buckets again.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/cpu_backend.h"
#include "core/engine/engine.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/ipc_cache.h"
#include "core/gpu/retained_memory.h"
#include "core/rollout/gpu_path.h"
#include "core/rollout/rollout_group.h"
#include "nlohmann/json.hpp"
#include "tests/engine/engine_test_util.h"
#include "tests/multi_gpu/device_model.h"
#include "tests/multi_gpu/loopback_transport.h"
#include "tests/multi_gpu/moe_fixture.h"
#include "tests/multi_gpu/shared_gpu.h"

namespace wpub::testing {
namespace {

using json = nlohmann::json;

class MultiGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_gpu_ = EngineGpu();
    if (engine_gpu_ < 0) GTEST_SKIP() << "needs a CUDA device";
    shared_ = SharesPublisherGpu(engine_gpu_);
    AdoptOwnNcclHost(shared_);  // before this process's first NCCL communicator
    if (std::system((Python() + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
      GTEST_SKIP() << Python() << " with torch is not available (set WPUB_PYTHON)";
    }
    dir_ = TestWorkDir("wpub_multi_gpu_",
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_FALSE(dir_.empty());
  }

  std::unique_ptr<Child> Emulator(int port, std::vector<std::string> extra) {
    // A short store/NCCL timeout makes a rendezvous problem show in the emulator's log (torch
    // names the key it waited for) well within the test's deadline.
    extra.insert(extra.end(), {"--nccl-timeout", "30"});
    auto e = StartEmulator(port, engine_gpu_, extra, absl::StrCat(dir_, "/emulator_", port, ".log"),
                           OwnNcclHostEnv(shared_));
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  std::unique_ptr<rollout::RolloutGroup> Transport(int port, absl::Duration deadline,
                                                   int in_flight = 1, int nccl_ctas = 0) {
    rollout::RolloutGroupOptions o = LoopbackTransportOptions(
        {{absl::StrCat("http://127.0.0.1:", port), 1}}, "wpub_test", in_flight, deadline);
    o.join_timeout = absl::Seconds(60);
    o.nccl_ctas = nccl_ctas;
    auto t = rollout::RolloutGroup::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }

  // A C++ engine serving `port` on the engine GPU (SpawnCppReceiver's `args`), answering /health.
  absl::StatusOr<std::unique_ptr<Child>> StartCppReceiver(int port,
                                                          const std::vector<std::string>& args,
                                                          const std::string& log) {
    WPUB_ASSIGN_OR_RETURN(
        std::unique_ptr<Child> child,
        SpawnCppReceiver(port, {engine_gpu_}, args, log, "", OwnNcclHostEnv(shared_)));
    WPUB_RETURN_IF_ERROR(WaitForHealth(*child, port, absl::Seconds(30), "the C++ engine", log));
    return child;
  }

  // The CPU reference's buckets for `seed`, written where the emulator looks for them.
  std::vector<uint64_t> WriteExpected(const ModelLayout& layout, uint64_t seed, uint64_t version,
                                      uint64_t bucket_bytes) {
    std::vector<uint8_t> host(layout.total_bytes);
    FillHost(layout, seed, host.data());
    std::vector<engine::InputTensor> inputs;
    auto built = BuildPlan(layout, host.data(), true, bucket_bytes, version, &inputs);
    EXPECT_TRUE(built.ok()) << built.status();
    const std::string vdir = absl::StrCat(dir_, "/v", version);
    ::mkdir(vdir.c_str(), 0755);
    std::vector<uint64_t> sums;
    auto cpu = engine::CpuBackend::Create({4});
    engine::SyncCounter syncs;
    engine::ExecutionHooks hooks;
    hooks.syncs = &syncs;
    hooks.emit = [&](std::shared_ptr<const transport::Bucket> b) {
      std::ofstream f(absl::StrCat(vdir, "/bucket", b->manifest.index, ".bin"), std::ios::binary);
      f.write(reinterpret_cast<const char*>(b->bytes.data()),
              static_cast<std::streamsize>(b->bytes.size()));
      sums.push_back(b->manifest.checksum);
      return absl::OkStatus();
    };
    EXPECT_TRUE((*cpu)->Execute(built->plan, hooks).ok());
    return sums;
  }

  // The expected bytes of every tensor of `version`, by name, where the emulator looks for them
  // (<dir>/v<version>/tensors/<name>.bin).
  template <typename Tensors>
  void WriteExpectedTensors(uint64_t version, const Tensors& expected) {
    const std::string tdir = absl::StrCat(dir_, "/v", version);
    ::mkdir(tdir.c_str(), 0755);
    ::mkdir((tdir + "/tensors").c_str(), 0755);
    for (const auto& [name, bytes] : expected) {
      std::ofstream(tdir + "/tensors/" + name + ".bin", std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()),
                 static_cast<std::streamsize>(bytes.size()));
    }
  }

  // The emulator's record of `version`.
  json Stats(int port, uint64_t version) {
    auto body = HttpGet(port, "/stats");
    EXPECT_TRUE(body.ok()) << body.status();
    if (!body.ok()) return json();
    json j = json::parse(*body);
    const std::string v = std::to_string(version);
    return j["versions"].contains(v) ? j["versions"][v] : json();
  }

  void ExpectDelivered(int port, const BuiltPlan& built) {
    json s = Stats(port, built.manifest.version);
    ASSERT_FALSE(s.is_null()) << "the emulator saw no bucket of version " << built.manifest.version;
    EXPECT_EQ(s["buckets"].get<size_t>(), built.manifest.buckets.size());
    EXPECT_EQ(s["checked"].get<size_t>(), built.plan.outputs.size());
    EXPECT_EQ(s["bytes"].get<uint64_t>(), built.bytes_out);
    EXPECT_TRUE(s["mismatches"].empty()) << s["mismatches"].dump(1);
  }

  std::string dir_;
  int engine_gpu_ = -1;
  bool shared_ = false;  // the engines share the publisher's GPU
  MoeShape shape_;       // the defaults: 2 layers, 8 experts of [128, 256], hidden 256
};

TEST_F(MultiGpuTest, EveryByteFromTrainerIpcMemoryReachesTheEngine) {
  const int port = FreePort();
  auto emulator = Emulator(port, {"--expect-dir", dir_});
  ASSERT_TRUE(emulator);
  auto trainer = Child::Spawn(
      {SiblingBinary("multi_gpu_ipc_trainer"), "0", std::to_string(shape_.layers),
       std::to_string(shape_.experts), std::to_string(shape_.hidden), std::to_string(shape_.inter)},
      dir_ + "/trainer.log", true);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto ready = (*trainer)->ReadLine(absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status();
  std::istringstream is(*ready);
  std::string word, hex, uuid;
  uint64_t total = 0;
  is >> word >> hex >> uuid >> total;
  ASSERT_EQ(word, "ready");
  ASSERT_EQ(hex.size(), 128u);
  const ModelLayout layout = LayoutModel(shape_);
  ASSERT_EQ(total, layout.total_bytes);

  auto cache = gpu::IpcCache::Create({});
  ASSERT_TRUE(cache.ok()) << cache.status();
  engine::CudaIpcSource src;
  for (size_t i = 0; i < 64; ++i) src.handle[i] = std::stoi(hex.substr(2 * i, 2), nullptr, 16);
  src.device_uuid = uuid;

  auto transport = Transport(port, absl::Seconds(60));
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok()) << backend.status();

  const uint64_t bucket_bytes = 256 << 10;
  for (uint64_t version = 1; version <= 3; ++version) {
    const uint64_t seed = 100 + version;
    ASSERT_TRUE((*trainer)->WriteLine(absl::StrCat("fill ", seed)).ok());
    auto filled = (*trainer)->ReadLine(absl::Seconds(60));
    ASSERT_TRUE(filled.ok()) << filled.status();
    const std::vector<uint64_t> want = WriteExpected(layout, seed, version, bucket_bytes);
    // Every tensor resolved through the IPC cache (one open for the whole allocation).
    const uint8_t* base = nullptr;
    for (const ModelTensor& t : layout.tensors) {
      src.offset = t.offset;
      src.length = t.nbytes;
      auto p = (*cache)->Resolve(src, t.nbytes, t.name);
      ASSERT_TRUE(p.ok()) << p.status();
      if (base == nullptr) base = *p - t.offset;
      ASSERT_EQ(*p, base + t.offset);
    }
    std::vector<engine::InputTensor> inputs;
    auto built = BuildPlan(layout, base, true, bucket_bytes, version, &inputs);
    ASSERT_TRUE(built.ok()) << built.status();
    ASSERT_GT(built->manifest.buckets.size(), 3u);
    PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
    ASSERT_TRUE(r.status.ok()) << r.status;
    ExpectDelivered(port, *built);
    EXPECT_EQ((*backend)->last_checksums(), want);
    if (version > 1) {
      EXPECT_EQ(r.host_syncs, 2u) << "version " << version;
    }
    std::printf("version %lu: %zu buckets, %lu bytes, %.3f s, %lu host syncs\n",
                static_cast<unsigned long>(version), built->manifest.buckets.size(),
                static_cast<unsigned long>(built->bytes_out), r.wall_seconds,
                static_cast<unsigned long>(r.host_syncs));
  }
  EXPECT_EQ((*cache)->opens(), 1u);
  // A range beyond the allocation and a foreign device are clear errors.
  src.offset = uint64_t{1} << 40;  // the allocation may be rounded up; this is far beyond
  src.length = 16;
  EXPECT_TRUE(absl::IsOutOfRange((*cache)->Resolve(src, 16, "beyond").status()));
  (void)(*trainer)->WriteLine("quit");
}

TEST_F(MultiGpuTest, NonFiniteWeightsAreRejectedBeforeAnythingIsSent) {
  const int port = FreePort();
  auto emulator = Emulator(port, {});
  ASSERT_TRUE(emulator);
  const ModelLayout layout = LayoutModel(shape_);
  DeviceModel model(layout);
  model.Fill(7);
  const ModelTensor* victim = nullptr;
  for (const auto& t : layout.tensors) {
    if (t.quantize && t.name.find("experts.5.down_proj") != std::string::npos) {
      victim = &t;
    }
  }
  ASSERT_NE(victim, nullptr);
  const uint16_t nan = 0x7FC0;
  ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(model.ptr) + victim->offset + 64, &nan, 2,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  auto transport = Transport(port, absl::Seconds(60));
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok());
  std::vector<engine::InputTensor> inputs;
  auto built = BuildPlan(layout, model.base(), true, 256 << 10, 1, &inputs);
  ASSERT_TRUE(built.ok());
  PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status)) << r.status;
  EXPECT_NE(r.status.message().find(victim->name), std::string::npos) << r.status;
  EXPECT_TRUE(Stats(port, 1).is_null()) << "a bucket of the rejected version was sent";
  // The same daemon side publishes the repaired weights.
  model.Fill(8);
  auto built2 = BuildPlan(layout, model.base(), true, 256 << 10, 2, &inputs);
  ASSERT_TRUE(built2.ok());
  r = Publish(**backend, *transport, *built2, absl::Seconds(60));
  EXPECT_TRUE(r.status.ok()) << r.status;
}

TEST_F(MultiGpuTest, ReceiverKilledMidPublicationAbortsThenRestartedReceiverCommits) {
  const int port = FreePort();
  auto emulator = Emulator(port, {"--die-at-bucket", "2"});
  ASSERT_TRUE(emulator);
  const ModelLayout layout = LayoutModel(shape_);
  DeviceModel model(layout);
  model.Fill(11);
  const absl::Duration deadline = absl::Seconds(20);
  auto transport = Transport(port, deadline);
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok());
  std::vector<engine::InputTensor> inputs;
  auto built = BuildPlan(layout, model.base(), true, 256 << 10, 1, &inputs);
  ASSERT_TRUE(built.ok());
  ASSERT_GT(built->manifest.buckets.size(), 3u);
  PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
  EXPECT_FALSE(r.status.ok());
  EXPECT_LT(r.wall_seconds, absl::ToDoubleSeconds(deadline) + 5) << r.status;
  ASSERT_EQ(r.outcomes.size(), 1u);
  EXPECT_EQ(r.outcomes[0].state, transport::ReceiverState::kFailed);
  EXPECT_FALSE(r.outcomes[0].committed);
  std::printf("aborted after %.3f s: %s\n", r.wall_seconds, r.status.ToString().c_str());
  EXPECT_FALSE(emulator->Running());

  // Restart the receiver at the same address; the next version re-forms the group.
  emulator.reset();
  auto restarted = Emulator(port, {"--expect-dir", dir_});
  ASSERT_TRUE(restarted);
  model.Fill(12);
  WriteExpected(layout, 12, 2, 256 << 10);
  auto built2 = BuildPlan(layout, model.base(), true, 256 << 10, 2, &inputs);
  ASSERT_TRUE(built2.ok());
  r = Publish(**backend, *transport, *built2, absl::Seconds(60));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(transport->generation(), 2);
  ExpectDelivered(port, *built2);
}

TEST_F(MultiGpuTest, HostSyncsPerPublicationDoNotGrowWithExperts) {
  const int port = FreePort();
  auto emulator = Emulator(port, {});
  ASSERT_TRUE(emulator);
  auto transport = Transport(port, absl::Seconds(60));
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok());
  std::map<int, uint64_t> syncs;
  uint64_t version = 0;
  for (int experts : {8, 128}) {
    MoeShape shape = shape_;
    shape.experts = experts;
    const ModelLayout layout = LayoutModel(shape);
    DeviceModel model(layout);
    model.Fill(experts);
    for (int rep = 0; rep < 2; ++rep) {  // the first may grow buffers (counted allocations)
      std::vector<engine::InputTensor> inputs;
      auto built = BuildPlan(layout, model.base(), true, 1 << 20, ++version, &inputs);
      ASSERT_TRUE(built.ok());
      PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
      ASSERT_TRUE(r.status.ok()) << r.status;
      syncs[experts] = r.host_syncs;
      std::printf("%d experts/layer, rep %d: %zu tensors, %zu buckets, %lu host syncs\n", experts,
                  rep, built->plan.outputs.size(), built->manifest.buckets.size(),
                  static_cast<unsigned long>(r.host_syncs));
    }
  }
  EXPECT_EQ(syncs[8], syncs[128]);
  EXPECT_EQ(syncs[8], 2u);
}

TEST_F(MultiGpuTest, EngineWithGpuComponentsPublishesEveryTensorToTheEngine) {
  namespace et = engine::testing;
  const int port = FreePort();
  auto emulator = Emulator(port, {"--expect-dir", dir_});
  ASSERT_TRUE(emulator);
  auto transport = Transport(port, absl::Seconds(60));
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  engine::EngineComponents components;
  components.backend = std::move(*backend);
  components.transports.push_back(std::move(transport));
  engine::EngineOptions eo;
  eo.bucket_bytes = 64 << 10;
  auto eng = engine::Engine::Create(eo, nullptr, std::move(components));
  ASSERT_TRUE(eng.ok()) << eng.status();
  for (uint64_t version = 1; version <= 2; ++version) {
    std::vector<et::TestBatch> batches =
        et::ModelBatches(synthetic::ModelShape::Tiny(), 40 + version);
    batches.push_back(et::StackedExpertBatch(50 + version));
    for (auto& b : batches) {  // TP shards read in place: dim-0 and dim-1 parts
      for (auto& t : b.tensors) {
        if (t.input.desc.name.find("experts.1.down_proj") != std::string::npos) {
          et::SplitIntoParts(t, 1, 2);
        } else if (t.input.desc.name.find("self_attn.o_proj") != std::string::npos) {
          et::SplitIntoParts(t, 0, 2);
        }
      }
    }
    const auto expected =
        et::ExpectedOutputs(batches, *et::PlainPolicy(), kernels::QuantMode::Standard());
    WriteExpectedTensors(version, expected);
    auto session = (*eng)->Open(et::Header(version));
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(et::Send(**session, batches).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status, engine::PublicationStatus::kCommitted) << report->error;
    json s = Stats(port, version);
    ASSERT_FALSE(s.is_null());
    EXPECT_EQ(s["buckets"].get<uint32_t>(), report->buckets);
    EXPECT_EQ(s["checked"].get<size_t>(), expected.size());
    EXPECT_TRUE(s["mismatches"].empty()) << s["mismatches"].dump(1);
    EXPECT_GT(report->bytes_out, 0u) << "buckets sent to the NCCL group count as bytes out";
    std::printf("engine version %lu: %u buckets, %zu tensors, %lu host syncs, %.3f s\n",
                static_cast<unsigned long>(version), report->buckets, expected.size(),
                static_cast<unsigned long>(report->host_syncs), report->wall_seconds);
    if (version > 1) {
      EXPECT_EQ(report->host_syncs, 2u);
    }
  }
}

TEST_F(MultiGpuTest, EngineIngestsTrainerIpcMemoryInPlace) {
  namespace et = engine::testing;
  const int port = FreePort();
  auto emulator = Emulator(port, {"--expect-dir", dir_});
  ASSERT_TRUE(emulator);
  rollout::GpuPathOptions g;
  g.engines = {{absl::StrCat("http://127.0.0.1:", port), 1}};
  g.store_bind_address = "127.0.0.1";
  g.group_name = "wpub_ipc";
  g.request_timeout = absl::Seconds(60);
  g.publication_deadline = absl::Seconds(60);
  auto components = rollout::MakeGpuPathComponents(g);
  ASSERT_TRUE(components.ok()) << components.status();
  engine::EngineOptions eo;
  eo.bucket_bytes = 64 << 10;
  auto eng = engine::Engine::Create(eo, nullptr, *std::move(components));
  ASSERT_TRUE(eng.ok()) << eng.status();

  // Lay every part of the model out in one file the trainer copies into its allocation.
  std::vector<et::TestBatch> batches = et::ModelBatches(synthetic::ModelShape::Tiny(), 77);
  batches.push_back(et::StackedExpertBatch(78));
  for (auto& b : batches) {
    for (auto& t : b.tensors) {
      if (t.input.desc.name.find("experts.2.gate_proj") != std::string::npos) {
        et::SplitIntoParts(t, 0, 2);
      }
    }
  }
  std::string blob;
  std::vector<std::vector<std::vector<uint64_t>>> offsets;  // [batch][tensor][part]
  for (const auto& b : batches) {
    offsets.emplace_back();
    for (const auto& t : b.tensors) {
      offsets.back().emplace_back();
      for (const auto& bytes : t.part_bytes) {
        blob.resize((blob.size() + 255) / 256 * 256);
        offsets.back().back().push_back(blob.size());
        blob.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      }
    }
  }
  const std::string blob_path = dir_ + "/ipc_blob.bin";
  std::ofstream(blob_path, std::ios::binary)
      .write(blob.data(), static_cast<std::streamsize>(blob.size()));
  auto trainer = Child::Spawn(
      {SiblingBinary("multi_gpu_ipc_trainer"), "0", "bytes", std::to_string(blob.size() + 4096)},
      dir_ + "/ipc_trainer.log", true);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto ready = (*trainer)->ReadLine(absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status();
  std::istringstream is(*ready);
  std::string word, hex, uuid;
  is >> word >> hex >> uuid;
  ASSERT_EQ(word, "ready");
  ASSERT_TRUE((*trainer)->WriteLine("load " + blob_path).ok());
  auto loaded = (*trainer)->ReadLine(absl::Seconds(60));
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  const auto expected =
      et::ExpectedOutputs(batches, *et::PlainPolicy(), kernels::QuantMode::Standard());
  for (uint64_t version = 1; version <= 2; ++version) {
    WriteExpectedTensors(version, expected);
    auto session = (*eng)->Open(et::Header(version));
    ASSERT_TRUE(session.ok()) << session.status();
    for (size_t bi = 0; bi < batches.size(); ++bi) {
      engine::BatchInput in;
      in.megatron_name = batches[bi].megatron_name;
      for (size_t ti = 0; ti < batches[bi].tensors.size(); ++ti) {
        engine::TensorInput t = batches[bi].tensors[ti].input;
        for (size_t pi = 0; pi < t.parts.size(); ++pi) {
          engine::CudaIpcSource src;
          for (size_t k = 0; k < 64; ++k) {
            src.handle[k] = static_cast<uint8_t>(std::stoi(hex.substr(2 * k, 2), nullptr, 16));
          }
          src.device_uuid = uuid;
          src.offset = offsets[bi][ti][pi];
          src.length = batches[bi].tensors[ti].part_bytes[pi].size();
          t.parts[pi].source = src;
        }
        in.tensors.push_back(std::move(t));
      }
      ASSERT_TRUE((*session)->AddBatch(std::move(in)).ok()) << "batch " << bi;
    }
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status, engine::PublicationStatus::kCommitted) << report->error;
    json s = Stats(port, version);
    ASSERT_FALSE(s.is_null());
    EXPECT_EQ(s["checked"].get<size_t>(), expected.size());
    EXPECT_TRUE(s["mismatches"].empty()) << s["mismatches"].dump(1);
    EXPECT_GT(report->bytes_out, 0u) << "buckets sent to the NCCL group count as bytes out";
    std::printf("engine IPC version %lu: %u buckets, %lu host syncs, %.3f s\n",
                static_cast<unsigned long>(version), report->buckets,
                static_cast<unsigned long>(report->host_syncs), report->wall_seconds);
    if (version > 1) {
      EXPECT_EQ(report->host_syncs, 2u);
    }
  }
  (void)(*trainer)->WriteLine("quit");
}

TEST_F(MultiGpuTest, CppReceiverGetsEveryBucketWithTheBackendsChecksums) {
  // Both receiver modes: every bucket copied to the host and checksummed there, and checksummed
  // on the receiving device with nothing copied (what the benchmark's C++ engine does); the
  // latter also with 32 NCCL channels set in both sides' communicator configs (--nccl_ctas).
  struct Case {
    std::string mode;
    int nccl_ctas;
  };
  for (const Case& c : {Case{"host", 0}, Case{"device", 0}, Case{"device", 32}}) {
    const std::string& mode = c.mode;
    SCOPED_TRACE("checksums on the " + mode + ", nccl_ctas " + std::to_string(c.nccl_ctas));
    const int port = FreePort();
    auto receiver =
        StartCppReceiver(port, {mode, "-1", std::to_string(c.nccl_ctas)},
                         absl::StrCat(dir_, "/cpp_receiver_", mode, "_", c.nccl_ctas, ".log"));
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    const ModelLayout layout = LayoutModel(shape_);
    DeviceModel model(layout);
    // The device-checksum receiver also takes two update requests in flight (wpub_sequence).
    auto transport = Transport(port, absl::Seconds(60), mode == "device" ? 2 : 1, c.nccl_ctas);
    ASSERT_TRUE(transport);
    gpu::GpuBackendOptions bo;
    auto backend = gpu::GpuBackend::Create(bo);
    ASSERT_TRUE(backend.ok());
    for (uint64_t version = 1; version <= 2; ++version) {
      model.Fill(200 + version);
      std::vector<engine::InputTensor> inputs;
      auto built = BuildPlan(layout, model.base(), true, 256 << 10, version, &inputs);
      ASSERT_TRUE(built.ok());
      PublishResult r = Publish(**backend, *transport, *built, absl::Seconds(60));
      ASSERT_TRUE(r.status.ok()) << r.status;
      auto body = HttpGet(port, "/stats");
      ASSERT_TRUE(body.ok()) << body.status();
      json s = json::parse(*body)[std::to_string(version)];
      ASSERT_FALSE(s.is_null());
      EXPECT_EQ(s["bytes"].get<uint64_t>(), built->bytes_out);
      EXPECT_EQ(s["checksums"].get<std::vector<uint64_t>>(), (*backend)->last_checksums());
      std::printf(
          "engine-free version %lu (%s checksums): %zu buckets to the C++ receiver, %.3f s\n",
          static_cast<unsigned long>(version), mode.c_str(), built->manifest.buckets.size(),
          r.wall_seconds);
    }
  }
}

// Bucket patches over NCCL (wpubd --patches with a device copy): one engine publishes every
// version to two C++ engines, each in a group of its own -- one keeps its weights and takes
// patches (the kept receiver: wpub-recv --engine_patches), one receives every bucket whole
// (device checksums). After the first version each bucket of the patched group is broadcast as
// its patch, made on the device against the retained copy; both engines hold every version
// byte for byte alike (their per-bucket checksums agree, and the kept one verified each
// patched bucket against the whole bucket's checksum). The kept engine then restarts (its
// weights gone, the daemon not told): the next version's patches are refused, the retry
// re-forms the group and goes whole, and the version after is patched again.
TEST_F(MultiGpuTest, AKeptWeightsEngineTakesDevicePatchesAndHoldsWhatAWholeEngineHolds) {
  namespace et = engine::testing;
  const int kept_port = FreePort(), whole_port = FreePort();
  std::unique_ptr<Child> kept_engine;
  {
    auto kept = StartCppReceiver(kept_port, {"kept"}, dir_ + "/cpp_receiver_kept.log");
    ASSERT_TRUE(kept.ok()) << kept.status();
    kept_engine = *std::move(kept);
  }
  auto whole = StartCppReceiver(whole_port, {"device"}, dir_ + "/cpp_receiver_whole.log");
  ASSERT_TRUE(whole.ok()) << whole.status();
  // No engine watch: the restart below is found by the publication, not by a catch-up.
  // Two requests in flight: both engines key their stats by wpub_sequence (a retry starts over).
  auto group = [](int port) {
    rollout::RolloutGroupOptions o = LoopbackTransportOptions(
        {{absl::StrCat("http://127.0.0.1:", port), 1}}, "wpub_test", 2, absl::Seconds(60));
    o.join_timeout = absl::Seconds(60);
    o.engine_watch_interval = absl::ZeroDuration();
    auto t = rollout::RolloutGroup::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  };
  auto kept_group = group(kept_port);
  auto whole_group = group(whole_port);
  ASSERT_TRUE(kept_group && whole_group);
  rollout::RolloutGroup* patched = kept_group.get();
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto memory = gpu::GpuRetainedMemory::Create({0, transport::RetainWhere::kDevice});
  ASSERT_TRUE(memory.ok()) << memory.status();
  engine::EngineComponents components;
  components.backend = std::move(*backend);
  components.retained_memory = *memory;
  components.transports.push_back(std::move(kept_group));
  components.transports.push_back(std::move(whole_group));
  engine::EngineOptions eo;
  eo.bucket_bytes = 64 << 10;
  eo.max_attempts = 2;
  eo.retain.where = transport::RetainWhere::kDevice;
  eo.patches = {.enabled = true, .full_every = 4, .max_patch_fraction = 0.5};
  auto eng = engine::Engine::Create(eo, nullptr, std::move(components));
  ASSERT_TRUE(eng.ok()) << eng.status();
  auto checksums = [&](int port, uint64_t version) {
    auto body = HttpGet(port, "/stats");
    EXPECT_TRUE(body.ok()) << body.status();
    const json j = body.ok() ? json::parse(*body) : json();
    const std::string v = std::to_string(version);
    return j.contains(v) ? j[v] : json();
  };
  // full_every 4: v1 (no base) and v5 go whole; v6 reaches a restarted engine (a retry, whole).
  for (uint64_t version = 1; version <= 7; ++version) {
    SCOPED_TRACE(absl::StrCat("v", version));
    if (version == 6) {
      kept_engine.reset();  // SIGKILL: its weights and its group membership are gone
      auto again = StartCppReceiver(kept_port, {"kept"}, dir_ + "/cpp_receiver_kept2.log");
      ASSERT_TRUE(again.ok()) << again.status();
      kept_engine = *std::move(again);
    }
    auto session = (*eng)->Open(et::Header(version));
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(
        et::Send(**session, et::SteppedBatches(synthetic::ModelShape::Tiny(), 3, version)).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status, engine::PublicationStatus::kCommitted) << report->error;
    EXPECT_EQ(report->attempts, version == 6 ? 2u : 1u);
    const rollout::EnginePatchStats p = patched->last_patches();
    const json k = checksums(kept_port, version), w = checksums(whole_port, version);
    ASSERT_FALSE(k.is_null());
    ASSERT_FALSE(w.is_null());
    EXPECT_EQ(k["checksums"], w["checksums"]) << "the patched engine holds another version";
    EXPECT_EQ(k["buckets"].get<uint64_t>(), report->buckets);
    std::printf("v%lu: %u buckets, %u patched (%lu patch bytes for %lu), %lu host syncs, %.3f s\n",
                static_cast<unsigned long>(version), report->buckets, p.patched_buckets,
                static_cast<unsigned long>(p.patch_bytes),
                static_cast<unsigned long>(p.patched_bucket_bytes),
                static_cast<unsigned long>(report->host_syncs), report->wall_seconds);
    if (version == 1 || version == 5) {
      EXPECT_EQ(p.patched_buckets, 0u);
    } else if (version != 6) {
      EXPECT_EQ(p.base_version, version - 1);
      EXPECT_EQ(p.patched_buckets, report->buckets) << "a few bytes moved in every bucket";
      EXPECT_EQ(k["patched_buckets"].get<uint64_t>(), report->buckets);
      EXPECT_LT(p.patch_bytes * 8, p.patched_bucket_bytes);
    }
  }
}

// NCCL applies each rank's own channel bounds after the ranks agree on a topology, so ranks
// configured with different channel counts split a broadcast differently: NCCL fails it
// (measured on 2 x H200: "Message truncated : received 12288 bytes instead of 1024") or, had it
// not noticed, the watchdog's deadline would. Either way the publication must end aborted within
// the deadline with nothing committed, and the engine must take the next group and commit.
TEST_F(MultiGpuTest, MismatchedChannelCountsAbortWithinTheDeadlineAndTheNextGroupCommits) {
  if (std::getenv("NCCL_MIN_CTAS") != nullptr || std::getenv("NCCL_MAX_CTAS") != nullptr) {
    GTEST_SKIP() << "NCCL_MIN_CTAS / NCCL_MAX_CTAS in the environment override both ranks' counts";
  }
  const int port = FreePort();
  // The receiver on 16 channels, wpub's rank on 2.
  auto receiver =
      StartCppReceiver(port, {"device", "-1", "16"}, dir_ + "/cpp_receiver_mismatch.log");
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  const ModelLayout layout = LayoutModel(shape_);
  DeviceModel model(layout);
  model.Fill(300);
  std::vector<engine::InputTensor> inputs;
  auto built = BuildPlan(layout, model.base(), true, 256 << 10, 1, &inputs);
  ASSERT_TRUE(built.ok());
  const absl::Duration deadline = absl::Seconds(8);
  {
    auto mismatched = Transport(port, deadline, 1, /*nccl_ctas=*/2);
    ASSERT_TRUE(mismatched);
    gpu::GpuBackendOptions bo;
    auto backend = gpu::GpuBackend::Create(bo);
    ASSERT_TRUE(backend.ok());
    PublishResult r = Publish(**backend, *mismatched, *built, absl::Seconds(60));
    EXPECT_FALSE(r.status.ok());
    EXPECT_LT(r.wall_seconds, absl::ToDoubleSeconds(deadline) + 5) << r.status;
    ASSERT_EQ(r.outcomes.size(), 1u);
    EXPECT_FALSE(r.outcomes[0].committed);
    std::printf("mismatched channel counts: %s after %.2f s\n", r.status.ToString().c_str(),
                r.wall_seconds);
  }
  // The same engine, a group whose ranks agree: the next version commits, every checksum equal.
  auto transport = Transport(port, absl::Seconds(60), 1, /*nccl_ctas=*/16);
  ASSERT_TRUE(transport);
  gpu::GpuBackendOptions bo;
  auto backend = gpu::GpuBackend::Create(bo);
  ASSERT_TRUE(backend.ok());
  auto built2 = BuildPlan(layout, model.base(), true, 256 << 10, 2, &inputs);
  ASSERT_TRUE(built2.ok());
  PublishResult r = Publish(**backend, *transport, *built2, absl::Seconds(60));
  ASSERT_TRUE(r.status.ok()) << r.status;
  auto body = HttpGet(port, "/stats");
  ASSERT_TRUE(body.ok()) << body.status();
  json s = json::parse(*body)["2"];
  ASSERT_FALSE(s.is_null()) << *body;
  EXPECT_EQ(s["checksums"].get<std::vector<uint64_t>>(), (*backend)->last_checksums());
}

}  // namespace
}  // namespace wpub::testing
