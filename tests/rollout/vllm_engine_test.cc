// The vLLM driver against the C++ vLLM-protocol engine (clients/recv/vllm_engine.h) over an
// in-process wire that plays the NCCL broadcast: the publisher side cuts each bucket into the
// driver's packed chunks, the engine side computes its own from the update request alone (as
// vLLM's receiver does) and refuses a chunk of another size. Covered: three versions to two
// engines of both packing placements, byte for byte with names, dtypes and shapes (NVFP4's
// uint8 / float8_e4m3fn / float32 triple, bf16, a 0-d scale declared [1]); the abort paths (no
// bucket sent: every engine resumes with its weights unchanged; a bucket sent: the engines hold
// a mix, stay paused and report no version until the next complete version); the engine's
// refusals (bodies, order) in vLLM's error shape, and the driver naming the engine when a
// receive fails; the pickled unique id read back, from the driver's encoder and from Python's
// pickle of vLLM's ctypes struct (protocols 3 to 5), and hostile pickles refused.
#include <gtest/gtest.h>
#include <httplib.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>

#include "absl/strings/escaping.h"
#include "clients/recv/vllm_engine.h"
#include "core/rollout/engine_driver.h"
#include "core/rollout/vllm_driver.h"
#include "nlohmann/json.hpp"

namespace wpub::recv {
namespace {

using json = nlohmann::json;
using rollout::EngineOutcome;
using rollout::VllmDriver;
using rollout::VllmDriverOptions;

constexpr uint64_t kChunkLimit = 4096;

// One engine's end of the broadcast: the publisher pushes chunks, the engine pops them in order.
class Wire {
 public:
  void Push(std::vector<uint8_t> chunk) {
    std::lock_guard lock(mu_);
    chunks_.push_back(std::move(chunk));
    cv_.notify_all();
  }
  // The next chunk, or nullopt once aborted or after 10 s without one.
  std::optional<std::vector<uint8_t>> Pop() {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(10),
                      [&] { return aborted_ || !chunks_.empty(); }) ||
        aborted_) {
      return std::nullopt;
    }
    std::vector<uint8_t> c = std::move(chunks_.front());
    chunks_.pop_front();
    return c;
  }
  void Abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  // A new communicator: nothing of the old one's broadcasts is left.
  void Reset() {
    std::lock_guard lock(mu_);
    aborted_ = false;
    chunks_.clear();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<uint8_t>> chunks_;
  bool aborted_ = false;
};

class WireDataPath final : public VllmDataPath {
 public:
  explicit WireDataPath(std::shared_ptr<Wire> wire) : wire_(std::move(wire)) {}
  absl::Status Join(const VllmInitInfo& init) override {
    joins_.push_back(init);
    return absl::OkStatus();
  }
  absl::Status Receive(const VllmUpdate& u, std::vector<uint8_t>* bytes) override {
    for (size_t k = 0; k < u.chunks.size(); ++k) {
      std::optional<std::vector<uint8_t>> c = wire_->Pop();
      if (!c) return absl::DeadlineExceededError("no broadcast arrived");
      if (c->size() != u.chunks[k]) {
        return absl::DataLossError(absl::StrCat("chunk ", k, ": ", c->size(), " bytes broadcast, ",
                                                u.chunks[k], " expected"));
      }
      bytes->insert(bytes->end(), c->begin(), c->end());
    }
    return absl::OkStatus();
  }
  void Abort() override { wire_->Abort(); }
  std::vector<VllmInitInfo> joins_;

 private:
  std::shared_ptr<Wire> wire_;
};

// A bucket in the planner's layout (back to back, in order) and its bytes.
struct TestBucket {
  transport::BucketManifest manifest;
  std::vector<uint8_t> bytes;
};

TestBucket MakeBucket(uint32_t index, int layer, uint32_t seed) {
  TestBucket b;
  b.manifest.index = index;
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const std::vector<std::pair<std::string, TensorDesc>> tensors = {
      {"", {p + "mlp.experts.0.down_proj.weight_scale_2", DType::kFloat32, {}}},
      {"", {p + "mlp.experts.0.down_proj.input_scale", DType::kFloat32, {}}},
      {"", {p + "self_attn.o_proj.weight", DType::kBFloat16, {32, 48}}},
      {"", {p + "mlp.experts.0.down_proj.weight", DType::kUInt8, {64, 24}}},
      {"", {p + "mlp.experts.0.down_proj.weight_scale", DType::kFloat8E4M3, {64, 3}}},
      {"", {p + "mlp.shared_experts.up_proj.weight", DType::kBFloat16, {40, 40}}},
  };
  std::mt19937 rng(seed);
  for (const auto& [unused, d] : tensors) {
    transport::ManifestTensor t{d.name, d.dtype, d.shape, b.bytes.size(),
                                static_cast<uint64_t>(d.nbytes())};
    for (uint64_t i = 0; i < t.nbytes; ++i) b.bytes.push_back(static_cast<uint8_t>(rng()));
    b.manifest.tensors.push_back(std::move(t));
  }
  b.manifest.nbytes = b.bytes.size();
  return b;
}

class Harness {
 public:
  // One engine per placement: v0.28+ (packing at init) and v0.22-v0.27 (packing per update).
  explicit Harness(std::vector<bool> packing_in_init) {
    for (const bool at_init : packing_in_init) {
      auto wire = std::make_shared<Wire>();
      auto path = std::make_unique<WireDataPath>(wire);
      paths_.push_back(path.get());
      VllmEngineOptions o;
      o.packing_in_init = at_init;
      auto e = VllmEngine::Start(o, std::move(path));
      EXPECT_TRUE(e.ok()) << e.status();
      engines_.push_back(*std::move(e));
      wires_.push_back(std::move(wire));
    }
    VllmDriverOptions d;
    for (auto& e : engines_) d.engines.push_back({e->url(), 1, "vllm"});
    d.master_address = "127.0.0.1";
    d.master_port = 29511;
    d.packed_buffer_bytes = kChunkLimit;
    d.request_timeout = absl::Seconds(20);
    auto driver = VllmDriver::Create(d);
    EXPECT_TRUE(driver.ok()) << driver.status();
    driver_ = *std::move(driver);
  }

