// The leader's side of publication groups: one version's round (joins, the parts check, transfer
// turns, the receiver check, the decision, timeouts) and the coordinator's choice of round.
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include "core/group/coordinator.h"
#include "core/group/round.h"
#include "core/group/stall_watch.h"

namespace wpub::group {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

MemberHello Hello(uint32_t member, uint64_t version = 7, uint32_t members = 3,
                  std::string group = "g", std::string recipe = "nvfp4") {
  MemberHello h;
  h.membership.group = std::move(group);
  h.membership.members = members;
  h.membership.member = member;
  h.membership.leader = member == 0 ? "" : "leader:1";
  h.membership.publisher = "node-" + std::to_string(member);
  h.version = version;
  h.recipe = std::move(recipe);
  return h;
}

engine::StagedParts Parts(std::vector<std::string> names, bool engines = false) {
  engine::StagedParts p;
  p.tensors = std::move(names);
  p.bytes_in = 100 * p.tensors.size();
  p.bytes_out = 60 * p.tensors.size();
  p.buckets = 1;
  p.engines = engines;
  return p;
}

engine::PreparedParts Prepared(std::vector<std::string> receivers = {"recv-0", "recv-1"}) {
  engine::PreparedParts p;
  p.receivers = std::move(receivers);
  p.bytes_out = 60;
  p.phases.transfer = 0.25;
  return p;
}

bool Ready(std::future<absl::Status>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

TEST(GroupRound, ThreeMembersCommitWithDisjointParts) {
  Round r("g", 3, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 3; ++m) ASSERT_TRUE(r.Join(Hello(m)).ok());
  r.Stage(0, Parts({"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"}));
  r.Stage(1, Parts({"model.layers.1.mlp.experts.0.down_proj.weight"}));
  auto go2 = std::async(std::launch::async, [&] { return r.AwaitTransfer(2); });
  r.Stage(2, Parts({"model.layers.2.mlp.experts.0.down_proj.weight"}));
  // Pull receivers only: every member transfers at once.
  for (uint32_t m = 0; m < 2; ++m) EXPECT_TRUE(r.AwaitTransfer(m).ok());
  EXPECT_TRUE(go2.get().ok());
  EXPECT_FALSE(r.others_may_have_sent(0));
  auto d0 = std::async(std::launch::async, [&] { return r.AwaitDecision(0); });
  r.Prepared(0, Prepared());
  r.Prepared(2, Prepared());
  EXPECT_FALSE(r.decided());
  r.Prepared(1, Prepared({"recv-1", "recv-0"}));
  EXPECT_TRUE(d0.get().ok());
  EXPECT_TRUE(r.AwaitDecision(2).ok());
  const engine::GroupSummary s = r.Summary();
  EXPECT_EQ(s.outcome, "committed");
  EXPECT_EQ(s.slowest_member, 1);
  EXPECT_EQ(s.failed_member, -1);
  ASSERT_EQ(s.members_detail.size(), 3u);
  EXPECT_EQ(s.members_detail[0].tensors, 2u);
  EXPECT_EQ(s.members_detail[0].publisher, "node-0");
  EXPECT_EQ(s.members_detail[2].state, "committed");
  EXPECT_DOUBLE_EQ(s.members_detail[1].phases.transfer, 0.25);
}

TEST(GroupRound, TwoMembersClaimingOneTensorAbortNamingItAndBoth) {
  Round r("g", 3, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 3; ++m) ASSERT_TRUE(r.Join(Hello(m)).ok());
  r.Stage(0, Parts({"a"}));
  r.Stage(1, Parts({"model.norm.weight"}));
  r.Stage(2, Parts({"b", "model.norm.weight"}));
  const absl::Status s = r.AwaitTransfer(0);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.norm.weight"), HasSubstr("member 1 (node-1)"),
                                 HasSubstr("member 2 (node-2)")));
  EXPECT_EQ(r.AwaitTransfer(1), s);
  EXPECT_EQ(r.Summary().failed_member, 2);
}

