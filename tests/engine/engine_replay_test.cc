// Convergence on the committed version (core/engine/replay.h): the retained copy restores an
// SGLang-like engine an abort left dirty -- after a failure at every bucket index --, catches up
// pull receivers that subscribe behind, yields to a trainer's publication, refuses over its
// memory bound, and a restore that fails leaves the engine paused and reported. Every check
// reads the bytes the engine or receiver holds against the CPU oracle of the committed version.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>

#include "core/engine/engine.h"
#include "core/metrics/metrics.h"
#include "core/transport/pull_transport.h"
#include "core/transport/testing/fake_rollout_engine.h"
#include "core/transport/testing/fault_injection.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using transport::testing::Fault;
using transport::testing::FaultKind;
using Outputs = std::map<std::string, std::vector<uint8_t>>;

constexpr absl::Duration kWait = absl::Seconds(30);

class ReplayTest : public ::testing::Test {
 protected:
  // An engine with an SGLang-like engine behind a fault decorator (a kDisconnect fault makes
  // its update requests fail from bucket k on) and its own pull transport.
  void Make(transport::RetainedCopyOptions retain, bool with_engine = true,
            absl::Duration ack_deadline = absl::Seconds(10)) {
    EngineComponents components;
    if (with_engine) {
      fake_ = std::make_unique<transport::testing::FakeRolloutEngine>("sglang-0");
      faults_ = new transport::testing::FaultInjectingTransport(fake_.get(),
                                                                [this] { fake_->FailRequests(); });
      components.transports.emplace_back(faults_);
    }
    EngineOptions options;
    options.bucket_bytes = 4096;
    options.min_bucket_bytes = 1024;
    options.ack_deadline = ack_deadline;
    options.max_attempts = 3;
    options.retain = retain;
    auto metrics = metrics::EngineMetrics::Create(&registry_);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *std::move(metrics);
    auto engine = Engine::Create(options, metrics_.get(), std::move(components));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  void TearDown() override {
    receivers_.clear();
    engine_.reset();  // owns the fault decorator
    fake_.reset();
  }

  transport::testing::InprocReceiver* StartReceiver(const std::string& name, uint64_t held = 0,
                                                    bool never_ack = false) {
    auto r = transport::testing::InprocReceiver::Start(
        engine_->pull_transport(), {.name = name, .never_ack = never_ack, .held_version = held});
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return nullptr;
    return (receivers_[name] = std::move(*r)).get();
  }

  std::vector<testing::TestBatch> Batches(uint64_t version) const {
    return model_.Batches(version);
  }

  const Outputs& Expected(uint64_t version) { return model_.Expected(version); }

  PublicationReport Publish(uint64_t version) {
    auto session = engine_->Open(testing::Header(version));
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return {};
    EXPECT_TRUE(testing::Send(**session, Batches(version)).ok());
    absl::StatusOr<PublicationReport> report = (*session)->Commit();
    EXPECT_TRUE(report.ok()) << report.status();
    return report.ok() ? *report : PublicationReport{};
  }

  // Blocks until the engine recorded `n` replays in all (wpub_replays_total, counted after
  // the report is recorded); then the recent reports, newest first (at most 8).
  std::vector<ReplayReport> WaitForReplays(size_t n) {
    const absl::Time deadline = absl::Now() + kWait;
    while (Replays("", "") < static_cast<double>(n) && absl::Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return engine_->GetStatus().last_replays;
  }

  // wpub_replays_total{kind,outcome}; "" sums over that label.
  double Replays(const std::string& kind, const std::string& outcome) {
    double sum = 0;
    for (const auto& family : registry_.Collect()) {
      if (family.name != metrics::kReplaysTotal) continue;
      for (const auto& m : family.metric) {
        std::map<std::string, std::string> labels;
        for (const auto& l : m.label) labels[l.name] = l.value;
        if ((kind.empty() || labels["kind"] == kind) &&
            (outcome.empty() || labels["outcome"] == outcome)) {
          sum += m.counter.value;
        }
      }
    }
    return sum;
  }

  prometheus::Registry registry_;
  std::unique_ptr<metrics::EngineMetrics> metrics_;  // outlives engine_
  std::unique_ptr<transport::testing::FakeRolloutEngine> fake_;
  transport::testing::FaultInjectingTransport* faults_ = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine_;
  std::map<std::string, std::unique_ptr<transport::testing::InprocReceiver>> receivers_;
  testing::VersionedModel model_{5000};
};

TEST_F(ReplayTest, AnEngineDirtyAfterAFailureAtEveryBucketIsRestoredToTheCommittedVersion) {
  Make({.where = transport::RetainWhere::kHost});
  transport::testing::InprocReceiver* r0 = StartReceiver("r0");
  std::atomic<bool> stop{false};
  std::thread traffic([&] {
    while (!stop.load()) {
      fake_->Generate();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  const PublicationReport first = Publish(1);
  ASSERT_EQ(first.status, PublicationStatus::kCommitted) << first.error;
  ASSERT_GT(first.buckets, 3u);
  ASSERT_TRUE(r0->WaitForCommitted(1, kWait));
  uint64_t committed = 1;
  size_t replays = 0;
  for (uint32_t k = 0; k < first.buckets; ++k) {
    SCOPED_TRACE(absl::StrCat("engine failing from bucket ", k));
    const uint64_t v = 2 + 2 * k;
    // Every attempt fails at bucket k: the version aborts for good.
    faults_->Arm(Fault{.kind = FaultKind::kDisconnect, .bucket = k, .attempts = 3});
    const PublicationReport aborted = Publish(v);
    faults_->Arm(Fault{});
    ASSERT_EQ(aborted.status, PublicationStatus::kAborted);
    ASSERT_EQ(aborted.attempts, k == 0 ? 1u : 3u);  // nothing loaded at bucket 0: no retry
    if (k > 0) {
      // It loaded buckets 0 .. k-1 of v: dirty, restored from the retained copy.
      const std::vector<ReplayReport> r = WaitForReplays(++replays);
      ASSERT_EQ(Replays("", ""), static_cast<double>(replays));
      ASSERT_FALSE(r.empty());
      EXPECT_EQ(r[0].kind, ReplayKind::kRestore);
      EXPECT_TRUE(r[0].completed) << r[0].error;
      EXPECT_EQ(r[0].version, committed);
      EXPECT_NE(r[0].trigger.find(absl::StrCat("v", v, " aborted")), std::string::npos)
          << r[0].trigger;
      // The pull receiver holds the committed version: it takes no part.
      ASSERT_EQ(r[0].receivers.size(), 1u);
      EXPECT_EQ(r[0].receivers[0].name, "sglang-0");
    }
    EXPECT_FALSE(fake_->dirty());
    EXPECT_TRUE(fake_->serving());
    EXPECT_EQ(fake_->complete_version(), committed);
    EXPECT_EQ(fake_->weights(), Expected(committed));
    // The next version commits as usual.
    const PublicationReport next = Publish(v + 1);
    ASSERT_EQ(next.status, PublicationStatus::kCommitted) << next.error;
    committed = v + 1;
    EXPECT_EQ(fake_->weights(), Expected(committed));
    ASSERT_TRUE(r0->WaitForCommitted(committed, kWait));
  }
  stop = true;
  traffic.join();
  EXPECT_EQ(fake_->mixed_generations(), 0u);
  EXPECT_GT(fake_->generations(), 0u);
  EXPECT_EQ(Replays("restore", "completed"), static_cast<double>(replays));
  EXPECT_EQ(r0->committed_tensors(), Expected(committed));
}

TEST_F(ReplayTest, ARestoreThatFailsLeavesTheEnginePausedAndReportedUntilTheNextVersion) {
  Make({.where = transport::RetainWhere::kHost});
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  // Three attempts and the restore after them fail at bucket 1.
  faults_->Arm(Fault{.kind = FaultKind::kDisconnect, .bucket = 1, .attempts = 4});
  ASSERT_EQ(Publish(2).status, PublicationStatus::kAborted);
  const std::vector<ReplayReport> r = WaitForReplays(1);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_FALSE(r[0].completed);
  EXPECT_FALSE(r[0].preempted);
  EXPECT_NE(r[0].error.find("sglang-0"), std::string::npos) << r[0].error;
  ASSERT_EQ(r[0].receivers.size(), 1u);
  EXPECT_TRUE(r[0].receivers[0].dirty);
  EXPECT_TRUE(fake_->dirty());
  EXPECT_FALSE(fake_->serving());
  EXPECT_EQ(Replays("restore", "failed"), 1);
  bool dirty_in_status = false;
  for (const transport::ReceiverInfo& i : engine_->GetStatus().receivers) {
    dirty_in_status |= i.name == "sglang-0" && i.state == transport::ReceiverState::kDirty;
  }
  EXPECT_TRUE(dirty_in_status);
  // The next version cleans it.
  faults_->Arm(Fault{});
  ASSERT_EQ(Publish(3).status, PublicationStatus::kCommitted);
  EXPECT_FALSE(fake_->dirty());
  EXPECT_TRUE(fake_->serving());
  EXPECT_EQ(fake_->weights(), Expected(3));
}

TEST_F(ReplayTest, AnOperatorRestoreResendsTheCommittedVersionToEveryEngine) {
  Make({.where = transport::RetainWhere::kHost});
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  absl::StatusOr<ReplayReport> r = engine_->Restore("wpubctl restore");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->completed) << r->error;
  EXPECT_EQ(r->kind, ReplayKind::kRestore);
  EXPECT_EQ(r->trigger, "wpubctl restore");
  EXPECT_EQ(r->version, 1u);
  EXPECT_GT(r->buckets, 0u);
  EXPECT_GT(r->bytes, 0u);
  EXPECT_EQ(fake_->complete_version(), 1u);
  EXPECT_EQ(fake_->weights(), Expected(1));
  const EngineStatus status = engine_->GetStatus();
  EXPECT_EQ(status.retained.version, 1u);
  EXPECT_EQ(status.retained.bytes, r->bytes);
  EXPECT_EQ(status.committed_version, 1u);  // a replay commits nothing new
  ASSERT_EQ(status.last_replays.size(), 1u);
  // The next version must still exceed the committed one.
  EXPECT_EQ(Publish(2).status, PublicationStatus::kCommitted);
}

TEST_F(ReplayTest, ReceiversThatSubscribeBehindAreCaughtUpAndTheOthersTakeNoPart) {
  Make({.where = transport::RetainWhere::kHost}, /*with_engine=*/false);
  transport::testing::InprocReceiver* r0 = StartReceiver("r0");
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  ASSERT_EQ(Publish(2).status, PublicationStatus::kCommitted);
  ASSERT_TRUE(r0->WaitForCommitted(2, kWait));
  // Holding v2 already: nothing to do. Holding v1, and nothing: caught up.
  StartReceiver("current", /*held=*/2);
  transport::testing::InprocReceiver* late = StartReceiver("late");
  ASSERT_TRUE(late->WaitForCommitted(2, kWait));
  EXPECT_EQ(late->committed_tensors(), Expected(2));
  transport::testing::InprocReceiver* behind = StartReceiver("behind", /*held=*/1);
  ASSERT_TRUE(behind->WaitForCommitted(2, kWait));
  EXPECT_EQ(behind->committed_tensors(), Expected(2));
  // Each catch-up is recorded after its receivers were told to apply.
  const std::vector<ReplayReport> r = WaitForReplays(2);
  EXPECT_EQ(Replays("catch_up", "completed"), 2);
  size_t caught_up = 0;
  for (const ReplayReport& report : r) {
    EXPECT_EQ(report.kind, ReplayKind::kCatchUp);
    EXPECT_TRUE(report.completed) << report.error;
    for (const transport::ReceiverOutcome& o : report.receivers) {
      EXPECT_TRUE(o.name == "late" || o.name == "behind") << o.name << " took part";
      caught_up += o.committed ? 1 : 0;
    }
  }
  EXPECT_EQ(caught_up, 2u);
  EXPECT_EQ(r0->committed_version(), 2u);
  EXPECT_TRUE(r0->aborted_versions().empty());
  // Every receiver holds v2: the next version reaches all four.
  const PublicationReport v3 = Publish(3);
  ASSERT_EQ(v3.status, PublicationStatus::kCommitted) << v3.error;
  EXPECT_EQ(v3.receivers.size(), 4u);
}

TEST_F(ReplayTest, ATrainersPublicationPreemptsACatchUpAndWins) {
  Make({.where = transport::RetainWhere::kHost}, /*with_engine=*/false,
       /*ack_deadline=*/absl::Seconds(60));
  transport::testing::InprocReceiver* r0 = StartReceiver("r0");
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  // A receiver behind that never acknowledges: its catch-up waits on it.
  StartReceiver("stalled", /*held=*/0, /*never_ack=*/true);
  const absl::Time deadline = absl::Now() + kWait;
  auto receiving = [&] {
    for (const transport::ReceiverInfo& i : engine_->GetStatus().receivers) {
      if (i.name == "stalled" && i.state == transport::ReceiverState::kReceiving) return true;
    }
    return false;
  };
  while (!receiving() && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(receiving());
  // The trainer's v2 takes the slot from the catch-up (well before its 60 s deadline).
  auto session = engine_->Open(testing::Header(2));
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<ReplayReport> r = engine_->GetStatus().last_replays;
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(r[0].preempted);
  EXPECT_FALSE(r[0].completed);
  EXPECT_EQ(Replays("catch_up", "preempted"), 1);
  receivers_["stalled"]->Stop();  // it leaves; v2 reaches the others
  receivers_.erase("stalled");
  ASSERT_TRUE(testing::Send(**session, Batches(2)).ok());
  absl::StatusOr<PublicationReport> v2 = (*session)->Commit();
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->status, PublicationStatus::kCommitted) << v2->error;
  ASSERT_TRUE(r0->WaitForCommitted(2, kWait));
  EXPECT_EQ(r0->committed_tensors(), Expected(2));
}

// A version queued behind one that aborts takes the slot before the restore of the committed
// version (which it replaces anyway): the restore yields instead of holding the new version
// back, and the engine ends on the new version, whole.
TEST_F(ReplayTest, AVersionQueuedBehindAnAbortGoesBeforeTheRestore) {
  Make({.where = transport::RetainWhere::kHost});
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  faults_->Arm(Fault{.kind = FaultKind::kDisconnect, .bucket = 1, .attempts = 3});
  auto v2 = engine_->Open(testing::Header(2));
  ASSERT_TRUE(v2.ok()) << v2.status();
  std::atomic<bool> v3_done{false};
  absl::StatusOr<PublicationReport> v3_report = absl::UnknownError("not run");
  std::thread queued([&] {
    PublicationHeader h = testing::Header(3);
    h.queue = true;
    h.queue_timeout = absl::Seconds(60);
    auto v3 = engine_->Open(h);
    if (v3.ok()) {
      faults_->Arm(Fault{});
      if (absl::Status s = testing::Send(**v3, Batches(3)); !s.ok()) {
        v3_report = s;
      } else {
        v3_report = (*v3)->Commit();
      }
    } else {
      v3_report = v3.status();
    }
    v3_done = true;
  });
  const absl::Time deadline = absl::Now() + kWait;
  while (engine_->GetStatus().queued_publications != 1 && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(engine_->GetStatus().queued_publications, 1);
  ASSERT_TRUE(testing::Send(**v2, Batches(2)).ok());
  absl::StatusOr<PublicationReport> r2 = (*v2)->Commit();
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->status, PublicationStatus::kAborted);
  queued.join();
  ASSERT_TRUE(v3_done);
  ASSERT_TRUE(v3_report.ok()) << v3_report.status();
  EXPECT_EQ(v3_report->status, PublicationStatus::kCommitted) << v3_report->error;
  EXPECT_EQ(engine_->GetStatus().queued_publications, 0);
  // No restore of v1 ran over v3's slot: the engine holds v3, whole.
  EXPECT_EQ(Replays("restore", "completed"), 0);
  EXPECT_FALSE(fake_->dirty());
  EXPECT_EQ(fake_->complete_version(), 3u);
  EXPECT_EQ(fake_->weights(), Expected(3));
}

TEST_F(ReplayTest, NothingIsReplayedOverTheBoundOrWithTheCopyOff) {
  Make({.where = transport::RetainWhere::kHost, .max_bytes = 1024});
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  EngineStatus status = engine_->GetStatus();
  EXPECT_EQ(status.retained.version, 0u);
  EXPECT_EQ(status.retained.over_bound, 1u);
  absl::StatusOr<ReplayReport> r = engine_->Restore("test");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::HasSubstr(r.status(), "over the bound of 1024 bytes")) << r.status();
  // An aborted version that left the engine dirty has nothing to be restored from: it waits
  // for the next version, paused.
  faults_->Arm(Fault{.kind = FaultKind::kDisconnect, .bucket = 1, .attempts = 3});
  ASSERT_EQ(Publish(2).status, PublicationStatus::kAborted);
  faults_->Arm(Fault{});
  EXPECT_TRUE(fake_->dirty());
  EXPECT_TRUE(engine_->GetStatus().last_replays.empty());

  TearDown();
  Make({.where = transport::RetainWhere::kOff});
  ASSERT_EQ(Publish(1).status, PublicationStatus::kCommitted);
  r = engine_->Restore("test");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::HasSubstr(r.status(), "--retain=off")) << r.status();
}

TEST(ReplayOptions, DeviceOrPinnedRetentionWithoutTheGpuPathIsRefusedAtStart) {
  for (transport::RetainWhere where :
       {transport::RetainWhere::kDevice, transport::RetainWhere::kPinned}) {
    EngineOptions options;
    options.retain.where = where;
    auto engine = Engine::Create(options, nullptr);
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(testing::HasSubstr(engine.status(), "needs the GPU path")) << engine.status();
  }
}

}  // namespace
}  // namespace wpub::engine
