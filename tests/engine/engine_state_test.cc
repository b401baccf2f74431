// The publication state machine: version rules, one publication at a time, queueing, calls
// after the end, shutdown and drain.
#include <gtest/gtest.h>

#include <thread>

#include "core/engine/engine.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using testing::HasSubstr;
using testing::Header;

std::unique_ptr<Engine> NewEngine() {
  EngineOptions options;
  options.bucket_bytes = 1 << 16;
  auto engine = Engine::Create(options, nullptr);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(*engine);
}

absl::StatusOr<PublicationReport> CommitSmall(Engine& engine, uint64_t version) {
  auto session = engine.Open(Header(version));
  if (!session.ok()) return session.status();
  if (absl::Status s =
          testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1));
      !s.ok()) {
    return s;
  }
  return (*session)->Commit();
}

TEST(EngineStateTest, TransitionsOpenStagedCommitted) {
  auto engine = NewEngine();
  EXPECT_FALSE(engine->GetStatus().active.has_value());
  auto session = engine->Open(Header(1));
  ASSERT_TRUE(session.ok()) << session.status();
  EngineStatus st = engine->GetStatus();
  ASSERT_TRUE(st.active.has_value());
  EXPECT_EQ(st.active->version, 1u);
  EXPECT_EQ(st.active->state, PublicationState::kOpen);
  EXPECT_EQ(st.backend, "cpu");
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  EXPECT_GT(engine->GetStatus().active->tensors, 0u);
  EXPECT_EQ(engine->GetStatus().active->batches, (*session)->num_batches());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
  st = engine->GetStatus();
  EXPECT_EQ(st.committed_version, 1u);
  EXPECT_EQ(st.committed_model_id, "glm-small");
  EXPECT_FALSE(st.active.has_value());
  // Calls after the end.
  EXPECT_EQ((*session)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*session)->AddBatch(BatchInput{}).code(), absl::StatusCode::kFailedPrecondition);
  (*session)->Abort(absl::CancelledError("late"));  // no-op
  EXPECT_EQ(engine->GetStatus().committed_version, 1u);
  EXPECT_EQ(engine->RecentReports(5).size(), 1u);
}

TEST(EngineStateTest, VersionsMustIncreaseStrictly) {
  auto engine = NewEngine();
  ASSERT_TRUE(CommitSmall(*engine, 3).ok());
  for (uint64_t v : {1u, 3u}) {
    auto s = engine->Open(Header(v));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(HasSubstr(s.status(), "committed version 3")) << s.status();
  }
  auto zero = engine->Open(Header(0));
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(zero.status(), "version"));
  // Gaps are fine; an aborted version may be retried.
  {
    auto s = engine->Open(Header(7));
    ASSERT_TRUE(s.ok());
    (*s)->Abort(absl::CancelledError("retry later"));
  }
  auto report = CommitSmall(*engine, 7);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
  EXPECT_EQ(engine->GetStatus().committed_version, 7u);
}

TEST(EngineStateTest, OnePublicationAtATime) {
  auto engine = NewEngine();
  auto first = engine->Open(Header(1));
  ASSERT_TRUE(first.ok());
  auto second = engine->Open(Header(2));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(second.status(), "version 1 is active")) << second.status();

  PublicationHeader queued = Header(2);
  queued.queue = true;
  queued.queue_timeout = absl::Milliseconds(100);
  auto timed_out = engine->Open(queued);
  EXPECT_EQ(timed_out.status().code(), absl::StatusCode::kDeadlineExceeded);

  // A queued Open proceeds once the active publication ends.
  queued.queue_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<PublicationSession>> waited;
  std::thread waiter([&] { waited = engine->Open(queued); });
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(testing::Send(**first, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  ASSERT_TRUE((*first)->Commit().ok());
  waiter.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ((*waited)->version(), 2u);
}

TEST(EngineStateTest, DrainAbortsAnUnfinishedPublicationAndRefusesNewOnes) {
  auto engine = NewEngine();
  auto session = engine->Open(Header(1));
  ASSERT_TRUE(session.ok());
  const absl::Status drained = engine->Drain(absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(drained.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(HasSubstr(drained, "publication 1"));
  EXPECT_EQ((*session)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->Open(Header(2)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(engine->GetStatus().shutting_down);
  EXPECT_EQ(engine->RecentReports(1)[0].status, PublicationStatus::kAborted);
}

TEST(EngineStateTest, DrainWaitsForACommitThatFinishesInTime) {
  auto engine = NewEngine();
  ASSERT_TRUE(engine->Drain(absl::Now() + absl::Seconds(1)).ok());  // nothing active
  auto again = NewEngine();
  auto session = again->Open(Header(1));
  ASSERT_TRUE(session.ok());
  again->BeginShutdown();
  EXPECT_EQ(again->Open(Header(2)).status().code(), absl::StatusCode::kUnavailable);
  std::thread committer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(
        testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
    auto r = (*session)->Commit();
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, PublicationStatus::kCommitted);
  });
  EXPECT_TRUE(again->Drain(absl::Now() + absl::Seconds(20)).ok());
  committer.join();
  EXPECT_EQ(again->GetStatus().committed_version, 1u);
}

TEST(EngineStateTest, ASessionThatOutlivesTheEngineAbortsSafely) {
  auto engine = NewEngine();
  auto session = engine->Open(Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  engine.reset();
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kUnavailable);
}

TEST(EngineStateTest, CreateValidatesOptions) {
  EngineOptions o;
  o.bucket_bytes = 10;
  EXPECT_EQ(Engine::Create(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  o = EngineOptions{};
  o.ack_deadline = absl::ZeroDuration();
  EXPECT_EQ(Engine::Create(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wpub::engine
