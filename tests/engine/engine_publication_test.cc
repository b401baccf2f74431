// Whole publications through the engine and the pull transport with two in-process receivers:
// byte-for-byte equality with the CPU reference, reports, metrics, and receiver faults.
#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "core/engine/engine.h"
#include "core/engine/recipe.h"
#include "core/metrics/metrics.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using transport::testing::InprocReceiver;
using transport::testing::InprocReceiverOptions;

class PublicationTest : public ::testing::Test {
 protected:
  void SetUp() override { MakeEngine(EngineOptions{}); }

  void MakeEngine(EngineOptions options) {
    receivers_.clear();
    engine_.reset();
    metrics_.reset();
    registry_ = std::make_shared<prometheus::Registry>();
    auto metrics = metrics::EngineMetrics::Create(registry_.get());
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *std::move(metrics);
    options.bucket_bytes = 4096;
    options.min_bucket_bytes = 1024;
    if (options.ack_deadline == EngineOptions{}.ack_deadline) {
      options.ack_deadline = absl::Seconds(10);
    }
    auto engine = Engine::Create(options, metrics_.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  transport::testing::InprocReceiver* AddReceiver(
      transport::testing::InprocReceiverOptions options) {
    auto r =
        transport::testing::InprocReceiver::Start(engine_->pull_transport(), std::move(options));
    EXPECT_TRUE(r.ok()) << r.status();
    receivers_.push_back(std::move(*r));
    return receivers_.back().get();
  }

  absl::StatusOr<PublicationReport> Publish(uint64_t version,
                                            const std::vector<testing::TestBatch>& batches,
                                            const std::string& recipe = "nvfp4") {
    auto session = engine_->Open(testing::Header(version, recipe));
    if (!session.ok()) return session.status();
    if (absl::Status s = testing::Send(**session, batches); !s.ok()) return s;
    return (*session)->Commit();
  }

  // Value of a metric sample from Registry::Collect (counter, gauge, histogram sum).
  double Metric(const std::string& name, const std::string& label = "",
                const std::string& value = "", bool histogram_count = false) {
    for (const auto& family : registry_->Collect()) {
      if (family.name != name) continue;
      for (const auto& m : family.metric) {
        bool match = label.empty();
        for (const auto& l : m.label) match |= l.name == label && l.value == value;
        if (!match) continue;
        switch (family.type) {
          case prometheus::MetricType::Counter:
            return m.counter.value;
          case prometheus::MetricType::Gauge:
            return m.gauge.value;
          case prometheus::MetricType::Histogram:
            return histogram_count ? static_cast<double>(m.histogram.sample_count)
                                   : m.histogram.sample_sum;
          default:
            return -1;
        }
      }
    }
    return -1;
  }

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<metrics::EngineMetrics> metrics_;  // outlives engine_
  std::unique_ptr<Engine> engine_;
  std::vector<std::unique_ptr<transport::testing::InprocReceiver>> receivers_;
};

// Batches of the small model with multi-part, stacked and shared-memory tensors.
std::vector<testing::TestBatch> RichModel(uint64_t seed, testing::ShmSegment* shm) {
  auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), seed);
  uint64_t shm_offset = 0;
  int gate_splits = 0, down_splits = 0, shm_placed = 0;
  for (auto& b : batches) {
    for (auto& t : b.tensors) {
      const std::string& n = t.input.desc.name;
      if (n.find(".mlp.experts.") != std::string::npos) {
        if (n.find("gate_proj") != std::string::npos && gate_splits++ % 2 == 0) {
          testing::SplitIntoParts(t, 0, 2);
        } else if (n.find("down_proj") != std::string::npos && down_splits++ % 2 == 0) {
          testing::SplitIntoParts(t, 1, 2);
        } else if (n.find("up_proj") != std::string::npos && shm && shm_placed++ < 3) {
          shm->Place(t, shm_offset);
          shm_offset += (t.full.size() + 63) / 64 * 64;
        }
      } else if (n.find("self_attn.o_proj") != std::string::npos) {
        testing::SplitIntoParts(t, 1, 4);  // a passed-through multi-part tensor
      }
    }
  }
  batches.push_back(testing::StackedExpertBatch(seed));
  return batches;
}

