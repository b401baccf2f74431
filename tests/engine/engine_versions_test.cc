// Versions are bounded and never go backwards: 2^64-1 once made every later publication
// impossible, and a restarted daemon forgot what its engines serve.
#include <gtest/gtest.h>

#include "core/engine/engine.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

// A connector whose engines report the weight versions they serve (as SGLang's
// /get_model_info does when the group forms).
class VersionedConnector final : public RolloutConnector {
 public:
  absl::StatusOr<RolloutGroupInfo> Connect(const RolloutConnectRequest&) override { return info; }
  RolloutGroupInfo Group() const override { return info; }
  RolloutGroupInfo info;
};

absl::Status Publish(Engine& engine, uint64_t version) {
  auto session = engine.Open(testing::Header(version));
  if (!session.ok()) return session.status();
  if (absl::Status s =
          testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 3));
      !s.ok()) {
    return s;
  }
  auto report = (*session)->Commit();
  if (!report.ok()) return report.status();
  return report->status == PublicationStatus::kCommitted ? absl::OkStatus()
                                                         : absl::AbortedError(report->error);
}

TEST(EngineVersionsTest, VersionsAreBoundedSoNoPublicationUsesUpTheSpace) {
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  auto engine = Engine::Create(options, nullptr);
  ASSERT_TRUE(engine.ok());
  for (uint64_t bad : {~uint64_t{0}, (uint64_t{1} << 53) + 1}) {
    auto s = (*engine)->Open(testing::Header(bad));
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(testing::HasSubstr(s.status(), "largest version allowed")) << s.status();
  }
  // A jump of more than 2^32 beyond the version to exceed.
  auto jump = (*engine)->Open(testing::Header((uint64_t{1} << 32) + 2));
  ASSERT_FALSE(jump.ok());
  EXPECT_EQ(jump.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::HasSubstr(jump.status(), "use up the version space")) << jump.status();
  ASSERT_TRUE(Publish(**engine, uint64_t{1} << 32).ok());
  ASSERT_TRUE(Publish(**engine, (uint64_t{1} << 32) + 5).ok());
  EXPECT_EQ((*engine)->GetStatus().committed_version, (uint64_t{1} << 32) + 5);
}

TEST(EngineVersionsTest, ARestartedDaemonNeverPublishesBelowWhatItsEnginesServe) {
  auto connector = std::make_unique<VersionedConnector>();
  VersionedConnector* c = connector.get();
  c->info.engines.push_back(
      {"http://engine-0:30000", 1, 1, transport::ReceiverState::kIdle, 3, {}});
  c->info.engines.push_back(
      {"http://engine-1:30000", 1, 2, transport::ReceiverState::kIdle, 5, {}});
  c->info.highest_engine_version = 5;
  EngineComponents components;
  components.connector = c;
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  auto engine = Engine::Create(options, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok());
  for (uint64_t stale : {1u, 5u}) {
    auto s = (*engine)->Open(testing::Header(stale));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(testing::HasSubstr(s.status(), "http://engine-1:30000")) << s.status();
    EXPECT_TRUE(testing::HasSubstr(s.status(), "version 5")) << s.status();
  }
  EXPECT_TRUE(Publish(**engine, 6).ok());
}

// The engine refuses to open a version a connected receiver already holds or has passed: after
// a daemon restart (committed version 0) a receiver holding v5 is not taken back to v1.
TEST(EngineVersionsTest, EngineOpenRefusesAVersionAReceiverHolds) {
  auto engine = Engine::Create(EngineOptions{}, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto receiver = transport::testing::InprocReceiver::Start(
      (*engine)->pull_transport(), {.name = "engine-0", .held_version = 5});
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  for (uint64_t version : {1u, 5u}) {
    auto session = (*engine)->Open(testing::Header(version));
    ASSERT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition) << version;
    EXPECT_TRUE(testing::HasSubstr(session.status(), "engine-0")) << session.status();
    EXPECT_TRUE(testing::HasSubstr(session.status(), absl::StrCat(version))) << session.status();
    EXPECT_TRUE(testing::HasSubstr(session.status(), "5")) << session.status();
  }
  EXPECT_EQ((*engine)->GetStatus().committed_version, 0u);
  auto session = (*engine)->Open(testing::Header(6));
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 6)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  ASSERT_TRUE((*receiver)->WaitForOutcome(6, absl::Seconds(30)));
  EXPECT_EQ((*receiver)->committed_version(), 6u);
}

}  // namespace
}  // namespace wpub::engine
