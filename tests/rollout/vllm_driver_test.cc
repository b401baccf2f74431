// vLLM driver tests against httplib servers that play vLLM's weight-transfer routes (v0.22+,
// both packing placements): the engine list syntax (vllm+http://), every route, body and order of
// a publication, the init retried without packing fields for releases that take them per update,
// the packed chunk rule, the pickled unique id, refusals (404 on an old or non-dev-mode vLLM, an
// error answer, a timeout) as errors naming the engine and route, and the abort path (finish on
// every engine, resume only the clean ones).
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <thread>

#include "core/rollout/vllm_driver.h"
#include "nlohmann/json.hpp"
#include "tests/rollout/fake_http.h"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

// A fake vLLM server. `release`: "main" takes the packing fields in init_info, "v0.25" refuses
// them there (400 "Invalid init_info") and takes them per update, "v0.25-500" refuses them with
// HTTP 500 (the worker's ValueError from WeightTransferEngine.parse_init_info in
// vllm/distributed/weight_transfer/base.py, "Invalid init_info for <engine>: __init__() got an
// unexpected keyword argument 'packed'", surfacing as an internal error through collective_rpc;
// the 500 mapping as observed against released engines, commit not pinned), "v0.20" has no
// /start_weight_update, "nodev" has no weight-transfer routes at all.
class FakeVllm {
 public:
  explicit FakeVllm(std::string release = "main") : release_(std::move(release)) {
    auto handle = [this](const httplib::Request& req, httplib::Response& res) {
      std::string path = req.path;
      std::lock_guard lock(mu_);
      std::string call = path;
      if (req.has_param("mode")) call += "?mode=" + req.get_param_value("mode");
      if (req.has_param("clear_cache"))
        call += "&clear_cache=" + req.get_param_value("clear_cache");
      calls_.push_back(call);
      bodies_.push_back(req.body);
      const bool dev = release_ != "nodev";
      if (!dev || (release_ == "v0.20" &&
                   (path == "/start_weight_update" || path == "/finish_weight_update"))) {
        res.status = 404;
        res.set_content(R"({"detail":"Not Found"})", "application/json");
        return;
      }
      if (path == "/init_weight_transfer_engine") {
        json j = json::parse(req.body, nullptr, false);
        const bool packing = j.is_object() && j["init_info"].contains("packed");
        if (packing && release_ == "v0.25") {
          res.status = 400;
          res.set_content(
              R"({"error":{"message":"Invalid init_info: unexpected keyword argument 'packed'","type":"BadRequestError","code":400}})",
              "application/json");
          return;
        }
        if (packing && release_ == "v0.25-500") {
          res.status = 500;
          res.set_content(
              R"({"error":{"message":"Invalid init_info for NCCLWeightTransferEngine: __init__() got an unexpected keyword argument 'packed'","type":"InternalServerError","code":500}})",
              "application/json");
          return;
        }
      }
      if (path == fail_path_) {
        res.status = 500;
        res.set_content(
            R"({"error":{"message":"CUDA error: an illegal memory access","code":500}})",
            "application/json");
        return;
      }
      res.set_content(R"({"message":"ok"})", "application/json");
    };
    http_.server().Post(R"(/.*)", handle);
    http_.server().Get(R"(/.*)", handle);
    http_.Start();
  }
  ~FakeVllm() { http_.Stop(); }
  std::string url() const { return http_.url(); }
  std::vector<std::string> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  std::vector<std::string> bodies() const {
    std::lock_guard lock(mu_);
    return bodies_;
  }
  void FailOn(const std::string& path) {
    std::lock_guard lock(mu_);
    fail_path_ = path;
  }

 private:
  const std::string release_;
  mutable std::mutex mu_;
  std::vector<std::string> calls_, bodies_;
  std::string fail_path_;
  testing::LocalHttpServer http_;
};

transport::BucketManifest Bucket(uint32_t index) {
  transport::BucketManifest b;
  b.index = index;
  // The planner's layout: back to back, largest element size first.
  b.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight_scale_2", DType::kFloat32, {}, 0, 4});
  b.tensors.push_back(
      {"model.layers.0.self_attn.o_proj.weight", DType::kBFloat16, {64, 64}, 4, 64 * 64 * 2});
  b.tensors.push_back({"model.layers.0.mlp.experts.0.down_proj.weight",
                       DType::kUInt8,
                       {64, 32},
                       4 + 8192,
                       64 * 32});
  b.tensors.push_back({"model.layers.0.mlp.experts.0.down_proj.weight_scale",
                       DType::kFloat8E4M3,
                       {64, 4},
                       4 + 8192 + 2048,
                       256});
  b.nbytes = 4 + 8192 + 2048 + 256;
  return b;
}

