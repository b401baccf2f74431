// A publication that is one member's part of a group version, through the engine with a
// scripted vote: what it tells the leader (its tensors, the declared manifest, its receivers),
// when it transfers, what a refusal or an abort from the leader does, and that followers leave
// the engines' lifecycle calls to the leader.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/str_join.h"
#include "core/engine/engine.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

struct Script {
  std::mutex mu;
  absl::Status join = absl::OkStatus();
  absl::Status stage = absl::OkStatus();
  absl::Status prepare = absl::OkStatus();
  bool others_sent = false;
  // What the transport's Begin fixes as the participants; `on_stage` runs while the member waits
  // for the leader's go.
  std::vector<std::string> participants = {"http://engine:1"};
  std::function<void()> on_stage;
  StagedParts staged;
  PreparedParts prepared;
  std::vector<std::string> calls;
  std::function<void(absl::Status)> on_abort;
  // Prepare blocks while hold_decision (the leader has not decided); voted once it was called.
  std::condition_variable cv;
  bool hold_decision = false;
  bool voted = false;
  void Decide(absl::Status decision) {
    std::lock_guard lock(mu);
    prepare = std::move(decision);
    hold_decision = false;
    cv.notify_all();
  }
  void AwaitVote() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return voted; });
  }
  std::vector<std::string> Calls() {
    std::lock_guard lock(mu);
    return calls;
  }
  void Call(std::string c) {
    std::lock_guard lock(mu);
    calls.push_back(std::move(c));
  }
};

class ScriptedVote final : public GroupVote {
 public:
  explicit ScriptedVote(Script* s) : s_(s) {}
  absl::Status Stage(const StagedParts& parts) override {
    s_->Call("stage");
    s_->staged = parts;
    if (s_->on_stage) s_->on_stage();
    return s_->stage;
  }
  absl::Status Prepare(const PreparedParts& parts) override {
    s_->Call("prepare");
    s_->prepared = parts;
    std::unique_lock lock(s_->mu);
    s_->voted = true;
    s_->cv.notify_all();
    s_->cv.wait(lock, [&] { return !s_->hold_decision; });
    return s_->prepare;
  }
  void Fail(const absl::Status& why) override { s_->Call("fail " + std::string(why.message())); }
  bool others_may_have_sent() const override { return s_->others_sent; }
  GroupSummary Summary() const override {
    GroupSummary g;
    g.group = "g";
    g.member = 1;
    g.members = 2;
    return g;
  }

 private:
  Script* s_;
};

class ScriptedJoiner final : public GroupJoiner {
 public:
  explicit ScriptedJoiner(Script* s) : s_(s) {}
  absl::StatusOr<std::unique_ptr<GroupVote>> Join(
      const PublicationHeader&, std::function<void(absl::Status)> on_abort) override {
    s_->Call("join");
    if (!s_->join.ok()) return s_->join;
    s_->on_abort = std::move(on_abort);
    return std::unique_ptr<GroupVote>(new ScriptedVote(s_));
  }

 private:
  Script* s_;
};

// An engine-like transport: logs Begin's lifecycle flag and MarkParticipantsDirty.
class EngineLikeTransport final : public transport::Transport {
 public:
  explicit EngineLikeTransport(Script* s) : s_(s) {}
  transport::TransportCapabilities capabilities() const override {
    transport::TransportCapabilities c;
    c.name = "engines";
    c.applies_on_receipt = true;
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest& m) override {
    s_->Call(absl::StrCat("begin lifecycle=", m.engine_lifecycle, " member=", m.group_member, "/",
                          m.group_members, " group=", m.group));
    std::lock_guard lock(s_->mu);
    return s_->participants;
  }
  absl::Status Send(std::shared_ptr<const transport::Bucket>) override { return absl::OkStatus(); }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override {
    s_->Call("commit");
    return absl::OkStatus();
  }
  void Abort(absl::string_view) override { s_->Call("abort"); }
  void MarkParticipantsDirty() override { s_->Call("dirty"); }
  std::vector<transport::ReceiverOutcome> Outcomes() const override {
    transport::ReceiverOutcome o;
    o.name = "http://engine:1";
    return {o};
  }
  std::vector<transport::ReceiverInfo> Receivers() const override {
    return {transport::ReceiverInfo{"http://engine:1", transport::ReceiverState::kIdle, 0,
                                    absl::Now()}};
  }

 private:
  Script* s_;
};