  absl::Status Join() {
    driver_->StartJoin();
    return driver_->WaitIdle(absl::Now() + absl::Seconds(20));
  }
  // PostBucket, then the broadcast of the bucket's packed chunks to every engine.
  void Send(const TestBucket& b) {
    driver_->PostBucket(b.manifest);
    uint64_t at = 0;
    for (const uint64_t n : driver_->BroadcastChunks(b.manifest)) {
      for (auto& w : wires_) {
        const uint64_t end = std::min<uint64_t>(at + n, b.bytes.size());
        w->Push(std::vector<uint8_t>(b.bytes.begin() + at, b.bytes.begin() + end));
      }
      at += n;
    }
  }
  absl::Status Publish(uint64_t version, const std::vector<TestBucket>& buckets) {
    driver_->BeginPublication(version, /*lifecycle_calls=*/true);
    for (const TestBucket& b : buckets) Send(b);
    driver_->EndPublication();
    return driver_->WaitIdle(absl::Now() + absl::Seconds(20));
  }

  VllmDriver& driver() { return *driver_; }
  // What the publisher reads of the engines' versions (GET /weight_info).
  std::vector<uint64_t> WeightVersions() const {
    return rollout::VllmFamily({}).WeightVersions(driver_->engines(), absl::Seconds(5));
  }
  VllmEngine& engine(size_t i) { return *engines_[i]; }
  void ResetWire(size_t i) { wires_[i]->Reset(); }
  WireDataPath& path(size_t i) { return *paths_[i]; }
  size_t size() const { return engines_.size(); }

