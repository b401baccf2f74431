// A member that voted prepared and lost its stream to the leader before the decision reached it
// (docs/DESIGN.md, "One decision per version"), over real gRPC: the leader's Group service
// in-process, the member's joiner reaching it through a proxy that cuts, refuses and retargets
// connections. Every case: the member never aborts on its own -- it holds the version in doubt
// and learns the leader's decision when the leader is reachable again, from the same leader, a
// leader restarted with its decision log (the recorded decision, or aborted for a round it never
// decided), and not from one restarted without a log (it keeps asking until the daemon stops).
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "core/group/coordinator.h"
#include "core/group/decision_log.h"
#include "server/service/group_service.h"
#include "tests/group/cuttable_proxy.h"

namespace wpub::server {
namespace {

using namespace std::chrono_literals;

// A leader daemon's group side: a coordinator and its Group service on a port of its own.
class Leader {
 public:
  explicit Leader(std::shared_ptr<group::DecisionLog> log = nullptr) {
    group::CoordinatorOptions o;
    o.default_timeout = absl::Seconds(30);
    o.decisions = std::move(log);
    coordinator_ = std::make_unique<group::Coordinator>(o, nullptr);
    service_ = std::make_unique<GroupService>(coordinator_.get(), ServiceOptions{});
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
  }
  ~Leader() { server_->Shutdown(std::chrono::system_clock::now() + 1s); }
  int port() const { return port_; }
  group::Coordinator& coordinator() { return *coordinator_; }
  // Member `m`'s state in the leader's round ("prepared", ...).
  std::string MemberState(uint32_t m) const {
    std::optional<engine::GroupSummary> s = coordinator_->LastRound();
    if (!s.has_value() || s->members_detail.size() <= m) return "";
    return s->members_detail[m].state;
  }

 private:
  std::unique_ptr<group::Coordinator> coordinator_;
  std::unique_ptr<GroupService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

engine::PublicationHeader Header(uint32_t member, const std::string& leader) {
  engine::PublicationHeader h;
  h.version = 5;
  h.recipe = "nvfp4";
  engine::GroupMembership g;
  g.group = "g";
  g.members = 2;
  g.member = member;
  g.leader = leader;
  g.publisher = "node-" + std::to_string(member);
  h.group = g;
  return h;
}

engine::StagedParts Parts(const std::string& name) {
  engine::StagedParts p;
  p.tensors = {name};
  p.bytes_out = 64;
  p.buckets = 1;
  return p;
}

engine::PreparedParts Prepared() {
  engine::PreparedParts p;
  p.receivers = {"recv-0 (instance a)", "recv-1 (instance b)"};
  return p;
}

template <class F>
void WaitFor(F done, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!done()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "waited for " << what;
    std::this_thread::sleep_for(5ms);
  }
}

class InDoubtTest : public ::testing::Test {
 protected:
  void SetUp() override {
    leader_ = std::make_unique<Leader>(log_);
    proxy_ = std::make_unique<testing::CuttableProxy>(leader_->port());
    GroupClientOptions o;
    o.join_timeout = absl::Seconds(5);
    o.outcome_retry_min = absl::Milliseconds(10);
    o.outcome_retry_max = absl::Milliseconds(50);
    o.outcome_call_timeout = absl::Seconds(2);
    joiner_ = std::make_unique<GroupJoinerImpl>(&member_coordinator_, o);
  }
  void TearDown() override { joiner_->Shutdown(); }

  // Both members join and transfer; the member (1) votes prepared (its Prepare runs in
  // `member_decision`); returns once the leader holds that vote.
  void BothPrepareButTheLeader() {
    auto lv = leader_->coordinator().JoinLocal(Header(0, ""), nullptr);
    ASSERT_TRUE(lv.ok()) << lv.status();
    leader_vote_ = *std::move(lv);
    auto mv = joiner_->Join(Header(1, proxy_->address()),
                            [this](absl::Status why) { member_on_abort_ = why; });
    ASSERT_TRUE(mv.ok()) << mv.status();
    member_vote_ = *std::move(mv);
    auto member_staged =
        std::async(std::launch::async, [&] { return member_vote_->Stage(Parts("b")); });
    ASSERT_TRUE(leader_vote_->Stage(Parts("a")).ok());
    ASSERT_TRUE(member_staged.get().ok());
    member_decision_ =
        std::async(std::launch::async, [&] { return member_vote_->Prepare(Prepared()); });
    WaitFor([&] { return leader_->MemberState(1) == "prepared"; }, "the member's vote");
  }
  // The member's link to the leader drops and the leader becomes unreachable.
  void CutTheLink() {
    proxy_->Refuse(true);
    proxy_->Cut();
    WaitFor([&] { return member_vote_->Summary().outcome == "in doubt"; }, "the member in doubt");
  }
  bool MemberDecided() { return member_decision_.wait_for(0s) == std::future_status::ready; }

