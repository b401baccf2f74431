// The lifecycle through the Engine: an abort or a Fail from another thread while Commit waits
// on the transports, Drain during a Commit, Fail vs Abort before Commit, and a session
// destroyed without (or after) Commit -- each publication reported exactly once and its slot
// freed. Every wait is for an exact state (a transport that blocks until it is aborted).
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/engine.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using testing::HasSubstr;
using testing::Header;

// A transport whose WaitAcknowledged blocks until Abort: Commit parks there, at a known point
// of the transfer, until the test acts.
class GateTransport final : public transport::Transport {
 public:
  transport::TransportCapabilities capabilities() const override {
    transport::TransportCapabilities c;
    c.name = "gate";
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest&) override {
    std::lock_guard lock(mu_);
    aborted_ = false;
    ++begins_;
    return std::vector<std::string>{"gate-engine"};
  }
  absl::Status Send(std::shared_ptr<const transport::Bucket>) override { return absl::OkStatus(); }
  absl::Status WaitAcknowledged(absl::Time) override {
    std::unique_lock lock(mu_);
    waiting_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return aborted_; });
    waiting_ = false;
    return absl::CancelledError("gate: aborted while waiting");
  }
  absl::Status Commit() override {
    std::lock_guard lock(mu_);
    ++commits_;
    return absl::OkStatus();
  }
  void Abort(absl::string_view reason) override {
    std::lock_guard lock(mu_);
    aborted_ = true;
    aborts_.emplace_back(reason);
    cv_.notify_all();
  }
  std::vector<transport::ReceiverOutcome> Outcomes() const override {
    transport::ReceiverOutcome o;
    o.name = "gate-engine";
    return {o};
  }
  std::vector<transport::ReceiverInfo> Receivers() const override {
    return {
        transport::ReceiverInfo{"gate-engine", transport::ReceiverState::kIdle, 0, absl::Now()}};
  }

  // Blocks until a Commit waits for acknowledgements.
  void WaitUntilWaiting() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return waiting_; });
  }
  std::vector<std::string> aborts() const {
    std::lock_guard lock(mu_);
    return aborts_;
  }
  int begins() const {
    std::lock_guard lock(mu_);
    return begins_;
  }
  int commits() const {
    std::lock_guard lock(mu_);
    return commits_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool waiting_ = false;
  bool aborted_ = false;
  int begins_ = 0;
  int commits_ = 0;
  std::vector<std::string> aborts_;
};

class EngineLifecycleTest : public ::testing::Test {
 protected:
  EngineLifecycleTest() {
    EngineOptions options;
    options.bucket_bytes = 1 << 16;
    EngineComponents components;
    auto gate = std::make_unique<GateTransport>();
    gate_ = gate.get();
    components.transports.push_back(std::move(gate));
    auto engine = Engine::Create(options, nullptr, std::move(components));
    EXPECT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  std::unique_ptr<PublicationSession> OpenAndSend(uint64_t version) {
    auto session = engine_->Open(Header(version));
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return nullptr;
    EXPECT_TRUE(
        testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
    return *std::move(session);
  }

  // Commits `session` on another thread, waits until that Commit blocks on the transports,
  // runs `act`, and returns what Commit returned.
  template <class Act>
  absl::StatusOr<PublicationReport> CommitAndThen(PublicationSession& session, Act act) {
    absl::StatusOr<PublicationReport> report = absl::UnknownError("Commit did not return");
    std::thread committer([&] { report = session.Commit(); });
    gate_->WaitUntilWaiting();
    act();
    committer.join();
    return report;
  }

  // The slot is free: the next version opens at once.
  void ExpectSlotFree(uint64_t next_version) {
    EXPECT_FALSE(engine_->GetStatus().active.has_value());
    auto next = engine_->Open(Header(next_version));
    EXPECT_TRUE(next.ok()) << next.status();
  }

  GateTransport* gate_ = nullptr;
  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineLifecycleTest, AbortDuringCommitReturnsAbortedOnceAndFreesTheSlot) {
  auto session = OpenAndSend(1);
  ASSERT_NE(session, nullptr);
  auto report = CommitAndThen(*session, [&] {
    const EngineStatus during = engine_->GetStatus();
    ASSERT_TRUE(during.active.has_value());
    EXPECT_EQ(during.active->state, PublicationState::kStaged);
    session->Abort(absl::CancelledError("trainer went away"));
  });
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kCancelled);
  EXPECT_EQ(report->error, "trainer went away");
  EXPECT_EQ(report->attempts, 1u);
  EXPECT_GT(report->buckets, 0u);
  ASSERT_EQ(report->receivers.size(), 1u);  // the gate's engine (the pull side has nobody)
  EXPECT_EQ(report->receivers[0].name, "gate-engine");
  // The transports were told why, by the request and again at the end; never to commit.
  const std::vector<std::string> aborts = gate_->aborts();
  ASSERT_FALSE(aborts.empty());
  for (const std::string& reason : aborts) EXPECT_EQ(reason, "trainer went away");
  EXPECT_EQ(gate_->commits(), 0);
  EXPECT_EQ(gate_->begins(), 1);  // an abort request is never retried

  const std::vector<PublicationReport> reports = engine_->RecentReports(10);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].status, PublicationStatus::kAborted);
  EXPECT_EQ(engine_->GetStatus().committed_version, 0u);
  // Later calls change nothing.
  EXPECT_EQ(session->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  session->Abort(absl::CancelledError("again"));
  session->Fail(absl::InvalidArgumentError("again"));
  session.reset();
  EXPECT_EQ(engine_->RecentReports(10).size(), 1u);
  ExpectSlotFree(1);  // an aborted version may be retried
}