TEST(GroupRound, DeclaredManifestMissingOrExtraTensorsAbort) {
  {
    Round r("g", 2, 7, absl::Seconds(30));
    for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
    engine::StagedParts p0 = Parts({"a"});
    p0.expected = {"a", "b", "model.layers.3.mtp.weight"};
    r.Stage(0, p0);
    r.Stage(1, Parts({"b"}));
    const absl::Status s = r.AwaitTransfer(1);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("1 tensors of the declared manifest"),
                                   HasSubstr("model.layers.3.mtp.weight")));
  }
  {
    Round r("g", 2, 7, absl::Seconds(30));
    for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
    engine::StagedParts p0 = Parts({"a"});
    p0.expected = {"a", "b"};
    r.Stage(0, p0);
    r.Stage(1, Parts({"b", "stray"}));
    const absl::Status s = r.AwaitTransfer(0);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("stray"), HasSubstr("member 1 (node-1)"),
                                   HasSubstr("not in the declared manifest")));
  }
}

TEST(GroupRound, JoinRefusalsNameWhatDiffers) {
  Round r("g", 3, 7, absl::Seconds(30));
  ASSERT_TRUE(r.Join(Hello(0)).ok());
  absl::Status s = r.Join(Hello(1, 8));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("version 8"), HasSubstr("version 7")));
  s = r.Join(Hello(1, 7, 4));
  EXPECT_THAT(s.message(), HasSubstr("has 4 members"));
  s = r.Join(Hello(1, 7, 3, "other"));
  EXPECT_THAT(s.message(), HasSubstr("'other'"));
  s = r.Join(Hello(1, 7, 3, "g", "bf16"));
  EXPECT_THAT(s.message(), HasSubstr("one recipe"));
  s = r.Join(Hello(0));
  EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;
  EXPECT_TRUE(r.Join(Hello(1)).ok());
}

TEST(GroupRound, AFailedMemberAbortsEveryWaiterAndCallsOnAbortOnce) {
  Round r("g", 3, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 3; ++m) ASSERT_TRUE(r.Join(Hello(m)).ok());
  std::atomic<int> calls{0};
  std::string seen;
  r.OnAbort([&](absl::Status why) {
    ++calls;
    seen = std::string(why.message());
    // Called without the round's lock held.
    EXPECT_EQ(r.Summary().outcome, "aborted");
  });
  r.Stage(0, Parts({"a"}));
  auto w0 = std::async(std::launch::async, [&] { return r.AwaitTransfer(0); });
  r.Fail(1, absl::UnavailableError("its connection to the leader was lost"));
  const absl::Status s = w0.get();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("member 1 (node-1)"), HasSubstr("connection")));
  r.Fail(2, absl::AbortedError("later"));  // no second decision, no second call
  EXPECT_EQ(calls.load(), 1);
  EXPECT_THAT(seen, HasSubstr("member 1"));
  EXPECT_EQ(r.Summary().failed_member, 1);
  int late = 0;
  r.OnAbort([&](absl::Status) { ++late; });  // registered after the abort: called at once
  EXPECT_EQ(late, 1);
}

TEST(GroupRound, BadInputOfAMemberStaysInvalidArgument) {
  Round r("g", 2, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
  r.Fail(1, absl::InvalidArgumentError("tensor x: non-finite"));
  EXPECT_TRUE(absl::IsInvalidArgument(r.AwaitTransfer(0)));
}

TEST(GroupRound, NoProgressTimesOutNamingTheMembersWaitedFor) {
  Round r("g", 3, 7, absl::Milliseconds(200));
  ASSERT_TRUE(r.Join(Hello(0)).ok());
  ASSERT_TRUE(r.Join(Hello(1)).ok());
  r.Stage(0, Parts({"a"}));
  const absl::Status s = r.AwaitTransfer(0);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("member 1 (node-1) joined"), HasSubstr("member 2 waiting")));
  EXPECT_TRUE(r.decided());
}