TEST_F(PublicationTest, TwoReceiversGetExactlyTheReferenceBytes) {
  transport::testing::InprocReceiver* r0 = AddReceiver({.name = "r0"});
  transport::testing::InprocReceiver* r1 = AddReceiver({.name = "r1"});
  auto shm = testing::ShmSegment::Create("/wpub_engine_pub_" + std::to_string(getpid()), 1 << 20);
  const auto policy = testing::PlainPolicy();
  for (uint64_t version : {1u, 2u}) {
    const auto batches = RichModel(100 + version, shm.get());
    auto report = Publish(version, batches);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
    EXPECT_EQ(report->version, version);
    EXPECT_GT(report->buckets, 3u);
    EXPECT_EQ(report->host_syncs, 0u);
    ASSERT_EQ(report->receivers.size(), 2u);
    for (const auto& o : report->receivers) EXPECT_TRUE(o.committed) << o.name;

    ASSERT_TRUE(r0->WaitForOutcome(version, absl::Seconds(10)));
    ASSERT_TRUE(r1->WaitForOutcome(version, absl::Seconds(10)));
    const auto expected =
        testing::ExpectedOutputs(batches, *policy, kernels::QuantMode::Standard());
    uint64_t in_bytes = 0, out_bytes = 0, quantized = 0, inputs = 0;
    for (const auto& b : batches) {
      for (const auto& t : b.tensors) {
        in_bytes += t.full.size();
        ++inputs;
        quantized += expected.count(t.input.desc.name + "_scale") ? 1 : 0;
      }
    }
    for (const auto& [name, bytes] : expected) out_bytes += bytes.size();
    EXPECT_EQ(report->bytes_in, in_bytes);
    EXPECT_EQ(report->bytes_out, out_bytes);
    EXPECT_EQ(report->tensors_quantized, quantized);
    EXPECT_GT(quantized, 20u);
    EXPECT_EQ(report->tensors_quantized + report->tensors_passthrough + report->tensors_ignored,
              inputs);
    for (transport::testing::InprocReceiver* r : {r0, r1}) {
      EXPECT_EQ(r->committed_version(), version);
      EXPECT_EQ(r->checksum_mismatches(), 0u);
      const auto got = r->committed_tensors();
      ASSERT_EQ(got.size(), expected.size());
      for (const auto& [name, bytes] : expected) {
        auto it = got.find(name);
        ASSERT_NE(it, got.end()) << name;
        EXPECT_TRUE(it->second == bytes) << name << " differs from the CPU reference";
      }
      // Manifest entries carry the dtype/shape engines need, aligned offsets.
      const auto manifest = r->committed_manifest();
      const auto& ws = manifest.at("model.layers.1.mlp.stacked_experts.down_proj.weight_scale_2");
      EXPECT_EQ(ws.dtype, DType::kFloat32);
      EXPECT_EQ(ws.shape, (Shape{3}));
      for (const auto& [name, t] : manifest) EXPECT_EQ(t.offset % DTypeSize(t.dtype), 0u) << name;
    }
  }
  const EngineStatus status = engine_->GetStatus();
  EXPECT_EQ(status.committed_version, 2u);
  EXPECT_FALSE(status.active.has_value());
  EXPECT_EQ(status.receivers.size(), 2u);
  EXPECT_EQ(engine_->RecentReports(10).size(), 2u);
  EXPECT_EQ(engine_->RecentReports(10)[0].version, 2u);
}

