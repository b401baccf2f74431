// The publication lifecycle (core/engine/lifecycle.h): every legal transition, the illegal ones
// refused, ending twice, abort requests while Commit runs and at the point of no return, and the
// public state derived from the stage.
#include "core/engine/lifecycle.h"

#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using testing::HasSubstr;
using Stage = LifecycleStage;
using StopResult = Lifecycle::StopResult;

// A Lifecycle whose discard calls are logged.
class LifecycleTest : public ::testing::Test {
 protected:
  LifecycleTest()
      : lifecycle_(7, [this](absl::string_view reason) {
          std::lock_guard lock(mu_);
          discards_.emplace_back(reason);
        }) {}

  std::vector<std::string> discards() {
    std::lock_guard lock(mu_);
    return discards_;
  }
  // kOpen -> kTransferring through every stage between.
  void ToTransferring() {
    ASSERT_TRUE(lifecycle_.BeginCommit().ok());
    ASSERT_TRUE(lifecycle_.Stage().ok());
    ASSERT_TRUE(lifecycle_.BeginTransfer().ok());
  }

  std::mutex mu_;
  std::vector<std::string> discards_;
  Lifecycle lifecycle_;
};

TEST_F(LifecycleTest, EveryStageOfACommitInOrder) {
  EXPECT_EQ(lifecycle_.stage(), Stage::kOpen);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kOpen);
  EXPECT_TRUE(lifecycle_.CheckOpen().ok());
  ASSERT_TRUE(lifecycle_.BeginCommit().ok());
  EXPECT_EQ(lifecycle_.stage(), Stage::kChecking);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kOpen);
  ASSERT_TRUE(lifecycle_.Stage().ok());
  EXPECT_EQ(lifecycle_.stage(), Stage::kStaged);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kStaged);
  ASSERT_TRUE(lifecycle_.BeginTransfer().ok());
  EXPECT_EQ(lifecycle_.stage(), Stage::kTransferring);
  // A retry begins the transfer again.
  ASSERT_TRUE(lifecycle_.BeginTransfer().ok());
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kStaged);
  int commits = 0;
  ASSERT_TRUE(lifecycle_
                  .PassPointOfNoReturn([&] {
                    EXPECT_EQ(lifecycle_.stage(), Stage::kCommitting);
                    ++commits;
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_EQ(commits, 1);
  EXPECT_EQ(lifecycle_.stage(), Stage::kCommitting);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kStaged);
  const Lifecycle::Ending e = lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus());
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.outcome, PublicationStatus::kCommitted);
  EXPECT_TRUE(e.status.ok());
  EXPECT_TRUE(e.commit_ran);
  EXPECT_TRUE(e.transfer_begun);
  EXPECT_EQ(lifecycle_.stage(), Stage::kCommitted);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kCommitted);
  EXPECT_TRUE(discards().empty());  // a committed version is never discarded
  const absl::Status after = lifecycle_.CheckOpen();
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(after, "publication 7 has ended: OK")) << after;
}