struct Fixture {
  explicit Fixture(bool with_joiner = true, size_t min_receivers = 0) : joiner(&script) {
    EngineComponents c;
    c.transports.push_back(std::make_unique<EngineLikeTransport>(&script));
    if (with_joiner) c.group_joiner = &joiner;
    EngineOptions o;
    o.bucket_bytes = 4096;
    o.min_bucket_bytes = 1024;
    o.min_receivers = min_receivers;
    engine = *Engine::Create(o, nullptr, std::move(c));
  }
  PublicationHeader Header(uint64_t version, uint32_t member) {
    PublicationHeader h = testing::Header(version);
    GroupMembership g;
    g.group = "g";
    g.members = 2;
    g.member = member;
    g.leader = "leader:1";
    h.group = g;
    return h;
  }
  Script script;
  ScriptedJoiner joiner;
  std::unique_ptr<Engine> engine;
};

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(EngineGroup, AFollowerStagesTransfersWithoutLifecycleCallsAndPrepares) {
  Fixture f;
  auto session = f.engine->Open(f.Header(3, 1));
  ASSERT_TRUE(session.ok()) << session.status();
  const auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 1);
  ASSERT_TRUE(testing::Send(**session, batches).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  EXPECT_EQ(f.script.calls,
            (std::vector<std::string>{"join", "stage", "begin lifecycle=0 member=1/2 group=g",
                                      "prepare", "commit"}));
  size_t inputs = 0;
  for (const auto& b : batches) inputs += b.tensors.size();
  EXPECT_EQ(f.script.staged.tensors.size(), inputs);
  EXPECT_TRUE(f.script.staged.engines);
  EXPECT_EQ(f.script.staged.bytes_out, report->bytes_out);
  EXPECT_EQ(f.script.prepared.receivers, (std::vector<std::string>{"http://engine:1"}));
  ASSERT_TRUE(report->group.has_value());
  EXPECT_EQ(report->group->member, 1u);
  EXPECT_EQ(report->attempts, 1u);
}

TEST(EngineGroup, TheLeaderMakesTheLifecycleCallsAndDeclaresTheManifest) {
  Fixture f;
  auto session = f.engine->Open(f.Header(3, 0));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->DeclareExpected({"a", "b"}).ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(Contains(f.script.calls, "begin lifecycle=1 member=0/2 group=g"));
  EXPECT_EQ(f.script.staged.expected, (std::vector<std::string>{"a", "b"}));
}

TEST(EngineGroup, OnlyTheLeaderDeclaresAndOnlyInAGroup) {
  Fixture f;
  auto follower = f.engine->Open(f.Header(3, 1));
  ASSERT_TRUE(follower.ok());
  absl::Status s = (*follower)->DeclareExpected({"a"});
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(testing::HasSubstr(s, "member 1"));
  follower->reset();
  auto alone = f.engine->Open(testing::Header(4));
  ASSERT_TRUE(alone.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*alone)->DeclareExpected({"a"})));
}

// Member 1's publication of version 3, committing on another thread, once it voted (the
// scripted leader holds the decision).
std::future<absl::StatusOr<PublicationReport>> CommitUntilTheVote(
    Fixture& f, std::unique_ptr<PublicationSession>* session) {
  f.script.hold_decision = true;
  auto opened = f.engine->Open(f.Header(3, 1));
  EXPECT_TRUE(opened.ok()) << opened.status();
  *session = *std::move(opened);
  EXPECT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto commit = std::async(std::launch::async, [s = session->get()] { return s->Commit(); });
  f.script.AwaitVote();
  return commit;
}

// After its vote a member is the leader's: a cancellation is refused and the version commits
// as the leader decided, with no abort reaching a transport.
TEST(EngineGroup, AVotedVersionIgnoresACancelAndCommitsAsDecided) {
  Fixture f;
  std::unique_ptr<PublicationSession> session;
  auto commit = CommitUntilTheVote(f, &session);
  session->Abort(absl::CancelledError("the trainer cancelled"));
  f.script.Decide(absl::OkStatus());
  auto report = commit.get();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  EXPECT_FALSE(Contains(f.script.Calls(), "abort"));
  EXPECT_EQ(f.engine->GetStatus().committed_version, 3u);
}

// A daemon stopping while its vote waits for the leader: the drain does not abort the version
// (its receivers are told nothing) and says it was in doubt.
TEST(EngineGroup, ADrainWhileInDoubtDoesNotAbortTheVersion) {
  Fixture f;
  std::unique_ptr<PublicationSession> session;
  auto commit = CommitUntilTheVote(f, &session);
  const absl::Status drained = f.engine->Drain(absl::Now() + absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsUnavailable(drained)) << drained;
  EXPECT_NE(drained.message().find("in doubt"), std::string::npos) << drained;
  EXPECT_FALSE(Contains(f.script.Calls(), "abort"));
  // The group joiner's shutdown ends the vote's wait.
  f.script.Decide(absl::UnavailableError("the daemon stopped while in doubt"));
  auto report = commit.get();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
}

