// The SGLang driver after an aborted publication, against fake engines that answer as SGLang's
// own code does (fake_sglang.h, the release with the weight-update session): paused by
// pause_generation, each update request loads its bucket into the live weights at once (and may
// fail after loading part), continue_generation serves whatever the weights hold, and a second
// begin_weight_update on an open session kills the server. An engine that was sent any bucket
// of an aborted version must stay paused (dirty); the others resume at once; every session that
// was opened is closed; no engine ever serves a mix of versions or dies, over 200 publications
// with random failures.
#include <gtest/gtest.h>
#include <httplib.h>

#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/rollout/sglang_driver.h"
#include "nlohmann/json.hpp"
#include "tests/rollout/fake_sglang.h"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

using testing::FakeSglang;

constexpr int kBuckets = 4;
constexpr int kPerBucket = 6;

transport::BucketManifest Bucket(int index) {
  transport::BucketManifest b;
  b.index = static_cast<uint32_t>(index);
  for (int i = 0; i < kPerBucket; ++i) {
    const uint64_t offset = static_cast<uint64_t>(i) * 64;
    b.tensors.push_back(
        {FakeSglang::Name(index * kPerBucket + i), DType::kBFloat16, {32}, offset, 64});
  }
  b.nbytes = kPerBucket * 64;
  return b;
}

struct Fixture {
  std::vector<std::unique_ptr<FakeSglang>> engines;
  std::unique_ptr<SglangDriver> driver;
  explicit Fixture(int n) {
    SglangDriverOptions o;
    for (int i = 0; i < n; ++i) {
      engines.push_back(std::make_unique<FakeSglang>());
      engines.back()->SetModel(kBuckets * kPerBucket, "0");
      o.engines.push_back({engines.back()->url(), 1, "sglang", ""});
    }
    o.master_port = 29500;
    o.group_name = "wpub_g0";
    o.request_timeout = absl::Seconds(5);
    auto d = SglangDriver::Create(o);
    EXPECT_TRUE(d.ok()) << d.status();
    driver = std::move(*d);
  }
  // Every request answered (failed engines included).
  void Settle() { (void)driver->WaitIdle(absl::Now() + absl::Seconds(10)); }
  // Begin, `sent` buckets, then either the end calls (all buckets, no failure) or the abort
  // path, keeping the dirty engines across publications as the NCCL transport does. Returns
  // the dirty flags of an abort (empty after a commit).
  std::vector<bool> Publish(uint64_t version, int sent, bool commit) {
    std::vector<FakeSglang*> raw;
    for (auto& e : engines) raw.push_back(e.get());
    return testing::PublishThrough(*driver, raw, version, sent, commit, Bucket, dirty_urls);
  }
  std::set<std::string> dirty_urls;
};

