// One decision per version on the leader (docs/DESIGN.md, "One decision per version"): the
// decision log (records, reload after a restart, a torn last line, compaction), a round whose
// prepared votes bind and whose decision is recorded before anyone hears it, and the
// coordinator's answer to a member in doubt (undecided, committed, aborted with its reason, no
// record: aborted when it can know, unknown when it cannot).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>

#include <gtest/gtest.h>

#include "core/group/coordinator.h"
#include "core/group/decision_log.h"
#include "core/group/round.h"

namespace wpub::group {
namespace {

using State = RoundOutcome::State;

std::string TempPath(const std::string& name) {
  const std::string p = ::testing::TempDir() + "/" + name + "-" + std::to_string(::getpid());
  std::remove(p.c_str());
  return p;
}

RoundDecision Decision(uint64_t round, bool commit, std::string reason = "") {
  return RoundDecision{"g",
                       7,
                       round,
                       commit,
                       commit ? absl::StatusCode::kOk : absl::StatusCode::kAborted,
                       std::move(reason)};
}

size_t Lines(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) ++n;
  return n;
}

TEST(DecisionLog, DecisionsSurviveARestartAndATornLastLineIsSkipped) {
  const std::string path = TempPath("decisions");
  {
    auto log = DecisionLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status();
    EXPECT_TRUE((*log)->durable());
    ASSERT_TRUE((*log)->Record(Decision(1, true)).ok());
    ASSERT_TRUE((*log)->Record(Decision(2, false, "member 1 failed: \"quoted\"\n")).ok());
  }
  {
    std::ofstream torn(path, std::ios::app);
    torn << R"({"group": "g", "version": 7, "round": 3, "comm)";  // died mid-write
  }
  auto log = DecisionLog::Open(path);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ((*log)->size(), 2u);
  ASSERT_TRUE((*log)->Find(1).has_value());
  EXPECT_TRUE((*log)->Find(1)->commit);
  ASSERT_TRUE((*log)->Find(2).has_value());
  EXPECT_FALSE((*log)->Find(2)->commit);
  EXPECT_EQ((*log)->Find(2)->reason, "member 1 failed: \"quoted\"\n");
  EXPECT_FALSE((*log)->Find(3).has_value());
  // The torn line is gone from the file: the next record is whole.
  ASSERT_TRUE((*log)->Record(Decision(4, true)).ok());
  auto again = DecisionLog::Open(path);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->Find(4).has_value());
  EXPECT_EQ(Lines(path), 3u);
}

TEST(DecisionLog, TheFileKeepsTheNewestAndStaysBounded) {
  const std::string path = TempPath("bounded");
  auto log = DecisionLog::Open(path, /*capacity=*/4);
  ASSERT_TRUE(log.ok());
  for (uint64_t r = 1; r <= 21; ++r) ASSERT_TRUE((*log)->Record(Decision(r, r % 2 == 0)).ok());
  EXPECT_LE(Lines(path), 8u);
  EXPECT_EQ((*log)->size(), 4u);
  EXPECT_FALSE((*log)->Find(17).has_value());
  auto reopened = DecisionLog::Open(path, 4);
  ASSERT_TRUE(reopened.ok());
  for (uint64_t r = 18; r <= 21; ++r) EXPECT_TRUE((*reopened)->Find(r).has_value()) << r;
}

TEST(DecisionLog, AnUnusablePathIsRefusedNamingIt) {
  auto log = DecisionLog::Open("/proc/wpub-no-such-dir/decisions");
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(log.status().message().find("/proc/wpub-no-such-dir/decisions"), std::string::npos);
}

MemberHello Hello(uint32_t member) {
  MemberHello h;
  h.membership.group = "g";
  h.membership.members = 2;
  h.membership.member = member;
  h.membership.leader = member == 0 ? "" : "leader:1";
  h.membership.publisher = "node-" + std::to_string(member);
  h.version = 7;
  h.recipe = "nvfp4";
  return h;
}

engine::StagedParts Parts(const std::string& name) {
  engine::StagedParts p;
  p.tensors = {name};
  return p;
}

engine::PreparedParts Prepared() {
  engine::PreparedParts p;
  p.receivers = {"recv-0"};
  return p;
}