TEST_F(LifecycleTest, IllegalTransitionsAreRefusedAndChangeNothing) {
  // From kOpen: nothing but BeginCommit moves forward.
  EXPECT_EQ(lifecycle_.Stage().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(lifecycle_.BeginTransfer().code(), absl::StatusCode::kFailedPrecondition);
  bool ran = false;
  const absl::Status early = lifecycle_.PassPointOfNoReturn([&] {
    ran = true;
    return absl::OkStatus();
  });
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(early, "cannot commit while open")) << early;
  EXPECT_FALSE(ran);
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus()).ended_now);
  EXPECT_EQ(lifecycle_.stage(), Stage::kOpen);

  ASSERT_TRUE(lifecycle_.BeginCommit().ok());
  const absl::Status twice = lifecycle_.BeginCommit();
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(twice, "publication 7 is already committing")) << twice;
  EXPECT_TRUE(HasSubstr(lifecycle_.CheckOpen(), "already committing"));
  EXPECT_EQ(lifecycle_.BeginTransfer().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(lifecycle_.Stage().ok());
  EXPECT_EQ(lifecycle_.Stage().code(), absl::StatusCode::kFailedPrecondition);
  // Committed only past the point of no return.
  ASSERT_TRUE(lifecycle_.BeginTransfer().ok());
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus()).ended_now);
  EXPECT_EQ(lifecycle_.stage(), Stage::kTransferring);

  // After the end nothing moves.
  ASSERT_TRUE(lifecycle_.End(PublicationStatus::kAborted, absl::AbortedError("x")).ended_now);
  EXPECT_EQ(lifecycle_.BeginCommit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(lifecycle_.Stage().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(lifecycle_.BeginTransfer().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(lifecycle_
                .PassPointOfNoReturn([&] {
                  ran = true;
                  return absl::OkStatus();
                })
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(ran);
  EXPECT_EQ(lifecycle_.stage(), Stage::kAborted);
}

TEST_F(LifecycleTest, EndingTwiceIsANoOp) {
  const Lifecycle::Ending first =
      lifecycle_.End(PublicationStatus::kFailed, absl::InvalidArgumentError("tensor w: bad"));
  EXPECT_TRUE(first.ended_now);
  EXPECT_EQ(first.outcome, PublicationStatus::kFailed);
  EXPECT_FALSE(first.commit_ran);
  EXPECT_EQ(lifecycle_.stage(), Stage::kFailed);
  EXPECT_EQ(lifecycle_.public_state(), PublicationState::kAborted);
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kAborted, absl::CancelledError("y")).ended_now);
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kFailed, absl::InternalError("z")).ended_now);
  Lifecycle::Ending untouched;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("w"), &untouched),
            StopResult::kIgnored);
  EXPECT_FALSE(untouched.ended_now);
  EXPECT_EQ(lifecycle_.stage(), Stage::kFailed);
  EXPECT_TRUE(HasSubstr(lifecycle_.CheckOpen(), "has ended: INVALID_ARGUMENT: tensor w: bad"));
  EXPECT_TRUE(discards().empty());  // the transports never began
}

TEST_F(LifecycleTest, StopWhileOpenEndsAtOnceWithItsOutcome) {
  Lifecycle::Ending e;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kFailed, absl::InvalidArgumentError("bad"), &e),
            StopResult::kEnded);
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.outcome, PublicationStatus::kFailed);
  EXPECT_EQ(e.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lifecycle_.stage(), Stage::kFailed);
  EXPECT_EQ(lifecycle_.BeginCommit().code(), absl::StatusCode::kFailedPrecondition);

  Lifecycle other(8, nullptr);
  EXPECT_EQ(other.Stop(PublicationStatus::kAborted, absl::CancelledError("gone"), &e),
            StopResult::kEnded);
  EXPECT_EQ(e.outcome, PublicationStatus::kAborted);
  EXPECT_EQ(other.stage(), Stage::kAborted);
}

TEST_F(LifecycleTest, StopWhileCommitRunsOnlyRecordsTheRequest) {
  ASSERT_TRUE(lifecycle_.BeginCommit().ok());
  Lifecycle::Ending untouched;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("first"), &untouched),
            StopResult::kRequested);
  EXPECT_FALSE(untouched.ended_now);
  EXPECT_EQ(lifecycle_.stage(), Stage::kChecking);  // the Commit thread ends it
  EXPECT_EQ(lifecycle_.abort_request().message(), "first");
  // The first request stands.
  EXPECT_EQ(
      lifecycle_.Stop(PublicationStatus::kFailed, absl::InvalidArgumentError("second"), &untouched),
      StopResult::kIgnored);
  EXPECT_EQ(lifecycle_.abort_request().message(), "first");
  EXPECT_TRUE(discards().empty());  // nothing began yet
  ASSERT_TRUE(lifecycle_.Stage().ok());
  const absl::Status refused = lifecycle_.BeginTransfer();
  EXPECT_EQ(refused.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(refused.message(), "first");
  EXPECT_EQ(lifecycle_.stage(), Stage::kStaged);
  // An ABORTED end reports the request, whatever status the Commit thread had at hand.
  const Lifecycle::Ending e =
      lifecycle_.End(PublicationStatus::kAborted, absl::DeadlineExceededError("other"));
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(e.status.message(), "first");
  EXPECT_TRUE(e.commit_ran);
  EXPECT_FALSE(e.transfer_begun);
  EXPECT_TRUE(discards().empty());
}

