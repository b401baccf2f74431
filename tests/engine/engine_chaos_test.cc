// Chaos: 200 publications through the engine with a random fault in most of them (a bucket
// dropped, delayed or corrupted, a receiver cut off, the commit lost, a rollout engine's
// requests failing, now and then for every attempt), against two gRPC-pull-style receivers
// and an SGLang-like engine that loads bytes on receipt and serves requests all the while.
// After every publication: each receiver holds exactly one complete version (byte for byte the
// reference of that version), the engine never served a mix of versions, the daemon serves,
// and the report tells the truth about who applied what.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <random>
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

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pull = transport::PullTransport::Create({});
    ASSERT_TRUE(pull.ok());
    pull_ = std::move(*pull);
    pull_faults_ =
        new transport::testing::FaultInjectingTransport(pull_.get(), [this] { CutReceiver(); });
    fake_ = std::make_unique<transport::testing::FakeRolloutEngine>("sglang-0");
    fake_faults_ = new transport::testing::FaultInjectingTransport(
        fake_.get(), [this] { fake_->FailRequests(); });
    EngineComponents components;
    components.transports.emplace_back(fake_faults_);
    components.transports.emplace_back(pull_faults_);
    EngineOptions options;
    options.bucket_bytes = 4096;
    options.min_bucket_bytes = 1024;
    options.ack_deadline = absl::Milliseconds(200);  // a dropped bucket times out quickly
    options.max_attempts = 3;
    auto metrics = metrics::EngineMetrics::Create(&registry_);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *std::move(metrics);
    auto engine = Engine::Create(options, metrics_.get(), std::move(components));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    for (const char* name : {"r0", "r1"}) StartReceiver(name);
  }

  void TearDown() override {
    receivers_.clear();
    engine_.reset();  // owns the fault decorators
    pull_.reset();
  }

  void StartReceiver(const std::string& name) {
    auto r = transport::testing::InprocReceiver::Start(pull_.get(), {.name = name});
    ASSERT_TRUE(r.ok()) << r.status();
    receivers_[name] = std::move(*r);
  }

  // The disconnect fault: receiver r1 goes away in the middle of a publication (its thread
  // stops and its subscription closes); a new r1 joins after the publication ends.
  void CutReceiver() {
    receivers_["r1"]->Stop();
    cut_ = true;
  }

  const Outputs& Expected(uint64_t version) { return model_.Expected(version); }

  std::vector<testing::TestBatch> Batches(uint64_t version) const {
    return model_.Batches(version);
  }

  // wpub_engines{state}: how many receivers are in `state` now.
  double Engines(const std::string& state) {
    for (const auto& family : registry_.Collect()) {
      if (family.name != metrics::kEngines) continue;
      for (const auto& m : family.metric) {
        for (const auto& l : m.label) {
          if (l.name == "state" && l.value == state) return m.gauge.value;
        }
      }
    }
    return -1;
  }

  prometheus::Registry registry_;
  std::unique_ptr<metrics::EngineMetrics> metrics_;  // outlives engine_
  std::unique_ptr<transport::PullTransport> pull_;
  transport::testing::FaultInjectingTransport* pull_faults_ = nullptr;  // owned by the engine
  std::unique_ptr<transport::testing::FakeRolloutEngine> fake_;
  transport::testing::FaultInjectingTransport* fake_faults_ = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine_;
  std::map<std::string, std::unique_ptr<transport::testing::InprocReceiver>> receivers_;
  bool cut_ = false;
  testing::VersionedModel model_{1000};
};

