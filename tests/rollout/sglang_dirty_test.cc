// The SGLang driver after an aborted publication, against fake engines that behave as SGLang:
// paused by pause_generation, each update request loads its bucket into the live weights at
// once (and may fail after loading part), continue_generation serves whatever the weights hold.
// An engine that was sent any bucket of an aborted version must stay paused (dirty); the others
// resume at once; no engine ever serves a mix of versions, over 200 publications with random
// failures.
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

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

// SGLang's weight-update behaviour, reduced to what matters for mixing versions.
class SglangLikeEngine {
 public:
  SglangLikeEngine() {
    server_.Post("/pause_generation", [this](const httplib::Request&, httplib::Response& r) {
      std::lock_guard lock(mu_);
      serving_ = false;
      Ok(r);
    });
    server_.Post("/continue_generation", [this](const httplib::Request&, httplib::Response& r) {
      std::lock_guard lock(mu_);
      serving_ = true;
      // What it serves from now on: every generation reads these weights.
      std::set<std::string> versions;
      for (const auto& [name, v] : weights_) versions.insert(v);
      if (versions.size() > 1 || weights_.size() != model_size_) ++mixed_resumes_;
      Ok(r);
    });
    server_.Post("/update_weights_from_distributed",
                 [this](const httplib::Request& q, httplib::Response& r) {
                   json j = json::parse(q.body);
                   std::lock_guard lock(mu_);
                   const auto names = j["names"].get<std::vector<std::string>>();
                   const std::string v = j["weight_version"].get<std::string>();
                   // Loaded on receipt; a failure may come after part of the bucket was loaded.
                   const size_t loaded = fail_next_ ? names.size() / 2 : names.size();
                   for (size_t i = 0; i < loaded; ++i) weights_[names[i]] = v;
                   if (fail_next_) {
                     fail_next_ = false;
                     r.status = 500;
                     r.set_content("NCCL error", "text/plain");
                     return;
                   }
                   Ok(r);
                 });
    server_.Post("/update_weight_version", [this](const httplib::Request& q, httplib::Response& r) {
      json j = json::parse(q.body);
      std::lock_guard lock(mu_);
      weight_version_ = j["new_version"].get<std::string>();
      Ok(r);
    });
    server_.Get("/get_model_info", [this](const httplib::Request&, httplib::Response& r) {
      std::lock_guard lock(mu_);
      json j = {{"model_path", "fake"}, {"is_generation", true}};
      if (!weight_version_.empty()) j["weight_version"] = weight_version_;
      r.set_content(j.dump(), "application/json");
    });
    for (const char* path : {"/begin_weight_update", "/end_weight_update", "/flush_cache"}) {
      server_.Post(path, [](const httplib::Request&, httplib::Response& r) { Ok(r); });
      server_.Get(path, [](const httplib::Request&, httplib::Response& r) { Ok(r); });
    }
    server_.set_tcp_nodelay(true);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~SglangLikeEngine() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void FailNextUpdate() {
    std::lock_guard lock(mu_);
    fail_next_ = true;
  }
  void ClearFailure() {
    std::lock_guard lock(mu_);
    fail_next_ = false;
  }
  void SetModel(size_t tensors, const std::string& version) {
    std::lock_guard lock(mu_);
    model_size_ = tensors;
    for (size_t i = 0; i < tensors; ++i) weights_[Name(i)] = version;
  }
  bool serving() const {
    std::lock_guard lock(mu_);
    return serving_;
  }
  // The single version the weights hold, or "" when they mix versions.
  std::string version() const {
    std::lock_guard lock(mu_);
    std::set<std::string> versions;
    for (const auto& [name, v] : weights_) versions.insert(v);
    return versions.size() == 1 ? *versions.begin() : "";
  }
  int mixed_resumes() const {
    std::lock_guard lock(mu_);
    return mixed_resumes_;
  }
  static std::string Name(size_t i) { return absl::StrCat("model.layers.", i, ".mlp.weight"); }

 private:
  static void Ok(httplib::Response& r) {
    r.set_content(R"({"success": true, "message": "ok"})", "application/json");
  }
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  mutable std::mutex mu_;
  bool serving_ = true;
  bool fail_next_ = false;
  size_t model_size_ = 0;
  std::map<std::string, std::string> weights_;
  std::string weight_version_;
  int mixed_resumes_ = 0;
};

constexpr int kBuckets = 4;
constexpr int kPerBucket = 6;

engine::BucketManifest Bucket(int index) {
  engine::BucketManifest b;
  b.index = static_cast<uint32_t>(index);
  for (int i = 0; i < kPerBucket; ++i) {
    const uint64_t offset = static_cast<uint64_t>(i) * 64;
    b.tensors.push_back(
        {SglangLikeEngine::Name(index * kPerBucket + i), DType::kBFloat16, {32}, offset, 64});
  }
  b.nbytes = kPerBucket * 64;
  return b;
}

struct Fixture {
  std::vector<std::unique_ptr<SglangLikeEngine>> engines;
  std::unique_ptr<SglangDriver> driver;
  explicit Fixture(int n) {
    SglangDriverOptions o;
    for (int i = 0; i < n; ++i) {
      engines.push_back(std::make_unique<SglangLikeEngine>());
      engines.back()->SetModel(kBuckets * kPerBucket, "0");
      o.engines.push_back({engines.back()->url(), 1});
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
    driver->BeginPublication(version, /*lifecycle_calls=*/true);
    for (int b = 0; b < sent; ++b) driver->PostBucket(Bucket(b));
    Settle();
    if (commit && !driver->any_failed()) {
      driver->EndPublication();
      EXPECT_TRUE(driver->WaitIdle(absl::Now() + absl::Seconds(10)).ok());
      dirty_urls.clear();
      return {};
    }
    std::vector<bool> dirty = driver->ResumeAfterAbort(dirty_urls);
    Settle();
    for (size_t i = 0; i < dirty.size(); ++i) {
      if (dirty[i]) dirty_urls.insert(engines[i]->url());
    }
    return dirty;
  }
  std::set<std::string> dirty_urls;
};

TEST(SglangDirtyEngines, AnEngineThatGotABucketOfAnAbortedVersionStaysPaused) {
  Fixture f(2);
  ASSERT_TRUE(f.Publish(1, kBuckets, true).empty());
  for (auto& e : f.engines) {
    EXPECT_TRUE(e->serving());
    EXPECT_EQ(e->version(), "1");
  }
  // Engine 0 fails in the middle of bucket 1 (after loading half of it); both got bucket 0.
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
    EXPECT_EQ(e->version(), "");
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
    EXPECT_EQ(e->version(), "2");
    EXPECT_EQ(e->mixed_resumes(), 0);
  }
}

TEST(SglangDirtyEngines, TheWeightVersionEachEngineServesIsRead) {
  Fixture f(2);
  ASSERT_TRUE(f.Publish(7, kBuckets, true).empty());
  SglangLikeEngine fresh;  // never given a version: no weight_version in its answer
  std::vector<EngineSpec> engines = {
      {f.engines[0]->url(), 1}, {fresh.url(), 1}, {"http://127.0.0.1:1", 1}};  // nobody listens
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
    EXPECT_EQ(e->version(), "1");
  }
  // A second call is a no-op.
  EXPECT_EQ(f.driver->ResumeAfterAbort(), (std::vector<bool>{false, false}));
}

TEST(SglangDirtyEngines, TwoHundredPublicationsWithRandomFailuresNeverServeAMix) {
  Fixture f(3);
  std::mt19937 rng(7);
  std::vector<std::string> committed(3, "0");
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
      SglangLikeEngine& e = *f.engines[i];
      if (committed_now) {
        EXPECT_TRUE(e.serving());
        EXPECT_EQ(e.version(), std::to_string(v));
        committed[i] = std::to_string(v);
      } else if (dirty[i]) {
        ++left_dirty;
        EXPECT_FALSE(e.serving());
        EXPECT_TRUE(f.dirty_urls.count(e.url()));
      } else {
        // Received nothing of v: serves what it served before, complete.
        EXPECT_TRUE(e.serving());
        EXPECT_EQ(e.version(), committed[i]);
      }
      if (e.serving()) committed[i] = e.version();
      e.ClearFailure();  // an injected failure no request consumed does not carry over
    }
  }
  for (auto& e : f.engines) EXPECT_EQ(e->mixed_resumes(), 0);
  EXPECT_GT(aborts, 30);
  EXPECT_GT(left_dirty, 30);
}

}  // namespace
}  // namespace wpub::rollout