TEST_F(LifecycleTest, StopAfterTheTransferBeganTellsTheTransportsToStop) {
  ToTransferring();
  Lifecycle::Ending untouched;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("trainer gone"),
                            &untouched),
            StopResult::kRequested);
  EXPECT_EQ(discards(), std::vector<std::string>{"trainer gone"});
  // The request also keeps the next attempt and the commit from starting.
  EXPECT_EQ(lifecycle_.BeginTransfer().message(), "trainer gone");
  bool ran = false;
  EXPECT_EQ(lifecycle_
                .PassPointOfNoReturn([&] {
                  ran = true;
                  return absl::OkStatus();
                })
                .message(),
            "trainer gone");
  EXPECT_FALSE(ran);
  EXPECT_EQ(lifecycle_.stage(), Stage::kTransferring);
  const Lifecycle::Ending e = lifecycle_.End(PublicationStatus::kAborted, absl::AbortedError("x"));
  EXPECT_TRUE(e.ended_now);
  EXPECT_TRUE(e.transfer_begun);
  EXPECT_EQ(e.status.message(), "trainer gone");
  EXPECT_EQ(discards(), (std::vector<std::string>{"trainer gone", "trainer gone"}));
}

TEST_F(LifecycleTest, FailedEndKeepsTheBadInputStatusOverARequest) {
  ToTransferring();
  Lifecycle::Ending untouched;
  ASSERT_EQ(
      lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("cancel"), &untouched),
      StopResult::kRequested);
  const Lifecycle::Ending e =
      lifecycle_.End(PublicationStatus::kFailed, absl::InvalidArgumentError("tensor w: nan"));
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.outcome, PublicationStatus::kFailed);
  EXPECT_EQ(e.status.message(), "tensor w: nan");
  EXPECT_EQ(lifecycle_.stage(), Stage::kFailed);
  EXPECT_EQ(discards(), (std::vector<std::string>{"cancel", "tensor w: nan"}));
}

TEST_F(LifecycleTest, AbortAtThePointOfNoReturnIsRefused) {
  ToTransferring();
  ASSERT_TRUE(lifecycle_.PassPointOfNoReturn([] { return absl::OkStatus(); }).ok());
  Lifecycle::Ending untouched;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("late"), &untouched),
            StopResult::kRefused);
  EXPECT_FALSE(untouched.ended_now);
  EXPECT_TRUE(lifecycle_.abort_request().ok());
  // Only committing ends it now.
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kAborted, absl::AbortedError("x")).ended_now);
  EXPECT_FALSE(lifecycle_.End(PublicationStatus::kFailed, absl::InternalError("y")).ended_now);
  EXPECT_EQ(lifecycle_.stage(), Stage::kCommitting);
  EXPECT_TRUE(lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus()).ended_now);
  EXPECT_TRUE(discards().empty());
}

TEST_F(LifecycleTest, AnAbortFromAnotherThreadDuringTheCommitStepWaitsAndIsRefused) {
  ToTransferring();
  StopResult result = StopResult::kIgnored;
  std::thread aborter;
  ASSERT_TRUE(lifecycle_
                  .PassPointOfNoReturn([&] {
                    // The lock is held: the abort can only be looked at once this returns.
                    aborter = std::thread([&] {
                      Lifecycle::Ending untouched;
                      result = lifecycle_.Stop(PublicationStatus::kAborted,
                                               absl::CancelledError("late"), &untouched);
                    });
                    return absl::OkStatus();
                  })
                  .ok());
  aborter.join();
  EXPECT_EQ(result, StopResult::kRefused);
  EXPECT_TRUE(lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus()).ended_now);
  EXPECT_TRUE(discards().empty());
}

