// What an engine answers cannot cost the daemon more than its bounds
// (core/rollout/engine_requests.h): an answer declaring or sending more than kMaxEngineAnswerBytes
// is cut before it is held, an engine that trickles its answer loses it at the call's deadline
// (probes, version reads and update requests alike), and a claimed weight version beyond any
// version wpub can publish is not believed; a probe that runs out of time is told from an engine
// that is not there.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/rollout/engine_driver.h"
#include "core/rollout/engine_requests.h"
#include "core/rollout/sglang_driver.h"
#include "tests/rollout/fake_http.h"

namespace wpub::rollout {
namespace {

class HostileEngine {
 public:
  HostileEngine() {
    // A declared answer far past the bound (nothing of it need arrive).
    server_.Get("/huge", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(std::string(kMaxEngineAnswerBytes + 1, 'x'), "application/json");
    });
    // An answer that never says its length and keeps coming.
    server_.Get("/endless", [](const httplib::Request&, httplib::Response& r) {
      r.set_chunked_content_provider("application/json", [](size_t, httplib::DataSink& sink) {
        const std::string block(64 << 10, ' ');
        return sink.write(block.data(), block.size());
      });
    });
    // A byte every 50 ms: every read is quick, the answer never ends in time.
    server_.Get("/trickle", [this](const httplib::Request&, httplib::Response& r) {
      r.set_chunked_content_provider("application/json", [this](size_t, httplib::DataSink& sink) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return !stopping_ && sink.write(" ", 1);
      });
    });
    // Says nothing until long after any probe's time.
    server_.Get("/silent", [this](const httplib::Request&, httplib::Response& r) {
      for (int i = 0; i < 100 && !stopping_; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      r.set_content("{}", "application/json");
    });
    server_.Get("/version", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(version_body_, "application/json");
    });
    server_.Post("/update_weights_from_distributed",
                 [](const httplib::Request&, httplib::Response& r) {
                   r.set_content(std::string(kMaxEngineAnswerBytes + 10, ' '), "application/json");
                 });
    http_.Start();
  }
  ~HostileEngine() {
    stopping_ = true;
    http_.Stop();
  }
  std::string url() const { return http_.url(); }
  void SetVersionBody(std::string body) { version_body_ = std::move(body); }

 private:
  std::atomic<bool> stopping_{false};
  std::string version_body_;
  testing::LocalHttpServer http_;
  httplib::Server& server_ = http_.server();
};

TEST(EngineHttp, AnswersPastTheBoundAreCutBeforeTheyAreHeld) {
  HostileEngine e;
  httplib::Client c(e.url());
  BoundedAnswer huge = SendBounded(c, "GET", "/huge", nullptr, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(huge.status, 0);
  EXPECT_TRUE(huge.body.empty());
  EXPECT_NE(huge.error.find(absl::StrCat("an answer of ", kMaxEngineAnswerBytes + 1, " bytes")),
            std::string::npos)
      << huge.error;
  BoundedAnswer endless =
      SendBounded(c, "GET", "/endless", nullptr, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(endless.status, 0);
  EXPECT_NE(endless.error.find("more than"), std::string::npos) << endless.error;
}

TEST(EngineHttp, ATricklingAnswerEndsAtTheDeadline) {
  HostileEngine e;
  const std::vector<EngineSpec> engines = {{e.url(), 1, "sglang", ""}};
  const absl::Time t0 = absl::Now();
  // A 1 s probe: once, not once per trickled byte's read timeout.
  EXPECT_EQ(ProbeEngines(engines, "/trickle", absl::Seconds(1)), std::vector<bool>{false});
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  const std::vector<RouteAnswer> routes =
      ProbeRoutes(engines[0], {"/trickle", "/version"}, absl::Seconds(1));
  EXPECT_EQ(routes[0].status, 0);
  EXPECT_NE(routes[0].error.find("deadline"), std::string::npos) << routes[0].error;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

// A join's probe tells a silent engine (its time ran out: DEADLINE_EXCEEDED, as a join that does
// not form in time) from one that is not there (UNAVAILABLE), naming it either way.
TEST(EngineHttp, ASilentProbeIsADeadlineAndAClosedPortIsUnavailable) {
  HostileEngine e;
  const EngineSpec silent{e.url(), 1, "sglang", ""};
  const absl::Time t0 = absl::Now();
  std::vector<RouteAnswer> routes =
      ProbeRoutes(silent, {"/silent", "/version"}, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  ASSERT_EQ(routes.size(), 2u);
  for (const RouteAnswer& r : routes) {
    EXPECT_EQ(r.status, 0);
    EXPECT_TRUE(r.timed_out) << r.error;
  }
  std::optional<absl::Status> refused =
      ProbeRefusal("engine " + e.url() + " GET /silent", routes[0]);
  ASSERT_TRUE(refused.has_value());
  EXPECT_TRUE(absl::IsDeadlineExceeded(*refused)) << *refused;
  EXPECT_NE(refused->message().find(e.url()), std::string::npos) << *refused;

  std::string gone;
  {
    HostileEngine closed;
    gone = closed.url();
  }  // nothing listens there any more
  routes = ProbeRoutes({gone, 1, "sglang", ""}, {"/version"}, absl::Seconds(2));
  ASSERT_EQ(routes.size(), 1u);
  EXPECT_EQ(routes[0].status, 0);
  EXPECT_FALSE(routes[0].timed_out) << routes[0].error;
  refused = ProbeRefusal("engine " + gone + " GET /version", routes[0]);
  ASSERT_TRUE(refused.has_value());
  EXPECT_TRUE(absl::IsUnavailable(*refused)) << *refused;
}

TEST(EngineHttp, AnUpdateAnsweredPastTheBoundFailsTheEngine) {
  HostileEngine e;
  SglangDriverOptions o;
  o.engines = {{e.url(), 1, "sglang", ""}};
  o.master_port = 29500;
  o.endpoints.pause = o.endpoints.flush = o.endpoints.begin = "";
  o.request_timeout = absl::Seconds(5);
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  (*d)->BeginPublication(1, /*lifecycle_calls=*/true);
  transport::BucketManifest b;
  b.tensors.push_back({"w", DType::kBFloat16, {4}, 0, 8});
  b.nbytes = 8;
  (*d)->PostBucket(b);
  absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(10));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("POST /update_weights_from_distributed: an answer of"),
            std::string::npos)
      << s;
}

TEST(EngineHttp, AClaimedVersionBeyondAnyPublishableOneIsNotBelieved) {
  HostileEngine e;
  const std::vector<EngineSpec> engines = {{e.url(), 1, "sglang", ""}};
  const auto read = [&](const std::string& body) {
    e.SetVersionBody(body);
    return FetchWeightVersions(engines, "/version", absl::Seconds(2))[0];
  };
  EXPECT_EQ(read(R"({"weight_version": "17"})"), 17u);
  EXPECT_EQ(read(absl::StrCat(R"({"weight_version": ")", kMaxEngineVersion, R"("})")),
            kMaxEngineVersion);
  EXPECT_EQ(read(absl::StrCat(R"({"weight_version": ")", kMaxEngineVersion + 1, R"("})")), 0u);
  EXPECT_EQ(read(R"({"weight_version": 18446744073709551615})"), 0u);
  EXPECT_EQ(read(R"({"weight_version": "18446744073709551615"})"), 0u);
  EXPECT_EQ(read(R"({"weight_version": "default"})"), 0u);
}

}  // namespace
}  // namespace wpub::rollout