 private:
  std::vector<std::shared_ptr<Wire>> wires_;
  std::vector<WireDataPath*> paths_;
  std::vector<std::unique_ptr<VllmEngine>> engines_;
  std::unique_ptr<VllmDriver> driver_;
};

// Every tensor of `buckets` is held by the engine with its bytes, dtype and vLLM's shape.
void ExpectHolds(const VllmEngineState& s, const std::vector<TestBucket>& buckets) {
  size_t n = 0;
  for (const TestBucket& b : buckets) {
    for (const transport::ManifestTensor& t : b.manifest.tensors) {
      ++n;
      auto it = s.weights.find(t.name);
      ASSERT_NE(it, s.weights.end()) << t.name;
      EXPECT_EQ(it->second.first.dtype, t.dtype) << t.name;
      EXPECT_EQ(it->second.first.shape, t.shape.empty() ? Shape{1} : t.shape) << t.name;
      EXPECT_EQ(it->second.second, std::vector<uint8_t>(b.bytes.begin() + t.offset,
                                                        b.bytes.begin() + t.offset + t.nbytes))
          << t.name;
    }
  }
  EXPECT_EQ(s.weights.size(), n);
}

std::vector<TestBucket> Version(uint32_t seed) {
  return {MakeBucket(0, 0, seed), MakeBucket(1, 1, seed + 1), MakeBucket(2, 2, seed + 2)};
}

TEST(VllmEngine, ThreeVersionsArriveByteForByteAtBothPackingPlacements) {
  Harness h({true, false});
  ASSERT_TRUE(h.Join().ok());
  EXPECT_EQ(h.path(0).joins_.size(), 1u);
  EXPECT_TRUE(h.path(0).joins_[0].packed);
  EXPECT_EQ(h.path(0).joins_[0].packed_buffer_size_bytes, kChunkLimit);
  EXPECT_EQ(h.path(0).joins_[0].rank_offset, 1);
  EXPECT_EQ(h.path(1).joins_[0].rank_offset, 2);
  EXPECT_EQ(h.path(1).joins_[0].world_size, 3);
  EXPECT_EQ(h.path(1).joins_[0].master_port, 29511);
  // The buckets span several chunks of the limit.
  ASSERT_GT(h.driver().BroadcastChunks(Version(1)[0].manifest).size(), 1u);
  for (uint64_t v = 1; v <= 3; ++v) {
    const std::vector<TestBucket> buckets = Version(static_cast<uint32_t>(v * 10));
    ASSERT_TRUE(h.Publish(v, buckets).ok()) << "version " << v;
    for (size_t e = 0; e < h.size(); ++e) {
      const VllmEngineState s = h.engine(e).state();
      EXPECT_EQ(s.weight_version, std::to_string(v));
      EXPECT_FALSE(s.mixed);
      EXPECT_FALSE(s.paused);
      EXPECT_EQ(s.pause_mode, "abort");  // the default policy, abort:flush
      EXPECT_TRUE(s.pause_clear_cache);
      EXPECT_EQ(s.updates, 3u);
      ExpectHolds(s, buckets);
    }
  }
  const std::vector<std::string> publication = {"POST /pause?mode=abort",
                                                "POST /start_weight_update",
                                                "POST /update_weights",
                                                "POST /update_weights",
                                                "POST /update_weights",
                                                "POST /finish_weight_update",
                                                "POST /resume"};
  std::vector<std::string> want = {"POST /init_weight_transfer_engine"};
  for (int v = 0; v < 3; ++v) want.insert(want.end(), publication.begin(), publication.end());
  EXPECT_EQ(h.engine(0).state().calls, want);
  // The older release refused the packing at init once, then took it per update.
  want.insert(want.begin(), "POST /init_weight_transfer_engine");
  EXPECT_EQ(h.engine(1).state().calls, want);
  httplib::Client c(h.engine(0).url());
  auto info = c.Get("/weight_info");
  ASSERT_TRUE(info);
  EXPECT_EQ(json::parse(info->body)["weight_version"], "3");
  EXPECT_EQ(h.WeightVersions(), std::vector<uint64_t>({3, 3}));
}

TEST(VllmEngine, AnAbortBeforeAnyBucketResumesEveryEngineUnchanged) {
  Harness h({true, true});
  ASSERT_TRUE(h.Join().ok());
  const std::vector<TestBucket> v1 = Version(1);
  ASSERT_TRUE(h.Publish(1, v1).ok());
  h.driver().BeginPublication(2, true);
  const std::vector<bool> dirty = h.driver().ResumeAfterAbort();
  absl::Status idle = h.driver().WaitIdle(absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(idle.ok()) << idle;
  EXPECT_EQ(dirty, std::vector<bool>({false, false}));
  for (size_t e = 0; e < h.size(); ++e) {
    const VllmEngineState s = h.engine(e).state();
    EXPECT_FALSE(s.paused);
    EXPECT_FALSE(s.mixed);
    EXPECT_FALSE(s.updating);
    EXPECT_EQ(s.weight_version, "1");
    ExpectHolds(s, v1);
  }
}

TEST(VllmEngine, AnAbortAfterABucketLeavesTheEnginesPausedUntilAWholeVersion) {
  Harness h({true, false});
  ASSERT_TRUE(h.Join().ok());
  ASSERT_TRUE(h.Publish(1, Version(1)).ok());
  h.driver().BeginPublication(2, true);
  const std::vector<TestBucket> v2 = Version(20);
  h.Send(v2[0]);
  ASSERT_TRUE(h.driver().WaitIdle(absl::Now() + absl::Seconds(20)).ok());
  const std::vector<bool> dirty = h.driver().ResumeAfterAbort();
  ASSERT_TRUE(h.driver().WaitIdle(absl::Now() + absl::Seconds(20)).ok());
  EXPECT_EQ(dirty, std::vector<bool>({true, true}));
  httplib::Client c(h.engine(1).url());
  for (size_t e = 0; e < h.size(); ++e) {
    const VllmEngineState s = h.engine(e).state();
    EXPECT_TRUE(s.paused) << "a dirty engine was resumed";
    EXPECT_TRUE(s.mixed);
    EXPECT_EQ(s.calls.back(), "POST /finish_weight_update");
  }
  auto info = c.Get("/weight_info");
  ASSERT_TRUE(info);
  // vLLM's version changes only with a finish that names one: the engines still report 1.
  EXPECT_EQ(json::parse(info->body)["weight_version"], "1") << info->body;
  EXPECT_EQ(h.WeightVersions(), std::vector<uint64_t>({1, 1}));
  // The next complete version heals them.
  const std::vector<TestBucket> v3 = Version(30);
  ASSERT_TRUE(h.Publish(3, v3).ok());
  for (size_t e = 0; e < h.size(); ++e) {
    const VllmEngineState s = h.engine(e).state();
    EXPECT_FALSE(s.paused);
    EXPECT_FALSE(s.mixed);
    EXPECT_EQ(s.weight_version, "3");
    ExpectHolds(s, v3);
  }
}

// A loader failure on one engine at bucket 1 of 3 (vLLM answers 500 and its worker leaves the
// update): the publication fails at once naming the engine, route and status; the abort
// finishes the update wherever one is open (the failed engine refuses the finish: its worker
// already left it) and resumes nobody that holds part of the version; the retry after the group
// re-forms (a new init) commits everywhere and resumes every engine; the next version commits
// with no trace of the first one's error.
TEST(VllmEngine, ALoaderFailureAbortsAtOnceAndTheRetryAndNextVersionCommit) {
  Harness h({true, true});
  ASSERT_TRUE(h.Join().ok());
  ASSERT_TRUE(h.Publish(1, Version(1)).ok());
  h.engine(0).FailUpdateAt(1);
  const std::vector<TestBucket> v2 = Version(20);
  h.driver().BeginPublication(2, true);
  for (const TestBucket& b : v2) h.Send(b);
  const absl::Time t0 = absl::Now();
  absl::Status failed = h.driver().WaitIdle(absl::Now() + absl::Seconds(20));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << "a refusal must cost seconds, not the deadline";
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find(h.engine(0).url()), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("POST /update_weights: HTTP 500"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("(injected)"), std::string::npos) << failed;
  const std::vector<bool> dirty = h.driver().ResumeAfterAbort();
  (void)h.driver().WaitIdle(absl::Now() + absl::Seconds(20));
  EXPECT_EQ(dirty, std::vector<bool>({true, true}));
  for (size_t e = 0; e < h.size(); ++e) {
    const VllmEngineState s = h.engine(e).state();
    EXPECT_TRUE(s.paused) << e;
    EXPECT_FALSE(s.updating) << e;  // no update left open anywhere
    EXPECT_TRUE(s.mixed) << e;
    EXPECT_EQ(s.calls.back(), "POST /finish_weight_update") << e;
  }
  // The retry: the group re-forms (a new communicator: every engine joins again).
  for (size_t e = 0; e < h.size(); ++e) h.ResetWire(e);
  ASSERT_TRUE(h.Join().ok());
  absl::Status retried = h.Publish(2, v2);
  ASSERT_TRUE(retried.ok()) << retried;
  for (size_t e = 0; e < h.size(); ++e) {
    const VllmEngineState s = h.engine(e).state();
    EXPECT_FALSE(s.paused) << e << ": never resumed";
    EXPECT_FALSE(s.mixed) << e;
    EXPECT_EQ(s.weight_version, "2");
    EXPECT_EQ(s.calls.back(), "POST /resume") << e;
    ExpectHolds(s, v2);
  }
  const std::vector<TestBucket> v3 = Version(30);
  absl::Status next = h.Publish(3, v3);
  ASSERT_TRUE(next.ok()) << next;
  for (const EngineOutcome& o : h.driver().outcomes()) {
    EXPECT_FALSE(o.failed) << o.error;
    EXPECT_TRUE(o.error.empty()) << o.error;
  }
  for (size_t e = 0; e < h.size(); ++e) ExpectHolds(h.engine(e).state(), v3);
  EXPECT_EQ(h.WeightVersions(), std::vector<uint64_t>({3, 3}));
}

TEST(VllmEngine, AFailedReceiveFailsThePublicationNamingTheEngine) {
  Harness h({true});
  ASSERT_TRUE(h.Join().ok());
  h.driver().BeginPublication(1, true);
  TestBucket b = MakeBucket(0, 0, 5);
  b.bytes.pop_back();  // the broadcast's last chunk is a byte short of what the request declares
  h.Send(b);
  absl::Status s = h.driver().WaitIdle(absl::Now() + absl::Seconds(20));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(h.engine(0).url()), std::string::npos) << s;
  EXPECT_NE(s.message().find("POST /update_weights: HTTP 500"), std::string::npos) << s;
  EXPECT_NE(s.message().find("bytes broadcast"), std::string::npos) << s;
  EXPECT_TRUE(h.driver().any_failed());
  const VllmEngineState st = h.engine(0).state();
  EXPECT_FALSE(st.joined);  // a failed receive leaves the group
  EXPECT_TRUE(st.weights.empty());
}

// The engine's refusals, in vLLM's error shape.
TEST(VllmEngine, RefusesBadBodiesAndOrderWithVllmsErrorShape) {
  auto wire = std::make_shared<Wire>();
  auto e = VllmEngine::Start({}, std::make_unique<WireDataPath>(wire));
  ASSERT_TRUE(e.ok());
  httplib::Client c((*e)->url());
  auto post = [&](const std::string& path, const std::string& body) {
    auto r = c.Post(path, body, "application/json");
    EXPECT_TRUE(r) << path;
    return std::make_pair(r ? r->status : 0, r ? json::parse(r->body, nullptr, false) : json());
  };
  auto error = [](const std::pair<int, json>& r) {
    return r.second.is_object() && r.second.contains("error")
               ? r.second["error"]["message"].get<std::string>()
               : std::string("(no error)");
  };
  // Order (the worker's checks: HTTP 500, as every worker error reaches the caller).
  auto r = post("/start_weight_update", "{}");
  EXPECT_EQ(r.first, 500);
  EXPECT_NE(error(r).find("init_weight_transfer_engine first"), std::string::npos) << error(r);
  EXPECT_EQ(r.second["error"]["type"], "InternalServerError");
  const std::string init =
      R"({"init_info":{"master_address":"127.0.0.1","master_port":29500,"rank_offset":1,)"
      R"("world_size":2,"packed":true,"packed_buffer_size_bytes":4096,"packed_num_buffers":2}})";
  EXPECT_EQ(post("/init_weight_transfer_engine", init).first, 200);
  const std::string update =
      R"({"update_info":{"names":["a"],"dtype_names":["bfloat16"],"shapes":[[2,2]]}})";
  r = post("/update_weights", update);
  EXPECT_EQ(r.first, 500);
  EXPECT_NE(error(r).find("start_weight_update must be called before update_weights"),
            std::string::npos)
      << error(r);
  r = post("/finish_weight_update", "{}");
  EXPECT_EQ(r.first, 500);
  EXPECT_NE(error(r).find("without a matching start_weight_update"), std::string::npos) << error(r);
  EXPECT_EQ(post("/start_weight_update", "").first, 200);
  r = post("/start_weight_update", "{}");
  EXPECT_EQ(r.first, 500);
  EXPECT_NE(error(r).find("already active"), std::string::npos) << error(r);
  // The API process's own checks of a body: 400.
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {"not json", "Invalid JSON format"},
           {R"({"names":["a"]})", "Missing 'update_info' in request body"}}) {
    r = post("/update_weights", body);
    EXPECT_EQ(r.first, 400) << body;
    EXPECT_NE(error(r).find(want), std::string::npos) << body << " -> " << error(r);
    EXPECT_EQ(r.second["error"]["code"], 400);
  }
  // What the worker refuses in update_info: 500, and the worker leaves the update (a finish is
  // then refused, a new start taken).
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"update_info":[]})", "update_info must be an object"},
      {R"({"update_info":{"names":["a","b"],"dtype_names":["bfloat16"],"shapes":[[1]]}})",
       "different lengths"},
      {R"({"update_info":{"names":["w"],"dtype_names":["complex32"],"shapes":[[1]]}})",
       "dtype_names[0] of 'w'"},
      {R"({"update_info":{"names":["w"],"dtype_names":["uint8"],"shapes":[[-1]]}})",
       "shapes[0] of 'w'"},
      {R"({"update_info":{"names":["w"],"dtype_names":["uint8"],"shapes":[[4294967296,4294967296]]}})",
       "oversized"},
      {R"({"update_info":{"names":[7],"dtype_names":["uint8"],"shapes":[[1]]}})",
       "names[0] is not a string"},
      {R"({"update_info":{"names":["w"],"dtype_names":["uint8"],"shapes":[[1]],"packed":true}})",
       "set at init_weight_transfer_engine"},
  };
  for (const auto& [body, want] : bad) {
    r = post("/update_weights", body);
    EXPECT_EQ(r.first, 500) << body;
    EXPECT_NE(error(r).find(want), std::string::npos) << body << " -> " << error(r);
    EXPECT_NE(error(r).find("Worker failed with error"), std::string::npos) << error(r);
    EXPECT_EQ(r.second["error"]["code"], 500);
    EXPECT_EQ(post("/finish_weight_update", "{}").first, 500) << "the update ended with " << body;
    EXPECT_EQ(post("/start_weight_update", "{}").first, 200);
  }
  r = post("/pause?mode=sometimes", "");
  EXPECT_EQ(r.first, 400);
  EXPECT_NE(error(r).find("query.mode"), std::string::npos) << error(r);
  r = post("/pause?mode=keep&clear_cache=maybe", "");
  EXPECT_EQ(r.first, 400);
  EXPECT_NE(error(r).find("query.clear_cache"), std::string::npos) << error(r);
  r = post("/pause?mode=keep&clear_cache=false", "");
  EXPECT_EQ(r.first, 200);
  EXPECT_EQ((*e)->state().pause_mode, "keep");
  EXPECT_FALSE((*e)->state().pause_clear_cache);
  r = post("/finish_weight_update", R"({"weight_version":7})");
  EXPECT_EQ(r.first, 400);
  EXPECT_NE(error(r).find("weight_version must be a string"), std::string::npos) << error(r);
  EXPECT_EQ(post("/finish_weight_update", "{}").first, 200);
  EXPECT_EQ((*e)->state().weights.size(), 0u);  // refused updates stage nothing
  // Init fields: parsed by the worker (500); a missing init_info is the router's (400).
  for (const std::string& body :
       {std::string(R"({"init_info":{"master_port":1,"rank_offset":1,"world_size":2}})"),
        std::string(R"({"init_info":{"master_address":"h","master_port":1,"rank_offset":2,)"
                    R"("world_size":2}})"),
        std::string(R"({"init_info":{"master_address":"h","master_port":70000,"rank_offset":1,)"
                    R"("world_size":2}})")}) {
    r = post("/init_weight_transfer_engine", body);
    EXPECT_EQ(r.first, 500) << body;
    EXPECT_NE(error(r).find("init_info"), std::string::npos) << error(r);
  }
  r = post("/init_weight_transfer_engine", "{}");
  EXPECT_EQ(r.first, 400);
  EXPECT_NE(error(r).find("Missing 'init_info'"), std::string::npos) << error(r);
  // Every POST route answers another method 405, as FastAPI does (a publisher's probe).
  for (const char* path : {"/init_weight_transfer_engine", "/start_weight_update",
                           "/update_weights", "/finish_weight_update", "/pause", "/resume"}) {
    auto g = c.Get(path);
    ASSERT_TRUE(g) << path;
    EXPECT_EQ(g->status, 405) << path;
  }
  EXPECT_EQ(c.Get("/no_such_route")->status, 404);
  // So the join's probe takes it, reading its release from /version, and changes nothing.
  const size_t calls = (*e)->state().calls.size();
  const auto profile =
      rollout::VllmFamily({}).Profile({{(*e)->url(), 1, "vllm", ""}}, absl::Seconds(2));
  ASSERT_TRUE(profile[0].ok()) << profile[0].status();
  EXPECT_EQ(profile[0]->release, "wpub-recv");
  EXPECT_EQ((*e)->state().calls.size(), calls);
  // An older release refuses the packing at init with the message the driver falls back on.
  auto old = VllmEngine::Start({.packing_in_init = false},
                               std::make_unique<WireDataPath>(std::make_shared<Wire>()));
  ASSERT_TRUE(old.ok());
  httplib::Client oc((*old)->url());
  auto refused = oc.Post("/init_weight_transfer_engine", init, "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 500);  // the worker's ValueError, as vLLM answers it
  EXPECT_NE(refused->body.find("Invalid init_info"), std::string::npos) << refused->body;
}