TEST_F(ChaosTest, TwoHundredPublicationsWithRandomFaultsNeverCommitFalselyOrServeAMix) {
  std::atomic<bool> stop{false};
  std::thread traffic([&] {
    while (!stop.load()) {
      fake_->Generate();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });

  std::mt19937 rng(20261201);
  const uint32_t buckets = [&] {
    auto session = engine_->Open(testing::Header(1));
    EXPECT_TRUE(session.ok());
    EXPECT_TRUE(testing::Send(**session, Batches(1)).ok());
    auto report = (*session)->Commit();
    EXPECT_TRUE(report.ok() && report->status == PublicationStatus::kCommitted);
    return report.ok() ? report->buckets : 0u;
  }();
  ASSERT_GT(buckets, 3u);
  for (auto& [name, r] : receivers_) ASSERT_TRUE(r->WaitForCommitted(1, kWait)) << name;
  uint64_t committed = 1;
  std::map<std::string, uint64_t> held = {{"r0", 1}, {"r1", 1}};
  int aborted = 0, retried_and_committed = 0, persistent = 0, left_dirty = 0;
  std::map<std::string, int> kinds;

  for (uint64_t v = 2; v <= 200; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    transport::testing::Fault fault;
    static constexpr transport::testing::FaultKind kKinds[] = {
        transport::testing::FaultKind::kNone,       transport::testing::FaultKind::kDrop,
        transport::testing::FaultKind::kDelay,      transport::testing::FaultKind::kCorrupt,
        transport::testing::FaultKind::kDisconnect, transport::testing::FaultKind::kCommit};
    fault.kind = kKinds[rng() % 6];
    fault.bucket = rng() % buckets;
    const bool on_engine = rng() % 2 == 0 && fault.kind != transport::testing::FaultKind::kCorrupt;
    if (fault.kind != transport::testing::FaultKind::kNone && rng() % 10 == 0) {
      fault.attempts = 3;  // every attempt fails: the publication aborts for good
      ++persistent;
    }
    kinds[absl::StrCat(on_engine ? "engine " : "pull ",
                       transport::testing::FaultKindName(fault.kind))]++;
    (on_engine ? fake_faults_ : pull_faults_)->Arm(fault);
    cut_ = false;

    auto session = engine_->Open(testing::Header(v));
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(testing::Send(**session, Batches(v)).ok());
    absl::StatusOr<PublicationReport> report = (*session)->Commit();
    session->reset();
    (on_engine ? fake_faults_ : pull_faults_)
        ->Arm(transport::testing::Fault{});  // what the attempts left armed
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_NE(report->status, PublicationStatus::kFailed) << report->error;
    const bool ok = report->status == PublicationStatus::kCommitted;
    if (ok) {
      committed = v;
      if (report->attempts > 1) ++retried_and_committed;
    } else {
      ++aborted;
    }

    // The daemon serves and says what it holds.
    const EngineStatus status = engine_->GetStatus();
    EXPECT_FALSE(status.active.has_value());
    EXPECT_EQ(status.committed_version, committed);

    // The report's outcome per receiver is what the receiver did.
    std::map<std::string, bool> told;
    for (const transport::ReceiverOutcome& o : report->receivers) told[o.name] = o.committed;
    for (auto& [name, r] : receivers_) {
      if (name == "r1" && cut_) continue;
      if (told[name]) {
        ASSERT_TRUE(r->WaitForCommitted(v, kWait)) << name;
        held[name] = v;
      } else {
        // Every attempt of v was aborted on it: wait for the last abort before reading.
        EXPECT_FALSE(ok) << name << " was not told to commit a committed version";
        ASSERT_TRUE(r->WaitForAborts(v, 1, kWait)) << name;
      }
      EXPECT_EQ(r->committed_version(), held[name]) << name;
      const Outputs none;
      EXPECT_TRUE(r->committed_tensors() == (held[name] == 0 ? none : Expected(held[name])))
          << name << " holds something other than version " << held[name];
    }
    if (cut_) {
      receivers_["r1"].reset();
      StartReceiver("r1");
      held["r1"] = 0;
    }
    // The rollout engine: applied v when the report says so; otherwise either it serves a
    // complete older version or it is paused and reported dirty.
    if (told["sglang-0"]) {
      EXPECT_EQ(fake_->complete_version(), v);
      EXPECT_TRUE(fake_->serving());
      EXPECT_TRUE(fake_->weights() == Expected(v));
    } else if (fake_->dirty()) {
      EXPECT_FALSE(fake_->serving());
      EXPECT_EQ(Engines("dirty"), 1) << "wpub_engines{state=\"dirty\"}";
      ++left_dirty;
      bool reported = false;
      for (const transport::ReceiverOutcome& o : report->receivers) reported |= o.dirty;
      EXPECT_TRUE(reported) << "a dirty engine is missing from the report";
    } else {
      EXPECT_TRUE(fake_->serving());
      EXPECT_NE(fake_->complete_version(), 0u);
    }
  }
  stop = true;
  traffic.join();

  const uint64_t injected = pull_faults_->injected() + fake_faults_->injected();
  EXPECT_EQ(fake_->mixed_generations(), 0u);
  EXPECT_GT(fake_->generations(), 100u);
  EXPECT_GT(injected, 100u);
  EXPECT_GT(retried_and_committed, 10);
  EXPECT_GT(aborted, 5);
  EXPECT_GT(left_dirty, 0);
  std::printf(
      "chaos: 200 publications, %llu faults injected, %d aborted, %d committed after a retry, "
      "%d persistent faults, %d left the engine dirty, %llu generations served, %llu on mixed "
      "weights\n",
      static_cast<unsigned long long>(injected), aborted, retried_and_committed, persistent,
      left_dirty, static_cast<unsigned long long>(fake_->generations()),
      static_cast<unsigned long long>(fake_->mixed_generations()));
  for (const auto& [kind, n] : kinds) std::printf("chaos: %-18s %d\n", kind.c_str(), n);
}

}  // namespace
}  // namespace wpub::engine
