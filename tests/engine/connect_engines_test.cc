// Engine::ConnectEngines without a GPU: request validation (INVALID_ARGUMENT naming the entry),
// the CPU path's FAILED_PRECONDITION, refusal while a publication is open, Open refused (or
// queued) while a connect is forming the group, and the group snapshot, with a fake
// RolloutConnector standing in for the NCCL transport.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "core/engine/engine.h"

namespace wpub::engine {
namespace {

// Records requests; Connect blocks until Release() when `hold` is set.
class FakeConnector : public RolloutConnector {
 public:
  absl::StatusOr<RolloutGroupInfo> Connect(const RolloutConnectRequest& request) override {
    {
      std::unique_lock lock(mu_);
      ++calls_;
      last_ = request;
      entered_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_; });
    }
    if (!result_.ok()) return result_;
    RolloutGroupInfo g;
    g.group_name = (request.group_name.empty() ? "wpub_weights" : request.group_name) + "_1";
    int next = 1;
    for (const RolloutEndpoint& e : request.engines) {
      g.engines.push_back({e.url, e.gpus, next, transport::ReceiverState::kIdle, 0, {}});
      next += e.gpus;
    }
    g.world_size = next;
    g.generation = 1;
    g.healthy = true;
    std::lock_guard lock(mu_);
    group_ = g;
    return g;
  }
  RolloutGroupInfo Group() const override {
    std::lock_guard lock(mu_);
    return group_;
  }

  void Hold() {
    std::lock_guard lock(mu_);
    hold_ = true;
    entered_ = false;
  }
  void WaitEntered() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void Release() {
    {
      std::lock_guard lock(mu_);
      hold_ = false;
    }
    cv_.notify_all();
  }
  int calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  RolloutConnectRequest last() const {
    std::lock_guard lock(mu_);
    return last_;
  }
  absl::Status result_ = absl::OkStatus();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  bool entered_ = false;
  int calls_ = 0;
  RolloutConnectRequest last_;
  RolloutGroupInfo group_;
};

// EngineComponents::connector does not own: each test declares the fake before the engine, so
// it outlives it.
std::unique_ptr<Engine> MakeEngine(FakeConnector* connector) {
  EngineComponents c;
  c.connector = connector;
  auto e = Engine::Create(EngineOptions{}, nullptr, std::move(c));
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

RolloutConnectRequest Request(std::vector<RolloutEndpoint> engines) {
  RolloutConnectRequest r;
  r.engines = std::move(engines);
  return r;
}

PublicationHeader Header(uint64_t version, bool queue = false) {
  PublicationHeader h;
  h.version = version;
  h.recipe = "bf16";
  h.queue = queue;
  h.queue_timeout = absl::Seconds(10);
  return h;
}

TEST(ValidateRolloutConnectRequest, NamesTheEntry) {
  EXPECT_TRUE(ValidateRolloutConnectRequest(
                  Request({{"http://a:30000", 4}, {"https://b", 1}, {"http://[::1]:8000", 2}}))
                  .ok());
  struct Case {
    std::vector<RolloutEndpoint> engines;
    std::string expect;  // substring of the message
  };
  const std::vector<Case> cases = {
      {{}, "no engine"},
      {{{"http://a:1", 1}, {"ftp://b:2", 1}}, "engines[1] 'ftp://b:2': the URL must start"},
      {{{"", 1}}, "engines[0] '': the URL is empty"},
      {{{"http://", 1}}, "engines[0] 'http://': the URL has no host"},
      {{{"http://:80", 1}}, "no host"},
      {{{"http://a:0", 1}}, "port"},
      {{{"http://a:99999", 1}}, "port"},
      {{{"http://a:x", 1}}, "port"},
      {{{"http://a b:1", 1}}, "whitespace"},
      {{{"http://a:1/", 1}}, "engines[0] 'http://a:1/': the URL must be scheme://host[:port]"},
      {{{"http://a:1/generate", 1}}, "without a path"},
      {{{"http://a:1", 0}}, "engines[0] 'http://a:1': gpus is 0"},
      {{{"http://a:1", -3}}, "gpus is -3"},
      {{{"http://a:1", 5000}}, "gpus is 5000"},
      {{{"http://a:1", 1}, {"http://a:1", 2}}, "engines[1] 'http://a:1': the URL is given twice"},
  };
  for (const Case& c : cases) {
    absl::Status s = ValidateRolloutConnectRequest(Request(c.engines));
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.expect << ": " << s;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s;
  }
  RolloutConnectRequest r = Request({{"http://a:1", 1}});
  r.group_name = "bad name";
  EXPECT_NE(ValidateRolloutConnectRequest(r).message().find("group_name 'bad name'"),
            std::string::npos);
  r.group_name = std::string(101, 'g');
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRolloutConnectRequest(r)));
  r.group_name = "ok.name-1_x";
  EXPECT_TRUE(ValidateRolloutConnectRequest(r).ok());
  r.timeout = absl::Seconds(-1);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRolloutConnectRequest(r)));
}

TEST(ConnectEngines, CpuPathIsFailedPreconditionAfterValidation) {
  auto e = Engine::Create(EngineOptions{}, nullptr);
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE((*e)->EngineGroup().has_value());
  auto s = (*e)->ConnectEngines(Request({{"http://a:1", 1}}));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("this daemon has no GPU path"), std::string::npos);
  // Bad entries are INVALID_ARGUMENT on every daemon (validated first).
  s = (*e)->ConnectEngines(Request({{"http://a:1", 1}, {"nope", 1}}));
  EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("engines[1] 'nope'"), std::string::npos);
}