// Both members joined, staged and may transfer.
void ToTransfer(Round& r) {
  ASSERT_TRUE(r.Join(Hello(0)).ok());
  ASSERT_TRUE(r.Join(Hello(1)).ok());
  r.Stage(0, Parts("a"));
  r.Stage(1, Parts("b"));
  ASSERT_TRUE(r.AwaitTransfer(0).ok());
  ASSERT_TRUE(r.AwaitTransfer(1).ok());
}

TEST(GroupRoundDecision, APreparedVoteBindsNothingTheMemberDoesTakesItBack) {
  Round r("g", 2, 7, absl::Seconds(30));
  ToTransfer(r);
  r.Prepared(1, Prepared());
  r.Fail(1, absl::UnavailableError("its connection to the leader was lost"));
  r.Fail(1, absl::InvalidArgumentError("protocol error: parts after prepared"));
  EXPECT_FALSE(r.decided());
  EXPECT_TRUE(r.prepared(1));
  r.Prepared(0, Prepared());
  EXPECT_TRUE(r.AwaitDecision(0).ok());
  EXPECT_EQ(r.Summary().outcome, "committed");
}

TEST(GroupRoundDecision, AnUnpreparedMembersFailureStillAborts) {
  Round r("g", 2, 7, absl::Seconds(30));
  ToTransfer(r);
  r.Prepared(0, Prepared());
  r.Fail(1, absl::UnavailableError("its connection to the leader was lost"));
  const absl::Status s = r.AwaitDecision(0);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("member 1 (node-1)"), std::string::npos) << s;
}

TEST(GroupRoundDecision, TheDecisionIsRecordedBeforeAnyWaiterSeesIt) {
  std::vector<RoundDecision> recorded;
  std::atomic<bool> waiter_saw_it_unrecorded{false};
  Round* round = nullptr;
  Round r("g", 2, 7, absl::Seconds(30), kMaxRoundNameBytes, 42, [&](const RoundDecision& d) {
    recorded.push_back(d);
    return absl::OkStatus();
  });
  round = &r;
  ToTransfer(r);
  auto waiter = std::async(std::launch::async, [&] {
    absl::Status s = round->AwaitDecision(1);
    if (recorded.empty()) waiter_saw_it_unrecorded = true;
    return s;
  });
  r.Prepared(1, Prepared());
  r.Prepared(0, Prepared());
  EXPECT_TRUE(waiter.get().ok());
  EXPECT_FALSE(waiter_saw_it_unrecorded);
  ASSERT_EQ(recorded.size(), 1u);
  EXPECT_TRUE(recorded[0].commit);
  EXPECT_EQ(recorded[0].round, 42u);
  EXPECT_EQ(recorded[0].version, 7u);
  EXPECT_EQ(r.id(), 42u);
}

TEST(GroupRoundDecision, ACommitThatCannotBeRecordedIsAnAbort) {
  std::vector<RoundDecision> recorded;
  Round r("g", 2, 7, absl::Seconds(30), kMaxRoundNameBytes, 9, [&](const RoundDecision& d) {
    recorded.push_back(d);
    if (d.commit) return absl::InternalError("cannot flush /var/lib/wpub/decisions: EIO");
    return absl::OkStatus();
  });
  ToTransfer(r);
  r.Prepared(1, Prepared());
  r.Prepared(0, Prepared());
  const absl::Status s = r.AwaitDecision(0);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("could not record its decision to commit"), std::string::npos) << s;
  EXPECT_NE(s.message().find("EIO"), std::string::npos) << s;
  ASSERT_EQ(recorded.size(), 2u);  // the commit it could not record, then the abort
  EXPECT_FALSE(recorded[1].commit);
}

// The leader's round of version 7 with both members through to their votes; returns its id.
uint64_t LeadARound(Coordinator& c, std::unique_ptr<engine::GroupVote>* leader_vote,
                    std::shared_ptr<Round>* member_round) {
  engine::PublicationHeader h;
  h.version = 7;
  h.recipe = "nvfp4";
  h.group = Hello(0).membership;
  auto lv = c.JoinLocal(h, nullptr);
  EXPECT_TRUE(lv.ok()) << lv.status();
  *leader_vote = *std::move(lv);
  auto mr = c.Join(Hello(1), absl::ZeroDuration());
  EXPECT_TRUE(mr.ok()) << mr.status();
  *member_round = *mr;
  (*member_round)->Stage(1, Parts("b"));
  EXPECT_TRUE((*leader_vote)->Stage(Parts("a")).ok());
  (*member_round)->Prepared(1, Prepared());
  return (*member_round)->id();
}