// An engine started with another weight-transfer backend than its kind speaks is refused at
// the join's probe, before any engine is paused: vLLM's sparse backend (its patches carry
// floating-point elements only, so no NVFP4 codes can reach it) and an NCCL engine declared as
// colocated, or the reverse. The backend is read from the dev-mode /server_info; an engine whose
// /server_info says nothing (an older release) is taken. The sparse engine itself refuses the
// dense update body as its dataclass does.
TEST(VllmEngine, TheJoinRefusesAnEngineStartedWithAnotherWeightTransferBackend) {
  auto sparse = VllmEngine::Start({.weight_transfer_backend = "sparse_nccl"},
                                  std::make_unique<WireDataPath>(std::make_shared<Wire>()));
  auto nccl = VllmEngine::Start({}, std::make_unique<WireDataPath>(std::make_shared<Wire>()));
  ASSERT_TRUE(sparse.ok() && nccl.ok());
  httplib::Client c((*sparse)->url());
  auto info = c.Get("/server_info?config_format=json");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->status, 200);
  EXPECT_EQ(json::parse(info->body)["vllm_config"]["weight_transfer_config"]["backend"],
            "sparse_nccl");
  auto text = c.Get("/server_info");
  ASSERT_TRUE(text);
  EXPECT_TRUE(json::parse(text->body)["vllm_config"].is_string()) << text->body;
  auto bad = c.Get("/server_info?config_format=yaml");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);

  const size_t calls = (*sparse)->state().calls.size();
  auto refused =
      rollout::VllmFamily({}).Profile({{(*sparse)->url(), 1, "vllm", ""}}, absl::Seconds(2));
  ASSERT_FALSE(refused[0].ok());
  EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kFailedPrecondition);
  for (const std::string& want : {(*sparse)->url(), std::string("\"sparse_nccl\""),
                                  std::string("floating-point"), std::string("whole versions")}) {
    EXPECT_NE(refused[0].status().message().find(want), std::string::npos) << refused[0].status();
  }
  EXPECT_EQ((*sparse)->state().calls.size(), calls);  // the probe only read
  // The NCCL engine joins as `vllm` and is refused as `vllm-ipc`.
  auto taken = rollout::VllmFamily({}).Profile({{(*nccl)->url(), 1, "vllm", ""}}, absl::Seconds(2));
  EXPECT_TRUE(taken[0].ok()) << taken[0].status();
  rollout::VllmFamilyOptions colocated;
  colocated.driver.colocated = true;
  auto wrong = rollout::VllmFamily(colocated).Profile({{(*nccl)->url(), 1, "vllm-ipc", ""}},
                                                      absl::Seconds(2));
  ASSERT_FALSE(wrong[0].ok());
  EXPECT_NE(wrong[0].status().message().find(R"('{"backend":"ipc"}')"), std::string::npos)
      << wrong[0].status();
  EXPECT_NE(wrong[0].status().message().find("vllm+http://"), std::string::npos)
      << wrong[0].status();
  // An engine started without --weight-transfer-config (the config's null) is refused as such.
  auto none = VllmEngine::Start({.weight_transfer_backend = ""},
                                std::make_unique<WireDataPath>(std::make_shared<Wire>()));
  ASSERT_TRUE(none.ok());
  auto unconfigured =
      rollout::VllmFamily({}).Profile({{(*none)->url(), 1, "vllm", ""}}, absl::Seconds(2));
  ASSERT_FALSE(unconfigured[0].ok());
  EXPECT_NE(unconfigured[0].status().message().find("without --weight-transfer-config"),
            std::string::npos)
      << unconfigured[0].status();
  httplib::Client nc((*none)->url());
  auto refused_init = nc.Post("/init_weight_transfer_engine",
                              R"({"init_info":{"master_address":"127.0.0.1","master_port":29500,)"
                              R"("rank_offset":1,"world_size":2}})",
                              "application/json");
  ASSERT_TRUE(refused_init);
  EXPECT_EQ(refused_init->status, 500);
  EXPECT_NE(refused_init->body.find("Weight transfer not configured"), std::string::npos)
      << refused_init->body;

  // The sparse engine's own answer to a dense update: the dataclass's TypeError as a ValueError.
  auto post = [&](const std::string& path, const std::string& body) {
    auto r = c.Post(path, body, "application/json");
    EXPECT_TRUE(r) << path;
    return std::make_pair(r ? r->status : 0, r ? r->body : std::string());
  };
  EXPECT_EQ(post("/init_weight_transfer_engine",
                 R"({"init_info":{"master_address":"127.0.0.1","master_port":29500,)"
                 R"("rank_offset":1,"world_size":2}})")
                .first,
            200);
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"update_info":{"names":["a"],"dtype_names":["uint8"],"shapes":[[2,2]]}})",
            "missing 1 required positional argument: 'num_updates_list'"},
           {R"({"update_info":{"names":["a"],"dtype_names":["uint8"],"shapes":[[2,2]],)"
            R"("packed":true}})",
            "unexpected keyword argument 'packed'"}}) {
    EXPECT_EQ(post("/start_weight_update", "{}").first, 200);
    auto r = post("/update_weights", body);
    EXPECT_EQ(r.first, 500) << body;
    EXPECT_NE(r.second.find("Invalid update_info for SparseNCCLWeightTransferEngine: "),
              std::string::npos)
        << r.second;
    EXPECT_NE(r.second.find(want), std::string::npos) << r.second;
  }
}