TEST_F(PublicationTest, FourOverSixAndBf16Recipes) {
  transport::testing::InprocReceiver* r0 = AddReceiver({.name = "r0"});
  const auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 7);
  auto report = Publish(1, batches, "nvfp4_4over6:mse-e448-fp16");
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  EXPECT_EQ(report->recipe, "nvfp4_4over6:mse-e448-fp16");
  ASSERT_TRUE(r0->WaitForOutcome(1, absl::Seconds(10)));
  auto expected = testing::ExpectedOutputs(
      batches, *testing::PlainPolicy(policy::Recipe::kNvfp4FourOverSix),
      kernels::QuantMode::FourOverSix(kernels::ErrMetric::kMSE, 448, kernels::ErrKind::kFP16));
  EXPECT_TRUE(r0->committed_tensors() == expected);

  report = Publish(2, batches, "bf16");
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  EXPECT_EQ(report->tensors_quantized, 0u);
  EXPECT_EQ(report->bytes_out, report->bytes_in);
  ASSERT_TRUE(r0->WaitForOutcome(2, absl::Seconds(10)));
  expected = testing::ExpectedOutputs(batches, *testing::PlainPolicy(policy::Recipe::kBf16),
                                      kernels::QuantMode::Standard());
  EXPECT_TRUE(r0->committed_tensors() == expected);
}

TEST_F(PublicationTest, ReceiverThatLeavesMidPublicationAbortsItEverywhere) {
  transport::testing::InprocReceiver* good = AddReceiver({.name = "good"});
  const auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 1);
  auto first = Publish(1, batches);
  ASSERT_TRUE(first.ok() && first->status == PublicationStatus::kCommitted);
  ASSERT_TRUE(good->WaitForOutcome(1, absl::Seconds(10)));
  const auto v1 = good->committed_tensors();
  transport::testing::InprocReceiver* leaver =
      AddReceiver({.name = "leaver", .leave_after_buckets = 2});

  auto report = Publish(2, testing::ModelBatches(synthetic::ModelShape::Tiny(), 2));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_NE(report->error.find("leaver"), std::string::npos) << report->error;
  bool saw = false;
  for (const auto& o : report->receivers) {
    EXPECT_FALSE(o.committed);
    if (o.name == "leaver") {
      saw = true;
      EXPECT_EQ(o.failure, transport::ReceiverFailure::kDisconnected);
    }
  }
  EXPECT_TRUE(saw);
  // The receiver marks itself left just after closing its subscription, which the engine may
  // see (and end the publication over) first: wait for that state before asserting it.
  EXPECT_TRUE(leaver->WaitForOutcome(2, absl::Seconds(10)));
  EXPECT_TRUE(leaver->left());
  ASSERT_TRUE(good->WaitForOutcome(2, absl::Seconds(10)));
  EXPECT_EQ(good->aborted_versions(), std::vector<uint64_t>{2});
  EXPECT_EQ(good->committed_version(), 1u);
  EXPECT_TRUE(good->committed_tensors() == v1);  // discarded version 2, kept version 1
  EXPECT_EQ(engine_->GetStatus().committed_version, 1u);
  EXPECT_EQ(Metric(metrics::kEngineFailuresTotal, "reason", "disconnected"), 1);

  // The engine keeps serving: the next version commits to the remaining receiver.
  report = Publish(3, batches);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  ASSERT_TRUE(good->WaitForOutcome(3, absl::Seconds(10)));
  EXPECT_EQ(good->committed_version(), 3u);
}

TEST_F(PublicationTest, WrongChecksumAcknowledgementAborts) {
  transport::testing::InprocReceiver* good = AddReceiver({.name = "good"});
  AddReceiver({.name = "liar", .corrupt_checksum = true});
  auto report = Publish(1, testing::ModelBatches(synthetic::ModelShape::Tiny(), 3));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kAborted);
  EXPECT_NE(report->error.find("liar"), std::string::npos);
  EXPECT_NE(report->error.find("checksum"), std::string::npos);
  ASSERT_TRUE(good->WaitForOutcome(1, absl::Seconds(10)));
  EXPECT_EQ(good->committed_version(), 0u);
  EXPECT_EQ(good->aborted_versions(), std::vector<uint64_t>{1});
  EXPECT_EQ(engine_->GetStatus().committed_version, 0u);
  EXPECT_EQ(Metric(metrics::kEngineFailuresTotal, "reason", "checksum"), 1);
  EXPECT_EQ(Metric(metrics::kPublicationsTotal, "status", "aborted"), 1);
}