// What a callback-served member hears, without a thread waiting: its transfer turn (engines:
// one member after another, so member 1's comes only once member 0 prepared) and the decision,
// each once, in that order; a callback registered after the fact runs at once.
TEST(GroupRound, CallbacksHearTheTurnAndTheDecisionOnceInOrder) {
  Round r("g", 2, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
  std::mutex mu;
  std::vector<std::string> heard;
  const auto hear = [&](std::string what) {
    return [&, what](absl::Status s) {
      std::lock_guard lock(mu);
      heard.push_back(what + (s.ok() ? " ok" : " " + std::string(s.message())));
    };
  };
  const auto Heard = [&] {
    std::lock_guard lock(mu);
    return heard;
  };
  r.OnTransfer(1, [&](absl::Status s) {
    hear("transfer 1")(s);
    r.OnDecision(1, hear("decision 1"));
  });
  r.Stage(0, Parts({"a"}, /*engines=*/true));
  r.Stage(1, Parts({"b"}, /*engines=*/true));
  EXPECT_TRUE(Heard().empty());  // the leader transfers first
  r.OnTransfer(0, hear("transfer 0"));
  EXPECT_EQ(Heard(), std::vector<std::string>{"transfer 0 ok"});
  r.Prepared(0, Prepared());
  EXPECT_EQ(Heard(), (std::vector<std::string>{"transfer 0 ok", "transfer 1 ok"}));
  r.Prepared(1, Prepared());
  EXPECT_EQ(Heard(), (std::vector<std::string>{"transfer 0 ok", "transfer 1 ok", "decision 1 ok"}));
  r.OnDecision(0, hear("decision 0"));
  EXPECT_EQ(Heard().back(), "decision 0 ok");
  EXPECT_EQ(Heard().size(), 4u);
}

// No thread waits, yet the round times out: ExpireIfStalled says how long is left and aborts
// once nothing moved for the timeout (every callback then hears DEADLINE_EXCEEDED naming the
// members waited for); the stall watch calls it for the rounds it is given.
TEST(GroupRound, AStallWatchTimesOutARoundNoThreadWaitsOn) {
  {
    Round r("g", 2, 7, absl::Milliseconds(300));
    ASSERT_TRUE(r.Join(Hello(1, 7, 2)).ok());
    const absl::Duration left = r.ExpireIfStalled();
    EXPECT_GT(left, absl::ZeroDuration());
    EXPECT_LE(left, absl::Milliseconds(300));
    EXPECT_FALSE(r.decided());
    std::this_thread::sleep_for(std::chrono::milliseconds(350));
    EXPECT_EQ(r.ExpireIfStalled(), absl::InfiniteDuration());
    EXPECT_TRUE(absl::IsDeadlineExceeded(r.abort_status())) << r.abort_status();
  }
  StallWatch watch;
  auto r = std::make_shared<Round>("g", 2, 8, absl::Milliseconds(300));
  ASSERT_TRUE(r->Join(Hello(1, 8, 2)).ok());
  std::promise<absl::Status> told;
  r->OnTransfer(1, [&](absl::Status s) { told.set_value(s); });
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(watch.Watch(r).ok());
  absl::Status s = told.get_future().get();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("no progress for 300ms"), HasSubstr("member 0 waiting")));
  // Every member registers its round: it is watched once.
  {
    StallWatch other;
    auto slow = std::make_shared<Round>("g", 2, 9, absl::Seconds(60));
    ASSERT_TRUE(other.Watch(slow).ok());
    ASSERT_TRUE(other.Watch(slow).ok());
    EXPECT_EQ(other.size(), 1u);
  }
  // Decided rounds are forgotten.
  for (int i = 0; i < 500 && watch.size() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(watch.size(), 0u);
}