  group::Coordinator member_coordinator_{group::CoordinatorOptions{}, nullptr};
  std::shared_ptr<group::DecisionLog> log_;
  std::unique_ptr<Leader> leader_;
  std::unique_ptr<testing::CuttableProxy> proxy_;
  std::unique_ptr<GroupJoinerImpl> joiner_;
  std::unique_ptr<engine::GroupVote> leader_vote_, member_vote_;
  std::future<absl::Status> member_decision_;
  std::optional<absl::Status> member_on_abort_;
};

TEST_F(InDoubtTest, APreparedMemberCutOffLearnsTheLeadersCommit) {
  BothPrepareButTheLeader();
  CutTheLink();
  // The leader saw the member's stream end: its vote stands, the round commits.
  ASSERT_TRUE(leader_vote_->Prepare(Prepared()).ok());
  EXPECT_EQ(leader_->MemberState(1), "committed");
  // Unreachable leader: still in doubt, however long.
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(MemberDecided());
  member_vote_->Fail(absl::CancelledError("the trainer cancelled"));  // a vote binds
  proxy_->Refuse(false);
  EXPECT_TRUE(member_decision_.get().ok());
  EXPECT_EQ(member_vote_->Summary().outcome, "committed");
  EXPECT_FALSE(member_on_abort_.has_value()) << *member_on_abort_;
}

TEST_F(InDoubtTest, APreparedMemberCutOffLearnsTheLeadersAbortAndItsReason) {
  BothPrepareButTheLeader();
  CutTheLink();
  leader_vote_->Fail(absl::InternalError("the leader's receiver left"));
  proxy_->Refuse(false);
  const absl::Status s = member_decision_.get();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("the leader's receiver left"), std::string::npos) << s;
  EXPECT_FALSE(member_on_abort_.has_value());  // the decision, not a unilateral abort
}

TEST_F(InDoubtTest, AMemberWhoseStreamEndsBeforeItVotesAbortsAndSoDoesTheRound) {
  auto lv = leader_->coordinator().JoinLocal(Header(0, ""), nullptr);
  ASSERT_TRUE(lv.ok());
  leader_vote_ = *std::move(lv);
  auto mv = joiner_->Join(Header(1, proxy_->address()), nullptr);
  ASSERT_TRUE(mv.ok());
  member_vote_ = *std::move(mv);
  auto member_staged =
      std::async(std::launch::async, [&] { return member_vote_->Stage(Parts("b")); });
  ASSERT_TRUE(leader_vote_->Stage(Parts("a")).ok());
  ASSERT_TRUE(member_staged.get().ok());
  proxy_->Cut();
  WaitFor([&] { return leader_->MemberState(1) == "failed"; }, "the leader to see the member go");
  // Its stream ended before its vote: the version aborts here -- at once when the member saw
  // the end first, or after one question to the leader when its vote went out on the dead
  // stream first (the leader's decision then, the same abort).
  const absl::Status member = member_vote_->Prepare(Prepared());
  EXPECT_FALSE(member.ok());
  EXPECT_TRUE(member.message().find("was lost before it decided") != std::string::npos ||
              member.message().find("its connection to the leader was lost") != std::string::npos)
      << member;
  const absl::Status leader = leader_vote_->Prepare(Prepared());
  EXPECT_TRUE(absl::IsAborted(leader)) << leader;
  EXPECT_NE(leader.message().find("member 1"), std::string::npos) << leader;
}

class InDoubtWithLogTest : public InDoubtTest {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "/decisions-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl";
    std::remove(path_.c_str());
    auto log = group::DecisionLog::Open(path_);
    ASSERT_TRUE(log.ok()) << log.status();
    log_ = *std::move(log);
    InDoubtTest::SetUp();
  }
  // The leader process dies and starts again (reading `path_` when `with_log`) behind the proxy.
  void RestartTheLeader(bool with_log, bool crashed = false) {
    // A crash: what the leader's log held at that instant is all its restart finds (the
    // in-process leader is then ended, and whatever it records on its way out is undone).
    const std::string at_crash = path_ + ".at-crash";
    if (crashed) std::filesystem::copy_file(path_, at_crash);
    leader_vote_.reset();
    leader_.reset();
    log_.reset();
    if (crashed) std::filesystem::rename(at_crash, path_);
    std::shared_ptr<group::DecisionLog> log;
    if (with_log) {
      auto reopened = group::DecisionLog::Open(path_);
      ASSERT_TRUE(reopened.ok()) << reopened.status();
      log = *std::move(reopened);
    }
    leader_ = std::make_unique<Leader>(log);
    proxy_->Retarget(leader_->port());
  }
  std::string path_;
};

TEST_F(InDoubtWithLogTest, ALeaderRestartedWithItsLogTellsTheRecordedCommit) {
  BothPrepareButTheLeader();
  CutTheLink();
  ASSERT_TRUE(leader_vote_->Prepare(Prepared()).ok());
  RestartTheLeader(/*with_log=*/true);
  proxy_->Refuse(false);
  EXPECT_TRUE(member_decision_.get().ok());
}

TEST_F(InDoubtWithLogTest, ALeaderRestartedBeforeDecidingAnswersAbortedFromItsLog) {
  BothPrepareButTheLeader();
  CutTheLink();
  // The leader dies before its own vote: the round was never decided, so never committed.
  RestartTheLeader(/*with_log=*/true, /*crashed=*/true);
  proxy_->Refuse(false);
  const absl::Status s = member_decision_.get();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("never committed it"), std::string::npos) << s;
}

TEST_F(InDoubtWithLogTest, ALeaderRestartedWithoutALogCannotSaySoTheMemberKeepsAsking) {
  BothPrepareButTheLeader();
  CutTheLink();
  ASSERT_TRUE(leader_vote_->Prepare(Prepared()).ok());
  RestartTheLeader(/*with_log=*/false);
  const int before = proxy_->connections();
  proxy_->Refuse(false);
  // It asks the new leader, which cannot say: the member stays in doubt...
  WaitFor([&] { return proxy_->connections() > before; }, "the member to ask the new leader");
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(MemberDecided());
  // ... until its daemon stops: then the publication ends without a decision of its own.
  joiner_->Shutdown();
  const absl::Status s = member_decision_.get();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("in doubt"), std::string::npos) << s;
  EXPECT_NE(s.message().find("no decision log"), std::string::npos) << s;
}

}  // namespace
}  // namespace wpub::server