TEST_F(EngineLifecycleTest, FailDuringCommitStillEndsAbortedAndTheFirstRequestStands) {
  auto session = OpenAndSend(2);
  ASSERT_NE(session, nullptr);
  auto report = CommitAndThen(*session, [&] {
    session->Fail(absl::InvalidArgumentError("stream: malformed chunk"));
    session->Abort(absl::CancelledError("second request"));
  });
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(report->error, "stream: malformed chunk");
  const std::vector<PublicationReport> reports = engine_->RecentReports(10);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].error, "stream: malformed chunk");
  ExpectSlotFree(3);
}

TEST_F(EngineLifecycleTest, DrainDuringCommitAbortsItWithTheDeadline) {
  auto session = OpenAndSend(4);
  ASSERT_NE(session, nullptr);
  absl::Status drained;
  auto report = CommitAndThen(*session, [&] { drained = engine_->Drain(absl::Now()); });
  EXPECT_EQ(drained.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(HasSubstr(drained, "publication 4 did not finish")) << drained;
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(engine_->RecentReports(10).size(), 1u);
  EXPECT_FALSE(engine_->GetStatus().active.has_value());
  EXPECT_EQ(engine_->Open(Header(5)).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(EngineLifecycleTest, FailBeforeCommitReportsFailedAbortReportsAborted) {
  auto failed = OpenAndSend(1);
  ASSERT_NE(failed, nullptr);
  failed->Fail(absl::InvalidArgumentError("stream: tensor w has a bad chunk"));
  EXPECT_FALSE(engine_->GetStatus().active.has_value());
  const absl::Status late = failed->AddBatch(BatchInput{});
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(late, "publication 1 has ended: INVALID_ARGUMENT")) << late;
  EXPECT_EQ(failed->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  failed.reset();

  auto aborted = OpenAndSend(1);
  ASSERT_NE(aborted, nullptr);
  aborted->Abort(absl::CancelledError("trainer restarts"));
  aborted.reset();

  const std::vector<PublicationReport> reports = engine_->RecentReports(10);
  ASSERT_EQ(reports.size(), 2u);  // newest first; neither the Fail nor the Abort counted twice
  EXPECT_EQ(reports[0].status, PublicationStatus::kAborted);
  EXPECT_EQ(reports[0].code, absl::StatusCode::kCancelled);
  EXPECT_EQ(reports[0].error, "trainer restarts");
  EXPECT_EQ(reports[1].status, PublicationStatus::kFailed);
  EXPECT_EQ(reports[1].code, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reports[1].error, "stream: tensor w has a bad chunk");
  // Neither touched the transports: they had not begun.
  EXPECT_TRUE(gate_->aborts().empty());
  EXPECT_EQ(gate_->begins(), 0);
}

TEST_F(EngineLifecycleTest, ASessionDestroyedWithoutCommitReportsAbortedOnce) {
  OpenAndSend(6).reset();
  const std::vector<PublicationReport> reports = engine_->RecentReports(10);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].status, PublicationStatus::kAborted);
  EXPECT_EQ(reports[0].code, absl::StatusCode::kCancelled);
  EXPECT_NE(reports[0].error.find("closed before commit"), std::string::npos) << reports[0].error;
  EXPECT_GT(reports[0].tensors_quantized, 0u);
  EXPECT_EQ(reports[0].phases.ingest, 0.0);  // Commit never ran
  ExpectSlotFree(6);
}

TEST_F(EngineLifecycleTest, ABadCommitIsReportedFailedOnceAndTheSessionEndIsANoOp) {
  auto session = engine_->Open(Header(7));
  ASSERT_TRUE(session.ok());
  const auto committed = (*session)->Commit();  // nothing was sent
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(committed.status(), "publication 7 is empty")) << committed.status();
  session->reset();
  const std::vector<PublicationReport> reports = engine_->RecentReports(10);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].status, PublicationStatus::kFailed);
  EXPECT_EQ(reports[0].buckets, 0u);
  EXPECT_TRUE(reports[0].receivers.empty());
  EXPECT_EQ(gate_->begins(), 0);
  ExpectSlotFree(7);
}

}  // namespace
}  // namespace wpub::engine