// A publisher keeps up to 8 request lanes open for a whole publication, beside probes: every
// kept-alive connection holds a server thread until it idles out (5 s), so the engine must
// serve more connections at once than that. Twelve clients each keep their connection; every
// one is answered within its 2 s read timeout, while the earlier ones still hold theirs.
TEST(VllmEngine, ServesMoreKeptAliveConnectionsThanAPublisherOpens) {
  auto wire = std::make_shared<Wire>();
  auto e = VllmEngine::Start({}, std::make_unique<WireDataPath>(wire));
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<std::unique_ptr<httplib::Client>> clients;
  for (int i = 0; i < 12; ++i) {
    clients.push_back(std::make_unique<httplib::Client>("127.0.0.1", (*e)->port()));
    clients.back()->set_keep_alive(true);
    clients.back()->set_read_timeout(2, 0);
    httplib::Result r = clients.back()->Get("/health");
    ASSERT_TRUE(r) << "connection " << i << ": " << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200) << "connection " << i;
  }
  for (auto& c : clients) {  // each still holds its connection: a second request on it
    httplib::Result r = c->Get("/health");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
  }
}

// A second engine on a port the first listens on is refused (cpp-httplib's default SO_REUSEPORT
// would have let it answer half of a publisher's connections).
TEST(VllmEngine, SecondEngineOnTheSamePortIsRefused) {
  auto wire = std::make_shared<Wire>();
  auto first = VllmEngine::Start({}, std::make_unique<WireDataPath>(wire));
  ASSERT_TRUE(first.ok()) << first.status();
  VllmEngineOptions o;
  o.port = (*first)->port();
  auto second = VllmEngine::Start(o, std::make_unique<WireDataPath>(wire));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_NE(second.status().message().find(absl::StrCat("cannot listen on 127.0.0.1:", o.port)),
            std::string::npos)
      << second.status();
  httplib::Client c("127.0.0.1", (*first)->port());
  httplib::Result r = c.Get("/health");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
}

