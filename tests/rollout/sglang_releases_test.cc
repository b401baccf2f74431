// SGLang engines as released (fake_sglang.h answers as each release's code does), driven the way
// the rollout group drives them: the family's probe at join (SglangFamily::Profile), a driver
// built from what it found, publications and their aborts.
//  - Each release's profile: the release it reports, the routes it lacks (a release before the
//    weight-update session lacks begin/end; one before the flattened bucket gets one broadcast
//    per tensor), an engine behind an API key refused at join naming the key flag, a server
//    that is not SGLang refused naming the route.
//  - A release without the session publishes and aborts without ever being sent begin/end.
//  - A release with the session: every begin is matched by an end on every path (commit, an
//    abort after a bucket, an abort before any, a failed update), before any resume -- the next
//    begin would kill the server otherwise; every publication after an abort commits.
//  - The version an engine reports changes only when it committed (SGLang adopts a bucket's
//    weight_version at once, so buckets carry none), and announcing it aborts no request.
//  - A cache flush refused while retracted requests wait does not fail the publication.
//  - Mixed releases in one group get each its own protocol.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/rollout/sglang_driver.h"
#include "tests/rollout/fake_sglang.h"

namespace wpub::rollout {
namespace {

using testing::FakeSglang;
using testing::FakeSglangOptions;
using testing::SglangRelease;

constexpr int kBuckets = 3;
constexpr int kPerBucket = 4;

transport::BucketManifest Bucket(int index) {
  transport::BucketManifest b;
  b.index = static_cast<uint32_t>(index);
  for (int i = 0; i < kPerBucket; ++i) {
    // Mixed dtypes, largest element first (the planner's order): NVFP4's triple and a bf16.
    static const DType kTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kUInt8,
                                   DType::kFloat8E4M3};
    const uint64_t nbytes = 64 + 16 * static_cast<uint64_t>(i);
    b.tensors.push_back({FakeSglang::Name(index * kPerBucket + i),
                         kTypes[i],
                         {static_cast<int64_t>(nbytes / DTypeSize(kTypes[i]))},
                         b.nbytes,
                         nbytes});
    b.nbytes += nbytes;
  }
  return b;
}

// Engines of the given releases behind one driver made as the rollout group makes it.
struct Group {
  std::vector<std::unique_ptr<FakeSglang>> engines;
  std::vector<absl::StatusOr<EngineProfile>> profiles;
  std::unique_ptr<EngineDriver> driver;
  std::set<std::string> dirty_urls;