TEST(ConnectEngines, PassesTheRequestAndShowsTheGroup) {
  FakeConnector fake;
  auto e = MakeEngine(&fake);
  ASSERT_TRUE(e);
  ASSERT_TRUE(e->EngineGroup().has_value());
  EXPECT_TRUE(e->EngineGroup()->engines.empty());
  RolloutConnectRequest r = Request({{"http://a:1", 2}, {"http://b:2", 3}});
  r.group_name = "trainer7";
  r.timeout = absl::Seconds(7);
  auto g = e->ConnectEngines(r);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->world_size, 6);
  EXPECT_EQ(g->engines.at(1).rank_offset, 3);
  EXPECT_EQ(fake.last().group_name, "trainer7");
  EXPECT_EQ(fake.last().timeout, absl::Seconds(7));
  EXPECT_EQ(e->EngineGroup()->group_name, "trainer7_1");
  // Invalid requests never reach the connector.
  EXPECT_FALSE(e->ConnectEngines(Request({{"http://a:1", 0}})).ok());
  EXPECT_EQ(fake.calls(), 1);
  // The connector's error comes back unchanged.
  fake.result_ = absl::UnavailableError("engine http://b:2 did not join");
  auto failed = e->ConnectEngines(Request({{"http://b:2", 1}}));
  EXPECT_TRUE(absl::IsUnavailable(failed.status()));
  EXPECT_NE(failed.status().message().find("http://b:2"), std::string::npos);
}

TEST(ConnectEngines, RefusedWhileAPublicationIsOpen) {
  FakeConnector fake;
  auto e = MakeEngine(&fake);
  ASSERT_TRUE(e);
  auto session = e->Open(Header(5));
  ASSERT_TRUE(session.ok()) << session.status();
  auto s = e->ConnectEngines(Request({{"http://a:1", 1}}));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("publication version 5 is active"), std::string::npos);
  EXPECT_EQ(fake.calls(), 0);
  session->reset();  // aborts v5 and frees the slot
  EXPECT_TRUE(e->ConnectEngines(Request({{"http://a:1", 1}})).ok());
  EXPECT_EQ(fake.calls(), 1);
}

TEST(ConnectEngines, OpenWaitsOrFailsWhileConnecting) {
  FakeConnector fake;
  auto e = MakeEngine(&fake);
  ASSERT_TRUE(e);
  fake.Hold();
  auto connect = std::async(std::launch::async, [&] {
    return e->ConnectEngines(Request({{"http://a:1", 1}}));
  });
  fake.WaitEntered();
  // A publication is refused while the group forms, naming why.
  auto refused = e->Open(Header(1));
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("ConnectEngines"), std::string::npos);
  // So is a second ConnectEngines.
  auto second = e->ConnectEngines(Request({{"http://b:1", 1}}));
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("another ConnectEngines"), std::string::npos);
  // Status answers meanwhile.
  EXPECT_FALSE(e->GetStatus().active.has_value());
  // A queued publication opens once the connect finished.
  std::atomic<bool> opened{false};
  auto queued = std::async(std::launch::async, [&] {
    auto s = e->Open(Header(1, /*queue=*/true));
    opened = true;
    return s;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(opened);
  fake.Release();
  ASSERT_TRUE(connect.get().ok());
  auto q = queued.get();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(fake.calls(), 1);
}

TEST(ConnectEngines, UnavailableAfterShutdown) {
  FakeConnector fake;
  auto e = MakeEngine(&fake);
  ASSERT_TRUE(e);
  e->BeginShutdown();
  EXPECT_TRUE(absl::IsUnavailable(e->ConnectEngines(Request({{"http://a:1", 1}})).status()));
}

}  // namespace
}  // namespace wpub::engine

namespace wpub::engine {
namespace {

TEST(PausePolicy, ParsesNamesAndDefaults) {
  using P = PausePolicy;
  struct Case {
    const char* text;
    P::InFlight in_flight;
    const char* name;  // resolved by the in-flight mode's default
    bool never_mixes;
  };
  const Case cases[] = {
      {"", P::InFlight::kAbort, "abort:flush", true},
      {"abort", P::InFlight::kAbort, "abort:flush", true},
      {"abort:keep", P::InFlight::kAbort, "abort:keep", false},
      {"wait", P::InFlight::kWait, "wait:flush", true},
      {"retract", P::InFlight::kRetract, "retract:flush", false},
      {"retract:keep", P::InFlight::kRetract, "retract:keep", false},
      {"keep", P::InFlight::kKeep, "keep:keep", false},
      {"keep:flush", P::InFlight::kKeep, "keep:flush", false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<P> p = ParsePausePolicy(c.text);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->in_flight, c.in_flight);
    EXPECT_EQ(PausePolicyName(*p), c.name);
    EXPECT_EQ(p->never_mixes(), c.never_mixes);
    // The name parses back to the same policy.
    absl::StatusOr<P> again = ParsePausePolicy(PausePolicyName(*p));
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(*again == *p);
  }
  for (const char* bad : {"drain", "abort:", "abort:maybe", ":flush", "ABORT", "abort:flush:x"}) {
    const absl::Status s = ParsePausePolicy(bad).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s;
  }
  EXPECT_TRUE(PausePolicyOf("", "").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(PausePolicyOf("keep", "drop").status()));
}

}  // namespace
}  // namespace wpub::engine