TEST(GroupRound, EnginesSerializeTransfersLeaderFirst) {
  Round r("g", 3, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 3; ++m) ASSERT_TRUE(r.Join(Hello(m)).ok());
  r.Stage(0, Parts({"a"}, /*engines=*/true));
  r.Stage(1, Parts({"b"}, true));
  r.Stage(2, Parts({"c"}, true));
  EXPECT_TRUE(r.AwaitTransfer(0).ok());
  auto go1 = std::async(std::launch::async, [&] { return r.AwaitTransfer(1); });
  // Member 1's turn comes only after member 0 prepared: nothing can grant it before.
  EXPECT_FALSE(Ready(go1));
  EXPECT_FALSE(r.others_may_have_sent(0));
  r.Prepared(0, Prepared({"http://e:1"}));
  EXPECT_TRUE(go1.get().ok());
  EXPECT_TRUE(r.others_may_have_sent(0));
  EXPECT_FALSE(r.others_may_have_sent(1) && false);
  r.Prepared(1, Prepared({"http://e:1"}));
  EXPECT_TRUE(r.AwaitTransfer(2).ok());
  r.Prepared(2, Prepared({"http://e:1"}));
  EXPECT_TRUE(r.AwaitDecision(0).ok());
}

TEST(GroupRound, EnginesWithoutTheLeaderAreRefused) {
  Round r("g", 2, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
  r.Stage(0, Parts({"a"}));
  r.Stage(1, Parts({"b"}, true));
  const absl::Status s = r.AwaitTransfer(0);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("lifecycle calls"));
}

TEST(GroupRound, ReceiversMustTakePartInEveryMember) {
  Round r("g", 2, 7, absl::Seconds(30));
  for (uint32_t m = 0; m < 2; ++m) ASSERT_TRUE(r.Join(Hello(m, 7, 2)).ok());
  r.Stage(0, Parts({"a"}));
  r.Stage(1, Parts({"b"}));
  r.Prepared(0, Prepared({"recv-0", "recv-1"}));
  r.Prepared(1, Prepared({"recv-0"}));
  const absl::Status s = r.AwaitDecision(0);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("recv-1"), HasSubstr("member 1 (node-1)")));
}

// The names a round holds are bounded over every member together, and released once checked
// (the round kept as the last one holds counts only).
TEST(GroupRound, TensorNamesAreBoundedInAllAndReleasedOnceChecked) {
  {
    Round r("g", 2, 7, absl::Seconds(5), /*max_name_bytes=*/100);
    ASSERT_TRUE(r.Join(Hello(0, 7, 2)).ok());
    ASSERT_TRUE(r.Join(Hello(1, 7, 2)).ok());
    EXPECT_TRUE(r.ReserveNameBytes(1, 60).ok());
    const absl::Status more = r.ReserveNameBytes(1, 50);
    EXPECT_EQ(more.code(), absl::StatusCode::kResourceExhausted) << more;
    EXPECT_THAT(more.message(), AllOf(HasSubstr("exceed 100 bytes"), HasSubstr("member 1")));
    // The leader's own parts count at Stage: 60 reserved + 50 more is past the bound.
    r.Stage(0, Parts({std::string(50, 'a')}));
    const absl::Status s = r.AwaitTransfer(0);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(r.Summary().failed_member, 0);
  }
  Round r("g", 2, 7, absl::Seconds(5), /*max_name_bytes=*/100);
  ASSERT_TRUE(r.Join(Hello(0, 7, 2)).ok());
  ASSERT_TRUE(r.Join(Hello(1, 7, 2)).ok());
  r.Stage(0, Parts({"a", "b"}));
  r.Stage(1, Parts({"c"}));
  ASSERT_TRUE(r.AwaitTransfer(0).ok());
  // Checked and released: the bound is free again for nothing more, the counts stay.
  EXPECT_TRUE(r.ReserveNameBytes(1, 100).ok());
  const engine::GroupSummary sum = r.Summary();
  ASSERT_EQ(sum.members_detail.size(), 2u);
  EXPECT_EQ(sum.members_detail[0].tensors, 2u);
  EXPECT_EQ(sum.members_detail[1].tensors, 1u);
}