TEST(GroupCoordinatorOutcome, UndecidedThenCommittedAndOnlyForTheRightRound) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  std::unique_ptr<engine::GroupVote> lv;
  std::shared_ptr<Round> mr;
  const uint64_t id = LeadARound(c, &lv, &mr);
  EXPECT_EQ(c.OutcomeOf("g", 7, id).state, State::kUndecided);
  ASSERT_TRUE(lv->Prepare(Prepared()).ok());
  EXPECT_EQ(c.OutcomeOf("g", 7, id).state, State::kCommitted);
  // Another version or group under the same id is not that round: this process made every id
  // it knows, so a round it has no record of never committed here.
  EXPECT_EQ(c.OutcomeOf("g", 8, id).state, State::kAborted);
  EXPECT_EQ(c.OutcomeOf("h", 7, id).state, State::kAborted);
}

TEST(GroupCoordinatorOutcome, AnAbortIsAnsweredWithItsReason) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  std::unique_ptr<engine::GroupVote> lv;
  std::shared_ptr<Round> mr;
  const uint64_t id = LeadARound(c, &lv, &mr);
  lv->Fail(absl::InternalError("the leader's receiver recv-0 left"));
  const RoundOutcome o = c.OutcomeOf("g", 7, id);
  EXPECT_EQ(o.state, State::kAborted);
  EXPECT_NE(o.why.message().find("recv-0 left"), std::string::npos) << o.why;
}

TEST(GroupCoordinatorOutcome, AfterARestartTheLogAnswersAndWithoutOneTheLeaderCannotSay) {
  const std::string path = TempPath("restart");
  uint64_t committed_id = 0, open_id = 0;
  {
    auto log = DecisionLog::Open(path);
    ASSERT_TRUE(log.ok());
    CoordinatorOptions o;
    o.decisions = *std::move(log);
    Coordinator c(o, nullptr);
    std::unique_ptr<engine::GroupVote> lv;
    std::shared_ptr<Round> mr;
    committed_id = LeadARound(c, &lv, &mr);
    ASSERT_TRUE(lv->Prepare(Prepared()).ok());
    lv.reset();
    // The next round dies undecided with its leader.
    engine::PublicationHeader h;
    h.version = 8;
    h.recipe = "nvfp4";
    h.group = Hello(0).membership;
    auto next = c.JoinLocal(h, nullptr);
    ASSERT_TRUE(next.ok());
    MemberHello m = Hello(1);
    m.version = 8;
    auto r = c.Join(m, absl::ZeroDuration());
    ASSERT_TRUE(r.ok());
    open_id = (*r)->id();
    // The leader crashes here: its restart finds what the file held at this instant (what
    // ending the round in process records on its way out is undone).
    std::filesystem::copy_file(path, path + ".at-crash");
  }
  std::filesystem::rename(path + ".at-crash", path);
  auto log = DecisionLog::Open(path);
  ASSERT_TRUE(log.ok());
  CoordinatorOptions o;
  o.decisions = *std::move(log);
  Coordinator restarted(o, nullptr);
  EXPECT_EQ(restarted.OutcomeOf("g", 7, committed_id).state, State::kCommitted);
  const RoundOutcome presumed = restarted.OutcomeOf("g", 8, open_id);
  EXPECT_EQ(presumed.state, State::kAborted);
  EXPECT_NE(presumed.why.message().find("never committed it"), std::string::npos) << presumed.why;
  // Restarted without a log: it cannot know either round.
  Coordinator forgetful(CoordinatorOptions{}, nullptr);
  const RoundOutcome unknown = forgetful.OutcomeOf("g", 7, committed_id);
  EXPECT_EQ(unknown.state, State::kUnknown);
  EXPECT_NE(unknown.why.message().find("--group_decision_log"), std::string::npos) << unknown.why;
}

}  // namespace
}  // namespace wpub::group