VllmDriverOptions Options(const std::vector<FakeVllm*>& engines, std::vector<int> gpus) {
  VllmDriverOptions o;
  for (size_t i = 0; i < engines.size(); ++i) {
    o.engines.push_back({engines[i]->url(), gpus[i], "vllm"});
  }
  o.master_address = "10.0.0.7";
  o.master_port = 29500;
  o.packed_buffer_bytes = 1 << 20;
  o.request_timeout = absl::Seconds(5);
  return o;
}

TEST(VllmDriver, EngineListNamesTheFamilyByScheme) {
  absl::StatusOr<std::vector<EngineSpec>> s =
      ParseEngineSpecs("vllm+http://a:8000=2, http://b:30000,sglang+https://c:1");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->size(), 3u);
  EXPECT_EQ((*s)[0].url, "http://a:8000");
  EXPECT_EQ((*s)[0].family, "vllm");
  EXPECT_EQ((*s)[0].gpus, 2);
  EXPECT_EQ((*s)[1].family, "sglang");
  EXPECT_EQ((*s)[2].url, "https://c:1");
  EXPECT_EQ((*s)[2].family, "sglang");
  absl::Status bad = ParseEngineSpecs("trt+http://x:1").status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad));
  EXPECT_NE(bad.message().find("trt+"), std::string::npos) << bad;
}