TEST(SglangDirtyEngines, AnEngineThatGotABucketOfAnAbortedVersionStaysPaused) {
  Fixture f(2);
  ASSERT_TRUE(f.Publish(1, kBuckets, true).empty());
  for (auto& e : f.engines) {
    EXPECT_TRUE(e->serving());
    EXPECT_EQ(e->held_version(), "1");
  }
  // Engine 0 fails in the middle of bucket 1 (after loading half of it); both got bucket 0.
  for (auto& e : f.engines) e->SetIncoming("2");
  f.driver->BeginPublication(2, /*lifecycle_calls=*/true);
  f.driver->PostBucket(Bucket(0));
  (void)f.driver->WaitIdle(absl::Now() + absl::Seconds(10));
  f.engines[0]->FailNextUpdate();
  f.driver->PostBucket(Bucket(1));
  (void)f.driver->WaitIdle(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(f.driver->any_failed());
  const std::vector<bool> dirty = f.driver->ResumeAfterAbort();
  f.Settle();
  EXPECT_EQ(dirty, (std::vector<bool>{true, true}));
  for (auto& e : f.engines) {
    EXPECT_FALSE(e->serving()) << e->url() << " resumed on a mix of versions 1 and 2";
    EXPECT_EQ(e->held_version(), "");
    EXPECT_EQ(e->mixed_resumes(), 0);
  }
  // Nothing more of version 2 reaches them after the abort, even if posted.
  f.driver->PostBucket(Bucket(2));
  f.driver->EndPublication();
  f.Settle();
  for (auto& e : f.engines) EXPECT_FALSE(e->serving());
  // Dirty engines stay paused through a later abort that sends them nothing.
  f.dirty_urls = {f.engines[0]->url(), f.engines[1]->url()};
  EXPECT_EQ(f.Publish(3, 0, false), (std::vector<bool>{true, true}));
  for (auto& e : f.engines) EXPECT_FALSE(e->serving());
  // The retry (or the next version) makes them clean and serving.
  ASSERT_TRUE(f.Publish(2, kBuckets, true).empty());
  for (auto& e : f.engines) {
    EXPECT_TRUE(e->serving());
    EXPECT_EQ(e->held_version(), "2");
    EXPECT_EQ(e->mixed_resumes(), 0);
  }
}

TEST(SglangDirtyEngines, TheWeightVersionEachEngineServesIsRead) {
  Fixture f(2);
  ASSERT_TRUE(f.Publish(7, kBuckets, true).empty());
  FakeSglang fresh;  // never given a version: reports SGLang's "default"
  std::vector<EngineSpec> engines = {{f.engines[0]->url(), 1, "sglang", ""},
                                     {fresh.url(), 1, "sglang", ""},
                                     {"http://127.0.0.1:1", 1, "sglang", ""}};  // nobody listens
  EXPECT_EQ(FetchWeightVersions(engines, "/get_model_info", absl::Seconds(2)),
            (std::vector<uint64_t>{7, 0, 0}));
}

TEST(SglangDirtyEngines, EnginesThatReceivedNothingResumeAtOnce) {
  Fixture f(2);
  ASSERT_TRUE(f.Publish(1, kBuckets, true).empty());
  // The abort comes before any bucket was posted (e.g. the trainer's input was bad).
  const std::vector<bool> dirty = f.Publish(2, 0, false);
  EXPECT_EQ(dirty, (std::vector<bool>{false, false}));
  for (auto& e : f.engines) {
    EXPECT_TRUE(e->serving());
    EXPECT_EQ(e->held_version(), "1");
  }
  // A second call is a no-op.
  EXPECT_EQ(f.driver->ResumeAfterAbort(), (std::vector<bool>{false, false}));
}

TEST(SglangDirtyEngines, TwoHundredPublicationsWithRandomFailuresNeverServeAMix) {
  Fixture f(3);
  std::mt19937 rng(7);
  std::vector<std::string> committed(3, "0");
  std::vector<std::string> reported(3, "");  // what /get_model_info says: committed versions only
  int aborts = 0, left_dirty = 0;
  for (uint64_t v = 1; v <= 200; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    const int sent = static_cast<int>(rng() % (kBuckets + 1));  // an abort after `sent` buckets
    const bool fails = rng() % 3 == 0;
    if (fails) f.engines[rng() % 3]->FailNextUpdate();
    const bool commit = sent == kBuckets && rng() % 4 != 0;
    const std::vector<bool> dirty = f.Publish(v, sent, commit);
    const bool committed_now = dirty.empty();
    if (!committed_now) ++aborts;
    for (size_t i = 0; i < f.engines.size(); ++i) {
      FakeSglang& e = *f.engines[i];
      if (committed_now) {
        EXPECT_TRUE(e.serving());
        EXPECT_EQ(e.held_version(), std::to_string(v));
        committed[i] = std::to_string(v);
      } else if (dirty[i]) {
        ++left_dirty;
        EXPECT_FALSE(e.serving());
        EXPECT_TRUE(f.dirty_urls.count(e.url()));
      } else {
        // Received nothing of v: serves what it served before, complete.
        EXPECT_TRUE(e.serving());
        EXPECT_EQ(e.held_version(), committed[i]);
      }
      if (e.serving()) committed[i] = e.held_version();
      if (committed_now) reported[i] = std::to_string(v);
      EXPECT_EQ(e.reported_version(), reported[i]) << e.url();
      EXPECT_FALSE(e.dead()) << e.death();
      EXPECT_FALSE(e.session_open()) << e.url();
      EXPECT_EQ(e.requests_aborted_by_version(), 0);
      e.ClearFailure();  // an injected failure no request consumed does not carry over
    }
  }
  for (auto& e : f.engines) EXPECT_EQ(e->mixed_resumes(), 0);
  EXPECT_GT(aborts, 30);
  EXPECT_GT(left_dirty, 30);
}

}  // namespace
}  // namespace wpub::rollout