// --min_receivers is judged on the participants the transfer fixes, not only on those connected
// when Commit began: an engine that leaves while the member waits for the leader's go leaves too
// few, and the version aborts (the leader is told) instead of committing without it.
TEST(EngineGroup, TooFewParticipantsWhenTheTransferBeginsAbort) {
  Fixture f(/*with_joiner=*/true, /*min_receivers=*/1);
  f.script.on_stage = [&] {
    std::lock_guard lock(f.script.mu);
    f.script.participants.clear();
  };
  auto session = f.engine->Open(f.Header(3, 1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_EQ(report->code, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(report->error.find("needs at least 1 receivers, 0 took part when its transfer began"),
            std::string::npos)
      << report->error;
  const std::vector<std::string> calls = f.script.Calls();
  EXPECT_FALSE(Contains(calls, "prepare"));
  EXPECT_FALSE(Contains(calls, "commit"));
  EXPECT_TRUE(Contains(calls, "abort"));
  EXPECT_TRUE(std::any_of(calls.begin(), calls.end(), [](const std::string& c) {
    return c.rfind("fail ", 0) == 0 && c.find("0 took part") != std::string::npos;
  })) << absl::StrJoin(calls, " | ");
  EXPECT_EQ(f.engine->GetStatus().committed_version, 0u);
}

TEST(EngineGroup, ARefusedStageFailsBeforeAnyByteMoves) {
  Fixture f;
  f.script.stage = absl::InvalidArgumentError("tensor x is published by two members");
  auto session = f.engine->Open(f.Header(3, 1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  EXPECT_TRUE(absl::IsInvalidArgument(report.status())) << report.status();
  for (const std::string& c : f.script.calls) EXPECT_EQ(c.rfind("begin", 0), std::string::npos);
  EXPECT_EQ(f.engine->RecentReports(1)[0].status, PublicationStatus::kFailed);
  EXPECT_EQ(f.engine->GetStatus().committed_version, 0u);
}

TEST(EngineGroup, AnAbortAfterAnotherMemberSentLeavesTheEnginesDirty) {
  Fixture f;
  f.script.prepare = absl::AbortedError("member 2 (node-2) failed: its connection was lost");
  f.script.others_sent = true;
  auto session = f.engine->Open(f.Header(3, 0));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_TRUE(testing::HasSubstr(absl::AbortedError(report->error), "member 2"));
  // Marked dirty before the transports were told to abort (which resumes clean engines).
  auto dirty = std::find(f.script.calls.begin(), f.script.calls.end(), "dirty");
  auto abort = std::find(f.script.calls.begin(), f.script.calls.end(), "abort");
  ASSERT_NE(dirty, f.script.calls.end());
  ASSERT_NE(abort, f.script.calls.end());
  EXPECT_LT(dirty, abort);
  EXPECT_FALSE(Contains(f.script.calls, "commit"));
  EXPECT_EQ(report->attempts, 1u);  // a group version is not retried
}

TEST(EngineGroup, TheLeadersAbortStopsAPublicationStillIngesting) {
  Fixture f;
  auto session = f.engine->Open(f.Header(3, 1));
  ASSERT_TRUE(session.ok());
  // From the vote's own thread, as the member's stream to the leader delivers it.
  std::thread([&] { f.script.on_abort(absl::AbortedError("member 0 failed")); }).join();
  const auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 1);
  absl::Status s = testing::Send(**session, batches);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(testing::HasSubstr(s, "member 0 failed"));
  const PublicationReport r = f.engine->RecentReports(1)[0];
  EXPECT_EQ(r.status, PublicationStatus::kAborted);
  EXPECT_FALSE(f.engine->GetStatus().active.has_value());
}

TEST(EngineGroup, RefusalsAtOpen) {
  {
    Fixture f(/*with_joiner=*/false);
    auto s = f.engine->Open(f.Header(3, 1));
    EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  }
  {
    Fixture f;
    f.script.join = absl::FailedPreconditionError("joins version 3, but group 'g' publishes 4");
    auto s = f.engine->Open(f.Header(3, 1));
    EXPECT_TRUE(absl::IsFailedPrecondition(s.status()));
    EXPECT_TRUE(testing::HasSubstr(s.status(), "group 'g' member 1"));
    EXPECT_FALSE(f.engine->GetStatus().active.has_value());  // the slot is free again
    f.script.join = absl::OkStatus();
    EXPECT_TRUE(f.engine->Open(f.Header(3, 1)).ok());
  }
  {
    Fixture f;
    PublicationHeader h = f.Header(3, 2);  // member 2 of 2
    EXPECT_TRUE(absl::IsInvalidArgument(f.engine->Open(h).status()));
  }
}

}  // namespace
}  // namespace wpub::engine