TEST(VllmDriver, JoinAndPublicationInOrderWithTheirBodies) {
  FakeVllm a, b;
  auto d = VllmDriver::Create(Options({&a, &b}, {1, 2}));
  ASSERT_TRUE(d.ok()) << d.status();
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  json ia = json::parse(a.bodies()[0])["init_info"], ib = json::parse(b.bodies()[0])["init_info"];
  EXPECT_EQ(ia["master_address"], "10.0.0.7");
  EXPECT_EQ(ia["master_port"], 29500);
  EXPECT_EQ(ia["rank_offset"], 1);
  EXPECT_EQ(ib["rank_offset"], 2);
  EXPECT_EQ(ia["world_size"], 4);
  EXPECT_EQ(ia["packed"], true);
  EXPECT_EQ(ia["packed_buffer_size_bytes"], 1 << 20);
  EXPECT_EQ(ia["packed_num_buffers"], 2);

  (*d)->BeginPublication(7, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->PostBucket(Bucket(1));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> want = {"/init_weight_transfer_engine",
                                         "/pause?mode=abort&clear_cache=true",
                                         "/start_weight_update",
                                         "/update_weights",
                                         "/update_weights",
                                         "/finish_weight_update",
                                         "/resume"};
  EXPECT_EQ(a.calls(), want);
  EXPECT_EQ(b.calls(), want);
  EXPECT_EQ(a.bodies()[2], "{}");
  json u = json::parse(a.bodies()[3])["update_info"];
  EXPECT_EQ(u["names"][1], "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(u["dtype_names"], json({"float32", "bfloat16", "uint8", "float8_e4m3fn"}));
  EXPECT_EQ(u["shapes"][0], json({1}));  // a 0-d scale is declared [1]
  EXPECT_EQ(u["shapes"][3], json({64, 4}));
  EXPECT_FALSE(u.contains("packed"));  // this release takes packing at init
  EXPECT_EQ(json::parse(a.bodies()[5])["weight_version"], "7");
  for (const EngineOutcome& o : (*d)->outcomes()) {
    EXPECT_FALSE(o.failed) << o.error;
    EXPECT_EQ(o.updates_sent, 2u);
  }
}

TEST(VllmDriver, AnOlderReleaseTakesThePackingFieldsPerUpdate) {
  for (const char* release : {"v0.25", "v0.25-500"}) {
    SCOPED_TRACE(release);
    FakeVllm old(release);
    auto d = VllmDriver::Create(Options({&old}, {1}));
    ASSERT_TRUE(d.ok());
    (*d)->StartJoin();
    ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
    // Asked twice: with the packing fields (refused), then without.
    EXPECT_EQ(old.calls(), (std::vector<std::string>{"/init_weight_transfer_engine",
                                                     "/init_weight_transfer_engine"}));
    EXPECT_FALSE(json::parse(old.bodies()[1])["init_info"].contains("packed"));
    (*d)->BeginPublication(3, true);
    (*d)->PostBucket(Bucket(0));
    (*d)->EndPublication();
    ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
    json u = json::parse(old.bodies()[4])["update_info"];
    EXPECT_EQ(u["packed"], true);
    EXPECT_EQ(u["packed_buffer_size_bytes"], 1 << 20);
  }
}

// The join's probe refuses what the driver would fail on later, naming the route and the fix;
// a supported engine is taken (its release read from /version where it answers one).
TEST(VllmDriver, TheJoinsProbeRefusesUnsupportedEnginesNamingTheRoute) {
  FakeVllm nodev("nodev"), old("v0.20"), current;
  const VllmFamily family({});
  const auto profiles = family.Profile(
      {{nodev.url(), 1, "vllm", ""}, {old.url(), 1, "vllm", ""}, {current.url(), 1, "vllm", ""}},
      absl::Seconds(2));
  ASSERT_EQ(profiles.size(), 3u);
  ASSERT_FALSE(profiles[0].ok());
  EXPECT_EQ(profiles[0].status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* want : {"/init_weight_transfer_engine (HTTP 404)", "VLLM_SERVER_DEV_MODE=1"}) {
    EXPECT_NE(profiles[0].status().message().find(want), std::string::npos) << profiles[0].status();
  }
  EXPECT_NE(profiles[0].status().message().find(nodev.url()), std::string::npos);
  ASSERT_FALSE(profiles[1].ok());
  for (const char* want : {"/start_weight_update (HTTP 404)", "before v0.22"}) {
    EXPECT_NE(profiles[1].status().message().find(want), std::string::npos) << profiles[1].status();
  }
  ASSERT_TRUE(profiles[2].ok()) << profiles[2].status();
  EXPECT_TRUE(profiles[2]->lacks.empty());
}

TEST(VllmDriver, UnsupportedEnginesAreClearErrorsNamingThem) {
  {
    FakeVllm nodev("nodev");
    auto d = VllmDriver::Create(Options({&nodev}, {1}));
    (*d)->StartJoin();
    absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_NE(s.message().find(nodev.url()), std::string::npos) << s;
    EXPECT_NE(s.message().find("VLLM_SERVER_DEV_MODE=1"), std::string::npos) << s;
  }
  {
    FakeVllm old("v0.20");
    auto d = VllmDriver::Create(Options({&old}, {1}));
    (*d)->StartJoin();
    ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
    (*d)->BeginPublication(1, true);
    (*d)->PostBucket(Bucket(0));
    absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
    EXPECT_NE(s.message().find("before v0.22"), std::string::npos) << s;
    EXPECT_TRUE((*d)->any_failed());
    // A failed engine gets nothing more of the publication: no update after the refusal.
    for (const std::string& c : old.calls()) EXPECT_NE(c, "/update_weights");
  }
  {
    FakeVllm e;
    e.FailOn("/update_weights");
    auto d = VllmDriver::Create(Options({&e}, {1}));
    (*d)->StartJoin();
    ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
    (*d)->BeginPublication(1, true);
    (*d)->PostBucket(Bucket(0));
    absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
    EXPECT_NE(s.message().find("POST /update_weights: HTTP 500"), std::string::npos) << s;
    EXPECT_NE(s.message().find("illegal memory access"), std::string::npos) << s;
  }
  {
    VllmDriverOptions o;
    o.engines.push_back({"http://127.0.0.1:1", 1, "vllm"});  // nothing listens there
    o.master_port = 29500;
    o.connect_timeout = absl::Milliseconds(200);
    auto d = VllmDriver::Create(o);
    (*d)->StartJoin();
    absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
    EXPECT_NE(s.message().find("http://127.0.0.1:1 POST /init_weight_transfer_engine"),
              std::string::npos)
        << s;
  }
}

TEST(VllmDriver, AfterAnAbortEveryEngineFinishesAndOnlyCleanOnesResume) {
  FakeVllm sent, clean;
  auto d = VllmDriver::Create(Options({&sent, &clean}, {1, 1}));
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  (*d)->BeginPublication(5, true);
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  (*d)->PostBucket(Bucket(0));
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<bool> dirty = (*d)->ResumeAfterAbort({clean.url()});
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(dirty, (std::vector<bool>{true, true}));
  EXPECT_EQ(sent.calls().back(), "/finish_weight_update");
  EXPECT_EQ(clean.calls().back(), "/finish_weight_update");  // dirty from before: not resumed

  // An abort before the first bucket: the engine was never paused nor started (those calls go
  // with the first bucket), so nothing is finished or resumed -- it served throughout.
  FakeVllm fresh;
  auto d2 = VllmDriver::Create(Options({&fresh}, {1}));
  (*d2)->StartJoin();
  ASSERT_TRUE((*d2)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> joined = fresh.calls();
  (*d2)->BeginPublication(6, true);
  ASSERT_TRUE((*d2)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(fresh.calls(), joined);
  EXPECT_EQ((*d2)->ResumeAfterAbort(), std::vector<bool>{false});
  ASSERT_TRUE((*d2)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(fresh.calls(), joined);
  // Nothing more of the aborted publication reaches an engine.
  (*d2)->PostBucket(Bucket(0));
  (*d2)->EndPublication();
  ASSERT_TRUE((*d2)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(fresh.calls(), joined);
  // Once a bucket was posted, the engine was paused and started before it: an abort then
  // finishes the update and resumes the engine (it is dirty: not resumed).
  (*d2)->BeginPublication(7, true);
  (*d2)->PostBucket(Bucket(0));
  ASSERT_TRUE((*d2)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> calls = fresh.calls();
  ASSERT_EQ(calls.size(), joined.size() + 3);
  EXPECT_EQ(calls[joined.size()].rfind("/pause", 0), 0u) << calls[joined.size()];
  EXPECT_EQ(calls[joined.size() + 1], "/start_weight_update");
  EXPECT_EQ(calls[joined.size() + 2], "/update_weights");
}

TEST(VllmDriver, FollowersOfAPublicationGroupPostUpdatesOnly) {
  FakeVllm e;
  auto d = VllmDriver::Create(Options({&e}, {1}));
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  (*d)->BeginPublication(4, /*lifecycle_calls=*/false);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(e.calls(),
            (std::vector<std::string>{"/init_weight_transfer_engine", "/update_weights"}));
}

TEST(VllmDriver, PackedChunksFollowVllmsRule) {
  const transport::BucketManifest b = Bucket(0);  // tensors of 4, 8192, 2048 and 256 bytes
  EXPECT_EQ(VllmPackedChunks(b, 1 << 20), std::vector<uint64_t>{b.nbytes});
  // A chunk closes after the tensor that takes it past the limit.
  EXPECT_EQ(VllmPackedChunks(b, 4096), (std::vector<uint64_t>{4 + 8192, 2048 + 256}));
  EXPECT_EQ(VllmPackedChunks(b, 4), (std::vector<uint64_t>{4 + 8192, 2048, 256}));
  EXPECT_EQ(VllmPackedChunks(b, 1), (std::vector<uint64_t>{4, 8192, 2048, 256}));
  VllmDriverOptions o = Options({}, {});
  o.engines.push_back({"http://x:1", 1, "vllm"});
  o.packed_buffer_bytes = 4096;
  auto d = VllmDriver::Create(o);
  EXPECT_EQ((*d)->BroadcastChunks(b), (std::vector<uint64_t>{4 + 8192, 2048 + 256}));
}

TEST(VllmDriver, TheUniqueIdPickleIsVllmsCtypesStruct) {
  std::vector<uint8_t> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(i * 7 + 1);
  const std::string p = VllmUniqueIdPickle(id);
  const std::string head =
      std::string("\x80\x03", 2) + "c_ctypes\n_unpickle\n" +
      "cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n}C\x80";
  ASSERT_EQ(p.substr(0, head.size()), head);
  EXPECT_EQ(p.substr(head.size(), 128), std::string(id.begin(), id.end()));
  EXPECT_EQ(p.substr(head.size() + 128), "\x86\x86R.");
  EXPECT_EQ(std::string(kVllmUniqueIdKey), "/broadcast_from/0/0");
  VllmFamily family({});
  auto entries = family.UniqueIdEntries(id);
  ASSERT_TRUE(entries.has_value());
  ASSERT_EQ(entries->size(), 1u);
  EXPECT_EQ((*entries)[0].second, p);
  EXPECT_TRUE(family.warmup_all_reduce());

  // Python's pickle rebuilds it as vLLM's ctypes Structure (a stand-in module of that path).
  const char* python = "/usr/bin/python3";
  if (std::FILE* f = std::fopen(python, "r")) {
    std::fclose(f);
  } else {
    GTEST_SKIP() << "no " << python;
  }
  const std::string dir = ::testing::TempDir() + "vllm_pickle_" + std::to_string(::getpid());
  std::string mk = "mkdir -p " + dir + "/vllm/distributed/device_communicators";
  ASSERT_EQ(std::system(mk.c_str()), 0);
  for (const char* init : {"/vllm/__init__.py", "/vllm/distributed/__init__.py",
                           "/vllm/distributed/device_communicators/__init__.py"}) {
    std::ofstream(dir + init).close();
  }
  std::ofstream(dir + "/vllm/distributed/device_communicators/pynccl_wrapper.py")
      << "import ctypes\nclass ncclUniqueId(ctypes.Structure):\n"
         "    _fields_ = [('internal', ctypes.c_byte * 128)]\n";
  std::ofstream(dir + "/id.pickle", std::ios::binary) << p;
  const std::string check =
      "cd " + dir + " && " + python +
      " -c \"import pickle; from vllm.distributed.device_communicators.pynccl_wrapper import "
      "ncclUniqueId as U; u = pickle.load(open('id.pickle','rb')); assert type(u) is U; "
      "assert bytes(u.internal) == bytes((i * 7 + 1) % 256 for i in range(128)), "
      "bytes(u.internal)\"";
  EXPECT_EQ(std::system(check.c_str()), 0);
}

}  // namespace
}  // namespace wpub::rollout