TEST_F(PublicationTest, MissingAcknowledgementsTimeOut) {
  EngineOptions options;
  options.ack_deadline = absl::Milliseconds(300);
  MakeEngine(options);
  AddReceiver({.name = "silent", .never_ack = true});
  const absl::Time t0 = absl::Now();
  auto report = Publish(1, testing::ModelBatches(synthetic::ModelShape::Tiny(), 3));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(report->error.find("silent"), std::string::npos);
  ASSERT_EQ(report->receivers.size(), 1u);
  EXPECT_EQ(report->receivers[0].failure, transport::ReceiverFailure::kTimeout);
}

TEST_F(PublicationTest, DestroyingASessionWithoutCommitAbortsIt) {
  AddReceiver({.name = "r0"});
  {
    auto session = engine_->Open(testing::Header(5));
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE(
        testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
    EXPECT_EQ(engine_->GetStatus().active->version, 5u);
  }
  const EngineStatus status = engine_->GetStatus();
  EXPECT_FALSE(status.active.has_value());
  ASSERT_FALSE(status.last_reports.empty());
  EXPECT_EQ(status.last_reports[0].status, PublicationStatus::kAborted);
  EXPECT_EQ(status.last_reports[0].code, absl::StatusCode::kCancelled);
  auto report = Publish(5, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
}

TEST_F(PublicationTest, AbortFromAnotherThreadStopsABlockedCommit) {
  AddReceiver({.name = "silent", .never_ack = true});
  auto session = engine_->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    (*session)->Abort(absl::CancelledError("trainer went away"));
  });
  const absl::Time t0 = absl::Now();
  auto report = (*session)->Commit();
  aborter.join();
  ASSERT_TRUE(report.ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kCancelled);
  EXPECT_EQ(report->error, "trainer went away");
}

TEST_F(PublicationTest, NotEnoughReceiversAborts) {
  EngineOptions options;
  options.min_receivers = 2;
  MakeEngine(options);
  AddReceiver({.name = "only"});
  auto report = Publish(1, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kFailedPrecondition);
}

TEST_F(PublicationTest, MetricsEqualTheReports) {
  AddReceiver({.name = "r0"});
  AddReceiver({.name = "r1"});
  std::vector<PublicationReport> committed;
  for (uint64_t v : {1u, 2u, 3u}) {
    auto report = Publish(v, testing::ModelBatches(synthetic::ModelShape::Tiny(), v));
    ASSERT_TRUE(report.ok() && report->status == PublicationStatus::kCommitted);
    committed.push_back(*report);
  }
  {  // One failed publication (bad input).
    auto session = engine_->Open(testing::Header(4));
    ASSERT_TRUE(session.ok());
    EXPECT_FALSE((*session)->Commit().ok());  // empty
  }
  double wall = 0, quantize = 0, nvfp4 = 0, bf16 = 0, q = 0, p = 0, ig = 0;
  for (const auto& r : committed) {
    wall += r.wall_seconds;
    quantize += r.phases.quantize;
    nvfp4 += static_cast<double>(r.bytes_out_by_format.at("nvfp4"));
    bf16 += static_cast<double>(r.bytes_out_by_format.at("bfloat16"));
    q += static_cast<double>(r.tensors_quantized);
    p += static_cast<double>(r.tensors_passthrough);
    ig += static_cast<double>(r.tensors_ignored);
  }
  EXPECT_EQ(Metric(metrics::kPublicationsTotal, "status", "committed"), 3);
  EXPECT_EQ(Metric(metrics::kPublicationsTotal, "status", "failed"), 1);
  EXPECT_EQ(Metric(metrics::kPublicationsTotal, "status", "aborted"), 0);
  EXPECT_EQ(Metric(metrics::kPublicationSeconds, "", "", true), 3);
  EXPECT_DOUBLE_EQ(Metric(metrics::kPublicationSeconds), wall);
  EXPECT_DOUBLE_EQ(Metric(metrics::kPublicationPhaseSeconds, "phase", "quantize"), quantize);
  EXPECT_EQ(Metric(metrics::kPublishedBytesTotal, "format", "nvfp4"), nvfp4);
  EXPECT_EQ(Metric(metrics::kPublishedBytesTotal, "format", "bfloat16"), bf16);
  EXPECT_EQ(Metric(metrics::kTensorsTotal, "action", "quantized"), q);
  EXPECT_EQ(Metric(metrics::kTensorsTotal, "action", "passthrough"), p);
  EXPECT_EQ(Metric(metrics::kTensorsTotal, "action", "ignored"), ig);
  EXPECT_EQ(Metric(metrics::kHostSyncsTotal), 0);
  EXPECT_EQ(Metric(metrics::kPublicationHostSyncs), 0);
  EXPECT_EQ(Metric(metrics::kLastCommittedVersion), 3);
  EXPECT_EQ(Metric(metrics::kEngines, "state", "idle"), 2);
  EXPECT_EQ(Metric(metrics::kEngineFailuresTotal, "reason", "timeout"), 0);
  // Four Opens with the same (empty) rule list: one snapshot build, three cache hits.
  EXPECT_EQ(Metric(metrics::kIgnoreCacheMissesTotal), 1);
  EXPECT_EQ(Metric(metrics::kIgnoreCacheHitsTotal), 3);
}