TEST_F(LifecycleTest, ARefusedCommitGoesBackBeforeThePointOfNoReturn) {
  ToTransferring();
  const absl::Status refused =
      lifecycle_.PassPointOfNoReturn([] { return absl::AbortedError("r1: left"); });
  EXPECT_EQ(refused.message(), "r1: left");
  EXPECT_EQ(lifecycle_.stage(), Stage::kTransferring);
  EXPECT_EQ(lifecycle_.abort_request().message(), "r1: left");
  // A later abort from another thread changes nothing; the Commit thread ends it ABORTED.
  Lifecycle::Ending untouched;
  EXPECT_EQ(lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("late"), &untouched),
            StopResult::kIgnored);
  EXPECT_TRUE(discards().empty());
  const Lifecycle::Ending e = lifecycle_.End(PublicationStatus::kAborted, absl::AbortedError("?"));
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.status.message(), "r1: left");
  EXPECT_EQ(discards(), std::vector<std::string>{"r1: left"});
}

TEST(LifecycleStageTest, PublicStateAndNames) {
  const std::vector<std::pair<Stage, PublicationState>> expected = {
      {Stage::kOpen, PublicationState::kOpen},
      {Stage::kChecking, PublicationState::kOpen},
      {Stage::kStaged, PublicationState::kStaged},
      {Stage::kTransferring, PublicationState::kStaged},
      {Stage::kPrepared, PublicationState::kStaged},
      {Stage::kCommitting, PublicationState::kStaged},
      {Stage::kCommitted, PublicationState::kCommitted},
      {Stage::kAborted, PublicationState::kAborted},
      {Stage::kFailed, PublicationState::kAborted},
  };
  for (const auto& [stage, state] : expected) {
    EXPECT_EQ(PublicStateOf(stage), state) << LifecycleStageName(stage);
  }
  EXPECT_STREQ(LifecycleStageName(Stage::kCommitting), "committing");
  EXPECT_STREQ(LifecycleStageName(Stage::kPrepared), "prepared");
}

// A group member that voted prepared: nothing but the leader's decision ends it.
TEST_F(LifecycleTest, APreparedVoteRefusesEveryStopAndEndsAsTheLeaderDecides) {
  ToTransferring();
  ASSERT_TRUE(lifecycle_.Prepare().ok());
  EXPECT_EQ(lifecycle_.stage(), Stage::kPrepared);
  Lifecycle::Ending untouched;
  EXPECT_EQ(
      lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("trainer"), &untouched),
      StopResult::kRefused);
  EXPECT_TRUE(lifecycle_.abort_request().ok());
  EXPECT_TRUE(discards().empty());
  EXPECT_FALSE(lifecycle_.BeginTransfer().ok());  // no retry of a voted version
  // Commit decided: the point of no return from kPrepared.
  ASSERT_TRUE(lifecycle_.PassPointOfNoReturn([] { return absl::OkStatus(); }).ok());
  EXPECT_TRUE(lifecycle_.End(PublicationStatus::kCommitted, absl::OkStatus()).ended_now);
}

TEST_F(LifecycleTest, APreparedVoteEndsAbortedWhenTheLeaderAbortsAndNotBefore) {
  ToTransferring();
  ASSERT_TRUE(lifecycle_.Prepare().ok());
  const Lifecycle::Ending e =
      lifecycle_.End(PublicationStatus::kAborted, absl::AbortedError("the leader aborted"));
  EXPECT_TRUE(e.ended_now);
  EXPECT_EQ(e.status.message(), "the leader aborted");
  EXPECT_EQ(discards(), std::vector<std::string>{"the leader aborted"});
}

TEST_F(LifecycleTest, AnAbortRequestedBeforeTheVoteMeansNoVote) {
  ToTransferring();
  Lifecycle::Ending untouched;
  ASSERT_EQ(
      lifecycle_.Stop(PublicationStatus::kAborted, absl::CancelledError("trainer"), &untouched),
      StopResult::kRequested);
  const absl::Status s = lifecycle_.Prepare();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(lifecycle_.stage(), Stage::kTransferring);
  EXPECT_FALSE(Lifecycle(1, nullptr).Prepare().ok());  // only from kTransferring
}

}  // namespace
}  // namespace wpub::engine