TEST(VllmEngine, ChunksCloseAfterTheTensorThatPassesTheLimit) {
  const std::vector<uint64_t> sizes = {3000, 2000, 100, 5000, 10};
  EXPECT_EQ(VllmChunks(sizes, 4096), (std::vector<uint64_t>{5000, 5100, 10}));
  EXPECT_EQ(VllmChunks(sizes, 1 << 20), (std::vector<uint64_t>{10110}));
  EXPECT_EQ(VllmChunks({}, 4096), (std::vector<uint64_t>{0}));
  // The engine's rule and the driver's agree on every bucket of a version.
  for (const TestBucket& b : Version(3)) {
    std::vector<uint64_t> s;
    for (const auto& t : b.manifest.tensors) s.push_back(t.nbytes);
    EXPECT_EQ(VllmChunks(s, kChunkLimit), rollout::VllmPackedChunks(b.manifest, kChunkLimit));
  }
}

// Python's pickle.dumps of vLLM's ctypes ncclUniqueId (internal[i] = (i*37+11)%256-128, signed
// c_byte), protocols 3, 4 and 5 (the class's module is vllm's pynccl_wrapper).
constexpr const char* kPythonPickles[] = {
    "8003635f6374797065730a5f756e7069636b6c650a710063766c6c6d2e64697374726962757465642e64657669"
    "63655f636f6d6d756e696361746f72732e70796e63636c5f777261707065720a6e63636c556e6971756549640a"
    "71017d710243808bb0d5fa1f44698eb3d8fd22476c91b6db00254a6f94b9de03284d7297bce1062b50759abfe4"
    "092e53789dc2e70c31567ba0c5ea0f34597ea3c8ed12375c81a6cbf0153a5f84a9cef3183d6287acd1f61b4065"
    "8aafd4f91e43688db2d7fc21466b90b5daff24496e93b8dd02274c7196bbe0052a4f7499bee3082d52779cc1e6"
    "71038671048671055271062e",
    "800495ec000000000000008c075f637479706573948c095f756e7069636b6c659493948c34766c6c6d2e646973"
    "74726962757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f7772617070657294"
    "8c0c6e63636c556e6971756549649493947d9443808bb0d5fa1f44698eb3d8fd22476c91b6db00254a6f94b9de"
    "03284d7297bce1062b50759abfe4092e53789dc2e70c31567ba0c5ea0f34597ea3c8ed12375c81a6cbf0153a5f"
    "84a9cef3183d6287acd1f61b40658aafd4f91e43688db2d7fc21466b90b5daff24496e93b8dd02274c7196bbe0"
    "052a4f7499bee3082d52779cc1e6948694869452942e",
    "800595ec000000000000008c075f637479706573948c095f756e7069636b6c659493948c34766c6c6d2e646973"
    "74726962757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f7772617070657294"
    "8c0c6e63636c556e6971756549649493947d9443808bb0d5fa1f44698eb3d8fd22476c91b6db00254a6f94b9de"
    "03284d7297bce1062b50759abfe4092e53789dc2e70c31567ba0c5ea0f34597ea3c8ed12375c81a6cbf0153a5f"
    "84a9cef3183d6287acd1f61b40658aafd4f91e43688db2d7fc21466b90b5daff24496e93b8dd02274c7196bbe0"
    "052a4f7499bee3082d52779cc1e6948694869452942e",
};