TEST(GroupCoordinator, MembersShareTheActiveRoundAndMismatchesAreRefused) {
  prometheus::Registry registry;
  Coordinator c(CoordinatorOptions{}, &registry);
  absl::StatusOr<std::shared_ptr<Round>> r1 = c.Join(Hello(1), absl::ZeroDuration());
  ASSERT_TRUE(r1.ok()) << r1.status();
  // Before the leader joined, another version waits in a round of its own; this one stays.
  absl::StatusOr<std::shared_ptr<Round>> other = c.Join(Hello(2, 9), absl::ZeroDuration());
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->get(), r1->get());
  EXPECT_FALSE((*r1)->decided());
  absl::StatusOr<std::shared_ptr<Round>> r0 = c.Join(Hello(0), absl::ZeroDuration());
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->get(), r1->get());
  // With the leader in, a member with another version or group is refused and the round is
  // not disturbed (a Join nobody expected changes nothing).
  other = c.Join(Hello(2, 9), absl::ZeroDuration());
  EXPECT_TRUE(absl::IsFailedPrecondition(other.status()));
  EXPECT_THAT(other.status().message(), AllOf(HasSubstr("version 9"), HasSubstr("version 7")));
  other = c.Join(Hello(2, 7, 3, "elsewhere"), absl::ZeroDuration());
  EXPECT_TRUE(absl::IsFailedPrecondition(other.status()));
  EXPECT_FALSE((*r0)->decided());
  // The real member 2 still joins, and the round completes.
  absl::StatusOr<std::shared_ptr<Round>> r2 = c.Join(Hello(2), absl::ZeroDuration());
  ASSERT_TRUE(r2.ok()) << r2.status();
  (*r0)->Stage(0, Parts({"a"}));
  (*r0)->Stage(1, Parts({"b"}));
  (*r0)->Stage(2, Parts({"c"}));
  for (uint32_t m = 0; m < 3; ++m) (*r0)->Prepared(m, Prepared());
  EXPECT_TRUE((*r0)->AwaitDecision(0).ok());
  (*r0)->Abort(absl::AbortedError("too late"));  // decided once
  EXPECT_TRUE((*r0)->abort_status().ok());
  c.Observe(*r0);
  c.Observe(*r0);  // once per round
  EXPECT_EQ(c.LastRound()->outcome, "committed");
}

TEST(GroupCoordinator, MembersBeforeTheLeaderWaitInTheirVersionsRoundUntilItChooses) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  // A Join for another group and one for another version arrive first: neither squats the
  // round the real member waits in.
  absl::StatusOr<std::shared_ptr<Round>> squat =
      c.Join(Hello(1, 7, 3, "other"), absl::ZeroDuration());
  absl::StatusOr<std::shared_ptr<Round>> stale = c.Join(Hello(1, 6), absl::ZeroDuration());
  absl::StatusOr<std::shared_ptr<Round>> real = c.Join(Hello(1, 7), absl::ZeroDuration());
  ASSERT_TRUE(squat.ok() && stale.ok() && real.ok());
  EXPECT_NE(real->get(), squat->get());
  EXPECT_NE(real->get(), stale->get());
  absl::StatusOr<std::shared_ptr<Round>> leader = c.Join(Hello(0, 7), absl::ZeroDuration());
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(leader->get(), real->get());
  EXPECT_FALSE((*real)->decided());
  for (const auto* r : {&squat, &stale}) {
    EXPECT_TRUE((**r)->decided());
    EXPECT_THAT((**r)->abort_status().message(), HasSubstr("version 7"));
  }
  EXPECT_TRUE((*real)->joined(1));
}

TEST(GroupCoordinator, VersionsOutsideThePublishedRangeAreRefused) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  for (const uint64_t v : {uint64_t{0}, (uint64_t{1} << 53) + 1, ~uint64_t{0}}) {
    absl::StatusOr<std::shared_ptr<Round>> r = c.Join(Hello(1, v), absl::ZeroDuration());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << v << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("versions are 1 to"));
  }
  EXPECT_FALSE(c.LastRound().has_value());
}