TEST_F(PublicationTest, IgnoredTensorsAreCountedAndPassedThrough) {
  AddReceiver({.name = "r0"});
  PublicationHeader h = testing::Header(1);
  h.quantization_config_json =
      R"({"quant_algo": "NVFP4", "ignore": ["model.layers.1.mlp.experts.0"]})";
  auto session = engine_->Open(h);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
  EXPECT_EQ(report->tensors_ignored, 3u);  // gate, up, down of expert 0 in layer 1
  EXPECT_EQ(Metric(metrics::kTensorsTotal, "action", "ignored"), 3);
}

}  // namespace
}  // namespace wpub::engine

namespace wpub::engine {
namespace {

// Randomized: bucket sizes, recipes (all 9 quantization modes), tensor splits along dim 0 or 1
// and chunk sizes vary; every received tensor must still equal the CPU reference.
TEST_F(PublicationTest, RandomizedLayoutsAndSplitsMatchTheReference) {
  transport::testing::InprocReceiver* r = AddReceiver({.name = "r"});
  std::mt19937_64 rng(4242);
  const char* recipes[] = {"nvfp4",
                           "nvfp4_4over6:mae-e448-exact",
                           "nvfp4_4over6:mae-e448-fp16",
                           "nvfp4_4over6:mae-e256-exact",
                           "nvfp4_4over6:mae-e256-fp16",
                           "nvfp4_4over6:mse-e448-exact",
                           "nvfp4_4over6:mse-e448-fp16",
                           "nvfp4_4over6:mse-e256-exact",
                           "nvfp4_4over6:mse-e256-fp16"};
  for (uint64_t version = 1; version <= 9; ++version) {
    SCOPED_TRACE(recipes[version - 1]);
    auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 1000 + version);
    batches.push_back(testing::StackedExpertBatch(version));
    for (auto& b : batches) {
      for (auto& t : b.tensors) {
        if (t.input.parts.size() != 1 || t.input.desc.shape.size() < 2) continue;
        const int dim = static_cast<int>(rng() % 2);
        const int n = 1 << (rng() % 3);  // 1, 2 or 4 parts
        if (t.input.desc.shape[dim] % n == 0) testing::SplitIntoParts(t, dim, n);
      }
    }
    PublicationHeader h = testing::Header(version, recipes[version - 1]);
    h.bucket_bytes = 1024 + rng() % 65536;
    auto session = engine_->Open(h);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(testing::Send(**session, batches, 1 + rng() % 5000).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
    ASSERT_TRUE(r->WaitForOutcome(version, absl::Seconds(10)));
    auto parsed = ParseRecipeString(recipes[version - 1]);
    ASSERT_TRUE(parsed.ok());
    const auto expected =
        testing::ExpectedOutputs(batches, *testing::PlainPolicy(parsed->recipe), parsed->mode);
    const auto got = r->committed_tensors();
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& [name, bytes] : expected) {
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_TRUE(got.at(name) == bytes) << name;
    }
  }
}

}  // namespace
}  // namespace wpub::engine