  explicit Group(const std::vector<FakeSglangOptions>& releases, const std::string& key = "") {
    std::vector<EngineSpec> specs;
    for (const FakeSglangOptions& o : releases) {
      engines.push_back(std::make_unique<FakeSglang>(o));
      engines.back()->SetModel(kBuckets * kPerBucket, "0");
      specs.push_back({engines.back()->url(), 1, "sglang", key});
    }
    SglangFamilyOptions fo;
    fo.driver.request_timeout = absl::Seconds(5);
    fo.driver.connect_timeout = absl::Seconds(2);
    SglangFamily family(fo);
    profiles = family.Profile(specs, absl::Seconds(2));
    GroupAddress a;
    a.engines = specs;
    a.master_port = 29500;
    a.group_name = "wpub_g_1";
    for (const auto& p : profiles) {
      if (!p.ok()) return;  // refused at join: no driver
      a.profiles.push_back(*p);
    }
    auto d = family.CreateDriver(a);
    EXPECT_TRUE(d.ok()) << d.status();
    driver = std::move(*d);
    driver->StartJoin();
    EXPECT_TRUE(driver->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  }
  void Settle() { (void)driver->WaitIdle(absl::Now() + absl::Seconds(10)); }
  // `sent` buckets, then the end calls (commit) or the abort path. Returns the dirty flags of an
  // abort, empty after a commit.
  std::vector<bool> Publish(uint64_t version, int sent, bool commit) {
    std::vector<FakeSglang*> raw;
    for (auto& e : engines) raw.push_back(e.get());
    return testing::PublishThrough(*driver, raw, version, sent, commit, Bucket, dirty_urls);
  }
  // Every engine alive, no session left open.
  void ExpectSound() {
    for (auto& e : engines) {
      EXPECT_FALSE(e->dead()) << e->url() << ": " << e->death();
      EXPECT_FALSE(e->session_open()) << e->url();
    }
  }
};

int Count(const std::vector<std::string>& calls, const std::string& call) {
  return static_cast<int>(std::count(calls.begin(), calls.end(), call));
}

TEST(SglangReleases, TheProbeFindsWhatEachReleaseServes) {
  Group g({{SglangRelease::kV0_5_5}, {SglangRelease::kV0_5_6}, {SglangRelease::kV0_5_16}});
  ASSERT_EQ(g.profiles.size(), 3u);
  for (const auto& p : g.profiles) ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(g.profiles[0]->release, "0.5.5.post3");
  EXPECT_EQ(g.profiles[0]->lacks,
            (std::set<std::string, std::less<>>{"/begin_weight_update", "/end_weight_update",
                                                std::string(kFlattenedBucket)}));
  EXPECT_EQ(g.profiles[1]->release, "0.5.6");
  EXPECT_EQ(g.profiles[1]->lacks,
            (std::set<std::string, std::less<>>{"/begin_weight_update", "/end_weight_update"}));
  EXPECT_EQ(g.profiles[2]->release, "0.5.16");
  EXPECT_TRUE(g.profiles[2]->lacks.empty());
  for (auto& p : g.profiles) EXPECT_FALSE(p->bucket_versions);
  // The probe changed nothing: GETs only, and no engine was paused or flushed by it.
  for (auto& e : g.engines) {
    for (const std::string& c : e->calls()) {
      EXPECT_TRUE(c.rfind("GET ", 0) == 0 || c == "POST /init_weights_update_group") << c;
    }
    EXPECT_TRUE(e->serving());
  }
}

TEST(SglangReleases, AReleaseBeforeTheFlattenedBucketGetsOneBroadcastPerTensor) {
  Group g({{SglangRelease::kV0_5_5}, {SglangRelease::kV0_5_16}});
  ASSERT_NE(g.driver, nullptr);
  const transport::BucketManifest b = Bucket(0);
  std::vector<uint64_t> per_tensor;
  for (const auto& t : b.tensors) per_tensor.push_back(t.nbytes);
  // The engines of a group receive the same broadcasts: the whole group goes per tensor.
  EXPECT_EQ(g.driver->BroadcastChunks(b), per_tensor);
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  for (auto& e : g.engines) {
    EXPECT_EQ(e->held_version(), "1");
    EXPECT_EQ(e->load_formats(), std::vector<std::string>(kBuckets, ""));
  }
  // Current releases alone: one flattened bucket.
  Group now({{SglangRelease::kV0_5_6}, {SglangRelease::kV0_5_16}});
  EXPECT_EQ(now.driver->BroadcastChunks(b), (std::vector<uint64_t>{b.nbytes}));
  ASSERT_TRUE(now.Publish(1, kBuckets, true).empty());
  for (auto& e : now.engines) {
    EXPECT_EQ(e->load_formats(), std::vector<std::string>(kBuckets, "flattened_bucket"));
  }
  EXPECT_FALSE(ReleaseBefore("", "0.5.6"));  // not reported: assumed current
  EXPECT_TRUE(ReleaseBefore("v0.4.10", "0.5.6"));
  EXPECT_FALSE(ReleaseBefore("0.5.16.dev3+gabc", "0.5.6"));
}

TEST(SglangReleases, AReleaseWithoutTheSessionIsNeverSentBeginOrEnd) {
  Group g({{SglangRelease::kV0_5_6}, {SglangRelease::kV0_5_6}});
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  g.engines[0]->FailNextUpdate();
  EXPECT_EQ(g.Publish(2, 2, true), (std::vector<bool>{true, true}));
  ASSERT_TRUE(g.Publish(2, kBuckets, true).empty());
  for (auto& e : g.engines) {
    const std::vector<std::string> calls = e->calls();
    EXPECT_EQ(Count(calls, "POST /begin_weight_update"), 0);
    EXPECT_EQ(Count(calls, "POST /end_weight_update"), 0);
    EXPECT_EQ(e->held_version(), "2");
    EXPECT_TRUE(e->serving());
  }
  g.ExpectSound();
}

TEST(SglangReleases, EverySessionIsClosedOnEveryPathAndTheNextVersionCommits) {
  for (const SglangRelease r : {SglangRelease::kV0_5_16, SglangRelease::kSessionRefusing}) {
    SCOPED_TRACE(static_cast<int>(r));
    Group g({{r}, {r}});
    ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
    g.ExpectSound();
    // An abort before any bucket: both resume on version 1, their sessions closed.
    EXPECT_EQ(g.Publish(2, 0, false), (std::vector<bool>{false, false}));
    g.ExpectSound();
    for (auto& e : g.engines) {
      EXPECT_TRUE(e->serving());
      EXPECT_EQ(e->held_version(), "1");
    }
    // A failed update on engine 0 at bucket 1: both hold part of 2, stay paused, sessions closed.
    g.engines[0]->FailNextUpdate();
    EXPECT_EQ(g.Publish(2, 2, true), (std::vector<bool>{true, true}));
    g.ExpectSound();
    for (auto& e : g.engines) {
      EXPECT_FALSE(e->serving());
      EXPECT_EQ(e->reported_version(), "1") << "a dirty engine reports the version it committed";
      // The end came before anything else after the failure (no resume of a dirty engine).
      const std::vector<std::string> calls = e->calls();
      EXPECT_EQ(calls.back(), "POST /end_weight_update");
    }
    // The next begin finds every session closed: the retry commits everywhere.
    ASSERT_TRUE(g.Publish(2, kBuckets, true).empty());
    g.ExpectSound();
    for (auto& e : g.engines) {
      EXPECT_TRUE(e->serving());
      EXPECT_EQ(e->held_version(), "2");
      EXPECT_EQ(e->reported_version(), "2");
      EXPECT_EQ(e->mixed_resumes(), 0);
      const std::vector<std::string> calls = e->calls();
      EXPECT_EQ(Count(calls, "POST /begin_weight_update"), Count(calls, "POST /end_weight_update"));
    }
  }
}

// A retry re-forms the group right after an abort: the teardown (Leave) must not take back the
// end the abort queued behind a bucket still in flight.
TEST(SglangReleases, ATeardownRightAfterAnAbortStillClosesTheSession) {
  Group g({{SglangRelease::kV0_5_16}});
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  g.engines[0]->SetIncoming("2");
  g.driver->BeginPublication(2, /*lifecycle_calls=*/true);
  g.driver->PostBucket(Bucket(0));
  g.Settle();
  g.engines[0]->SetDelay(std::chrono::milliseconds(200));
  g.driver->PostBucket(Bucket(1));  // in flight while the abort comes
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(g.driver->ResumeAfterAbort({}), (std::vector<bool>{true}));
  g.driver->Leave();
  g.Settle();
  const std::vector<std::string> calls = g.engines[0]->calls();
  ASSERT_GE(calls.size(), 2u);
  EXPECT_EQ(calls[calls.size() - 2], "POST /end_weight_update");
  EXPECT_EQ(calls.back(), "POST /destroy_weights_update_group");
  g.ExpectSound();
}

TEST(SglangReleases, AnUnmatchedBeginKillsTheServerAsSglangDoes) {
  // What the fake models (and why the driver closes every session): a second begin on an open
  // session is a scheduler assertion -- the server dies, the request gets no answer.
  Group g({{SglangRelease::kV0_5_16}});
  g.driver->BeginPublication(1, /*lifecycle_calls=*/true);
  g.Settle();
  // The session opens with the first bucket (pause, flush and begin go before it).
  EXPECT_FALSE(g.engines[0]->session_open());
  EXPECT_TRUE(g.engines[0]->serving());
  g.driver->PostBucket(Bucket(0));
  g.Settle();
  EXPECT_TRUE(g.engines[0]->session_open());
  EXPECT_FALSE(g.engines[0]->serving());
  httplib::Client c(g.engines[0]->url());
  auto r = c.Post("/begin_weight_update", "{}", "application/json");
  EXPECT_FALSE(r && r->status == 200);
  EXPECT_TRUE(g.engines[0]->dead());
  EXPECT_FALSE(c.Get("/health") && c.Get("/health")->status == 200);
}

TEST(SglangReleases, TheReportedVersionChangesOnlyOnCommitAndAbortsNoRequest) {
  Group g({{SglangRelease::kV0_5_16}, {SglangRelease::kV0_5_6}});
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  // Every bucket of version 2 loaded, then the publication aborts (another transport failed).
  EXPECT_EQ(g.Publish(2, kBuckets, false), (std::vector<bool>{true, true}));
  for (auto& e : g.engines) {
    EXPECT_EQ(e->held_version(), "2");      // the bytes are there ...
    EXPECT_EQ(e->reported_version(), "1");  // ... but 2 was never committed
    EXPECT_FALSE(e->serving());
  }
  std::vector<EngineSpec> specs;
  for (auto& e : g.engines) specs.push_back({e->url(), 1});
  EXPECT_EQ(SglangFamily({}).WeightVersions(specs, absl::Seconds(2)),
            (std::vector<uint64_t>{1, 1}));  // what a restarted wpubd reads
  ASSERT_TRUE(g.Publish(2, kBuckets, true).empty());
  for (auto& e : g.engines) {
    EXPECT_EQ(e->reported_version(), "2");
    EXPECT_EQ(e->requests_aborted_by_version(), 0);
  }
}

TEST(SglangReleases, AnEngineBehindAnApiKeyIsRefusedAtJoinNamingTheFlag) {
  FakeSglangOptions o{SglangRelease::kV0_5_16, "user-key", "admin-key"};
  {
    Group g({o});  // wpubd given no key
    ASSERT_FALSE(g.profiles[0].ok());
    const std::string m(g.profiles[0].status().message());
    EXPECT_EQ(g.profiles[0].status().code(), absl::StatusCode::kPermissionDenied) << m;
    EXPECT_NE(m.find(g.engines[0]->url()), std::string::npos) << m;
    EXPECT_NE(m.find("HTTP 401"), std::string::npos) << m;
    EXPECT_NE(m.find("--engine_api_key_file"), std::string::npos) << m;
    EXPECT_NE(m.find("admin"), std::string::npos) << m;
  }
  {
    Group g({o}, "user-key");  // the weight routes take only the admin key when both are set
    ASSERT_FALSE(g.profiles[0].ok());
  }
  Group g({o}, "admin-key");
  ASSERT_TRUE(g.profiles[0].ok()) << g.profiles[0].status();
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  EXPECT_EQ(g.engines[0]->held_version(), "1");
  g.ExpectSound();
}

TEST(SglangReleases, AServerThatIsNotSglangIsRefusedNamingTheRoute) {
  testing::LocalHttpServer other;
  other.server().Get("/health",
                     [](const httplib::Request&, httplib::Response& r) { r.status = 200; });
  other.Start();
  const std::string url = other.url();
  auto p = SglangFamily({}).Profile({{url, 1}}, absl::Seconds(2));
  other.Stop();
  ASSERT_FALSE(p[0].ok());
  EXPECT_NE(p[0].status().message().find("/init_weights_update_group (HTTP 404)"),
            std::string::npos)
      << p[0].status();
  auto down = SglangFamily({}).Profile({{url, 1}}, absl::Seconds(1));  // nobody listens now
  ASSERT_FALSE(down[0].ok());
  EXPECT_EQ(down[0].status().code(), absl::StatusCode::kUnavailable) << down[0].status();
}

TEST(SglangReleases, ARefusedCacheFlushDoesNotFailThePublication) {
  Group g({{SglangRelease::kV0_5_16}});
  g.engines[0]->SetWaitingRequests(3);
  g.engines[0]->SetAbortLag(1);  // one aborted request still in the scheduler at the flush
  ASSERT_TRUE(g.Publish(1, kBuckets, true).empty());
  EXPECT_EQ(g.engines[0]->held_version(), "1");
  EXPECT_TRUE(g.engines[0]->serving());
  const std::vector<EngineOutcome> o = g.driver->outcomes();
  EXPECT_FALSE(o[0].failed);
  EXPECT_NE(o[0].warning.find("GET /flush_cache: HTTP 400"), std::string::npos) << o[0].warning;
}

TEST(SglangReleases, MixedReleasesOverTwoHundredPublicationsNeverDieMixOrMisreport) {
  Group g({{SglangRelease::kV0_5_6}, {SglangRelease::kV0_5_16}, {SglangRelease::kSessionRefusing}});
  std::mt19937 rng(11);
  std::vector<std::string> reported(3, "");
  int aborts = 0;
  for (uint64_t v = 1; v <= 200; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    const int sent = static_cast<int>(rng() % (kBuckets + 1));
    if (rng() % 3 == 0) g.engines[rng() % 3]->FailNextUpdate();
    const bool commit = sent == kBuckets && rng() % 4 != 0;
    const std::vector<bool> dirty = g.Publish(v, sent, commit);
    if (!dirty.empty()) ++aborts;
    for (size_t i = 0; i < g.engines.size(); ++i) {
      FakeSglang& e = *g.engines[i];
      if (dirty.empty()) reported[i] = std::to_string(v);
      EXPECT_EQ(e.reported_version(), reported[i]) << e.url();
      if (e.serving()) {
        EXPECT_NE(e.held_version(), "") << e.url() << " serves a mix";
      }
      e.ClearFailure();
    }
    g.ExpectSound();
  }
  for (auto& e : g.engines) EXPECT_EQ(e->mixed_resumes(), 0);
  EXPECT_GT(aborts, 30);
}

}  // namespace
}  // namespace wpub::rollout