TEST(GroupCoordinator, PendingVersionsAreBoundedAndFreedWhenTheLeaderChooses) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  std::vector<std::shared_ptr<Round>> pending;
  for (uint64_t v = 1; v <= kMaxPendingRounds; ++v) {
    absl::StatusOr<std::shared_ptr<Round>> r = c.Join(Hello(1, v), absl::ZeroDuration());
    ASSERT_TRUE(r.ok()) << r.status();
    pending.push_back(*r);
  }
  absl::StatusOr<std::shared_ptr<Round>> more =
      c.Join(Hello(1, kMaxPendingRounds + 1), absl::ZeroDuration());
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
  // A member of a version already waiting still joins it.
  EXPECT_TRUE(c.Join(Hello(2, 1), absl::ZeroDuration()).ok());
  ASSERT_TRUE(c.Join(Hello(0, 2), absl::ZeroDuration()).ok());
  for (size_t i = 0; i < pending.size(); ++i) EXPECT_EQ(pending[i]->decided(), i != 1) << i;
  // The leader chose: the next versions may wait again.
  pending[1]->Abort(absl::AbortedError("done"));
  EXPECT_TRUE(c.Join(Hello(1, 9), absl::ZeroDuration()).ok());
}

TEST(GroupCoordinator, TheRoundsTimeoutIsTheLeadersNotAMembers) {
  CoordinatorOptions o;
  o.default_timeout = absl::Milliseconds(200);  // wpubd --group_timeout
  Coordinator c(o, nullptr);
  // A member asking for a day does not get it: the round it opened times out on the leader's.
  absl::StatusOr<std::shared_ptr<Round>> r = c.Join(Hello(1), absl::Hours(24));
  ASSERT_TRUE(r.ok());
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = (*r)->AwaitTransfer(1);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(GroupCoordinator, TheLeadersNewVersionAbortsAStaleRound) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  absl::StatusOr<std::shared_ptr<Round>> stale = c.Join(Hello(1, 5), absl::ZeroDuration());
  ASSERT_TRUE(stale.ok());
  absl::StatusOr<std::shared_ptr<Round>> fresh = c.Join(Hello(0, 6), absl::ZeroDuration());
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(stale->get(), fresh->get());
  EXPECT_TRUE((*stale)->decided());
  EXPECT_THAT((*stale)->abort_status().message(), HasSubstr("version 6"));
  EXPECT_EQ(c.LastRound()->version, 6u);
}

TEST(GroupCoordinator, LocalVoteRunsTheLeadersPublication) {
  Coordinator c(CoordinatorOptions{}, nullptr);
  engine::PublicationHeader h;
  h.version = 3;
  h.recipe = "nvfp4";
  h.group = Hello(0, 3, 2).membership;
  std::atomic<int> aborted{0};
  absl::StatusOr<std::unique_ptr<engine::GroupVote>> vote =
      c.JoinLocal(h, [&](absl::Status) { ++aborted; });
  ASSERT_TRUE(vote.ok()) << vote.status();
  absl::StatusOr<std::shared_ptr<Round>> r1 = c.Join(Hello(1, 3, 2), absl::ZeroDuration());
  ASSERT_TRUE(r1.ok());
  auto staged = std::async(std::launch::async, [&] { return (*vote)->Stage(Parts({"a"})); });
  (*r1)->Stage(1, Parts({"b"}));
  EXPECT_TRUE(staged.get().ok());
  EXPECT_TRUE((*r1)->AwaitTransfer(1).ok());
  (*r1)->Prepared(1, Prepared());
  EXPECT_TRUE((*vote)->Prepare(Prepared()).ok());
  EXPECT_EQ((*vote)->Summary().outcome, "committed");
  vote->reset();  // a vote ending after the decision changes nothing
  EXPECT_EQ(aborted.load(), 0);
  EXPECT_EQ(c.LastRound()->outcome, "committed");
}

}  // namespace
}  // namespace wpub::group