TEST(VllmUniqueIdPickle, ReadsTheDriversPickleAndPythons) {
  std::vector<uint8_t> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>((i * 37 + 11 + 128) % 256);
  absl::StatusOr<std::vector<uint8_t>> ours =
      DecodeVllmUniqueIdPickle(rollout::VllmUniqueIdPickle(id));
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_EQ(*ours, id);
  for (const char* hex : kPythonPickles) {
    absl::StatusOr<std::vector<uint8_t>> theirs =
        DecodeVllmUniqueIdPickle(absl::HexStringToBytes(hex));
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    EXPECT_EQ(*theirs, id);
  }
}

TEST(VllmUniqueIdPickle, RefusesWhatIsNotVllmsStruct) {
  const std::string good = rollout::VllmUniqueIdPickle(std::vector<uint8_t>(128, 7));
  std::string other_class = good;
  other_class.replace(other_class.find("ncclUniqueId"), 12, "os_system___");
  std::string short_id = rollout::VllmUniqueIdPickle(std::vector<uint8_t>(64, 7));
  std::string two = good;
  two.insert(two.size() - 4, std::string("C\x02xy", 4));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {good.substr(0, good.size() - 1), "no STOP"},
      {good.substr(0, 80), "truncated"},
      {other_class, "no such class"},
      {short_id, "not one of 128"},
      {two, "2 bytes objects"},
      {std::string("\x80\x02.", 3), "protocol 2"},
      {std::string("\x80\x04i", 3), "opcode 0x69"},  // INST: never in a ctypes pickle
      {good + "x", "bytes after STOP"},
  };
  for (const auto& [pickle, want] : cases) {
    absl::Status s = DecodeVllmUniqueIdPickle(pickle).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << want << ": " << s;
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s;
  }
}

}  // namespace
}  // namespace wpub::recv
