// SGLang driver tests against scripted SGLang HTTP servers (fake_http.h): the engine list
// syntax (--engines, connect-engines), group layout,
// request bodies (names/dtypes/shapes/load_format, no weight_version), the lifecycle order per
// engine, configurable endpoints, and failures (HTTP error, success=false, timeout, refused).
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "absl/strings/escaping.h"
#include "core/rollout/sglang_driver.h"
#include "core/rollout/torch_ipc.h"
#include "nlohmann/json.hpp"
#include "tests/rollout/fake_http.h"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;

using FakeEngine = testing::ScriptedEngine;

transport::BucketManifest Bucket(uint32_t index) {
  transport::BucketManifest b;
  b.index = index;
  b.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight_scale_2", DType::kFloat32, {}, 0, 4});
  b.tensors.push_back(
      {"model.layers.0.mlp.experts.0.down_proj.weight", DType::kUInt8, {2048, 384}, 4, 2048 * 384});
  b.tensors.push_back({"model.layers.0.mlp.experts.0.down_proj.weight_scale",
                       DType::kFloat8E4M3,
                       {2048, 48},
                       4 + 2048 * 384,
                       2048 * 48});
  b.nbytes = 4 + 2048 * 384 + 2048 * 48;
  return b;
}

SglangDriverOptions Options(const std::vector<FakeEngine*>& engines, std::vector<int> gpus) {
  SglangDriverOptions o;
  for (size_t i = 0; i < engines.size(); ++i) o.engines.push_back({engines[i]->url(), gpus[i]});
  o.master_address = "10.0.0.7";
  o.master_port = 29500;
  o.group_name = "wpub_g0";
  o.request_timeout = absl::Seconds(5);
  return o;
}

// An engine started with an API key answers 401 to every route without it: with the key in its
// EngineSpec every request -- the join, the updates, the lifecycle calls and the probes --
// carries it; without it the join fails at once naming the engine, the route and the status.
TEST(SglangDriver, EnginesBehindAnApiKeyGetItOnEveryRequest) {
  FakeEngine a;
  a.RequireApiKey("s3cret-key");
  SglangDriverOptions o = Options({&a}, {1});
  {
    auto refused = SglangDriver::Create(o);
    ASSERT_TRUE(refused.ok());
    (*refused)->StartJoin();
    const absl::Status s = (*refused)->WaitIdle(absl::Now() + absl::Seconds(5));
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(a.url()), std::string::npos) << s;
    EXPECT_NE(s.message().find("HTTP 401"), std::string::npos) << s;
    EXPECT_EQ(s.message().find("s3cret"), std::string::npos) << "the key in a message: " << s;
  }
  o.engines[0].auth_token = "s3cret-key";
  EXPECT_EQ(ProbeEngines(o.engines, "/health", absl::Seconds(2)), std::vector<bool>{true});
  std::vector<EngineSpec> keyless = o.engines;
  keyless[0].auth_token.clear();
  EXPECT_EQ(ProbeEngines(keyless, "/health", absl::Seconds(2)), std::vector<bool>{false});
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  (*d)->BeginPublication(7, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  const absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(s.ok()) << s;
  for (const EngineOutcome& e : (*d)->outcomes()) EXPECT_FALSE(e.failed) << e.error;
}

TEST(ParseEngineSpecs, UrlsWithGpuCounts) {
  auto e = ParseEngineSpecs("http://a:30000=4, http://b:30000,http://c=1");
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->size(), 3u);
  EXPECT_EQ((*e)[0].url, "http://a:30000");
  EXPECT_EQ((*e)[0].gpus, 4);
  EXPECT_EQ((*e)[1].url, "http://b:30000");  // spaces around an entry are dropped
  EXPECT_EQ((*e)[1].gpus, 1);
  EXPECT_EQ((*e)[2].gpus, 1);
  for (const char* bad : {"", "http://a=0", "http://a=-2", "http://a=x", "=3"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseEngineSpecs(bad).status())) << bad;
  }
}

TEST(LayoutGroup, RanksAndWorldSize) {
  auto g = LayoutGroup({{"http://a", 4}, {"http://b", 2}, {"http://c", 1}}, "g");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->world_size, 8);
  EXPECT_EQ(g->rank_offsets, (std::vector<int>{1, 5, 7}));
  EXPECT_FALSE(LayoutGroup({}, "g").ok());
  EXPECT_FALSE(LayoutGroup({{"http://a", 0}}, "g").ok());
  EXPECT_FALSE(LayoutGroup({{"", 1}}, "g").ok());
  EXPECT_FALSE(LayoutGroup({{"http://a", 1}}, "").ok());
}

TEST(SglangDriver, CreateValidates) {
  SglangDriverOptions o;
  o.engines = {{"localhost:3000", 1}};
  o.master_port = 1;
  EXPECT_TRUE(absl::IsInvalidArgument(SglangDriver::Create(o).status()));
  o.engines = {{"http://localhost:3000", 1}};
  o.master_port = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(SglangDriver::Create(o).status()));
}

TEST(SglangDriver, JoinSendsEachEngineItsRankOffset) {
  FakeEngine a, b;
  auto d = SglangDriver::Create(Options({&a, &b}, {2, 1}));
  ASSERT_TRUE(d.ok()) << d.status();
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  ASSERT_EQ(a.calls(), std::vector<std::string>{"/init_weights_update_group"});
  json ja = json::parse(a.bodies()[0]), jb = json::parse(b.bodies()[0]);
  EXPECT_EQ(ja["rank_offset"], 1);
  EXPECT_EQ(jb["rank_offset"], 3);
  EXPECT_EQ(ja["world_size"], 4);
  EXPECT_EQ(ja["master_address"], "10.0.0.7");
  EXPECT_EQ(ja["master_port"], 29500);
  EXPECT_EQ(ja["group_name"], "wpub_g0");
  EXPECT_EQ(ja["backend"], "nccl");
}

TEST(SglangDriver, PublicationLifecycleInOrder) {
  FakeEngine a, b;
  auto d = SglangDriver::Create(Options({&a, &b}, {1, 1}));
  ASSERT_TRUE(d.ok());
  // A slow first bucket on one engine must not let the second overtake it.
  a.SlowOn("/update_weights_from_distributed", 100);
  (*d)->BeginPublication(7, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->PostBucket(Bucket(1));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  // The default pause policy, abort:flush: the cache goes once the new weights are in.
  const std::vector<std::string> want = {"/pause_generation",
                                         "/begin_weight_update",
                                         "/update_weights_from_distributed",
                                         "/update_weights_from_distributed",
                                         "/end_weight_update",
                                         "/update_weight_version",
                                         "/flush_cache",
                                         "/continue_generation"};
  EXPECT_EQ(a.calls(), want);
  EXPECT_EQ(b.calls(), want);
  json u = json::parse(a.bodies()[2]);
  EXPECT_EQ(u["load_format"], "flattened_bucket");
  // SGLang adopts an update's weight_version as soon as it loads: the version is announced
  // once the session ended, never on a bucket.
  EXPECT_FALSE(u.contains("weight_version"));
  EXPECT_EQ(u["group_name"], "wpub_g0");
  EXPECT_EQ(u["flush_cache"], false);
  EXPECT_EQ(u["names"][1], "model.layers.0.mlp.experts.0.down_proj.weight");
  EXPECT_EQ(u["dtypes"], json({"float32", "uint8", "float8_e4m3fn"}));
  EXPECT_EQ(u["shapes"][0], json::array());
  EXPECT_EQ(u["shapes"][2], json({2048, 48}));
  EXPECT_EQ(json::parse(a.bodies()[0])["mode"], "abort");
  EXPECT_FALSE(u.contains("wpub_sequence"));  // one request in flight: SGLang's own protocol
  EXPECT_EQ(a.max_active(), 1);
  EXPECT_EQ(json::parse(a.bodies()[5])["new_version"], "7");
  // SGLang aborts every running request unless told not to (its default is true).
  EXPECT_EQ(json::parse(a.bodies()[5])["abort_all_requests"], false);
  for (const EngineOutcome& o : (*d)->outcomes()) {
    EXPECT_FALSE(o.failed) << o.error;
    EXPECT_EQ(o.requests, 8u);
  }
}

// A member of a publication group other than its leader: update requests only; the leader
// makes the lifecycle calls once per engine per version (docs/DESIGN.md, "Publication groups").
TEST(SglangDriver, WithoutLifecycleCallsOnlyUpdatesArePosted) {
  FakeEngine a;
  auto d = SglangDriver::Create(Options({&a}, {1}));
  ASSERT_TRUE(d.ok());
  (*d)->BeginPublication(7, /*lifecycle_calls=*/false);
  (*d)->PostBucket(Bucket(0));
  (*d)->PostBucket(Bucket(1));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> want = {"/update_weights_from_distributed",
                                         "/update_weights_from_distributed"};
  EXPECT_EQ(a.calls(), want);
  EXPECT_FALSE(json::parse(a.bodies()[0]).contains("weight_version"));
  // After an aborted version: no resume either (the engine holds this member's bytes and is
  // dirty; had it none, resuming it is still the leader's call).
  (*d)->BeginPublication(8, /*lifecycle_calls=*/false);
  (*d)->PostBucket(Bucket(0));
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<bool> dirty = (*d)->ResumeAfterAbort({});
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(dirty, std::vector<bool>{true});
  EXPECT_EQ(a.calls().size(), 3u);
  // The next leader-made publication has every call again.
  (*d)->BeginPublication(9, /*lifecycle_calls=*/true);
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(a.calls().front(), "/update_weights_from_distributed");
  EXPECT_EQ(a.calls()[3], "/pause_generation");
  EXPECT_EQ(a.calls().back(), "/continue_generation");
}

// Each engine's pause policy picks its /pause_generation mode and whether its cache is flushed
// (after the update, before the continue): abort:flush, abort:keep, retract:keep, keep:keep.
TEST(SglangDriver, EachEnginesPausePolicyPicksItsModeAndItsFlush) {
  using P = engine::PausePolicy;
  FakeEngine a, b, c, d;
  SglangDriverOptions o = Options({&a, &b, &c, &d}, {1, 1, 1, 1});
  o.engines[0].pause = {P::InFlight::kAbort, P::Cache::kFlush};
  o.engines[1].pause = {P::InFlight::kAbort, P::Cache::kKeep};
  o.engines[2].pause = {P::InFlight::kRetract, P::Cache::kKeep};
  o.engines[3].pause = {P::InFlight::kKeep, P::Cache::kKeep};
  auto driver = SglangDriver::Create(o);
  ASSERT_TRUE(driver.ok());
  (*driver)->BeginPublication(4, /*lifecycle_calls=*/true);
  (*driver)->PostBucket(Bucket(0));
  (*driver)->EndPublication();
  ASSERT_TRUE((*driver)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::pair<FakeEngine*, const char*>> modes = {
      {&a, "abort"}, {&b, "abort"}, {&c, "retract"}, {&d, "in_place"}};
  for (const auto& [engine, mode] : modes) {
    ASSERT_EQ(engine->calls().front(), "/pause_generation");
    EXPECT_EQ(json::parse(engine->bodies().front())["mode"], mode) << engine->url();
    EXPECT_EQ(engine->calls().back(), "/continue_generation");
  }
  EXPECT_TRUE(a.Called("/flush_cache"));
  for (FakeEngine* kept : {&b, &c, &d}) EXPECT_FALSE(kept->Called("/flush_cache"));
  EXPECT_EQ(SglangPauseMode(P::InFlight::kWait), "");  // no SGLang mode: refused at connect
}

// Engines resume together: the one that finishes first waits for the other's last call before
// its continue (no engine serves the new version while another still finalizes it).
TEST(SglangDriver, EnginesResumeTogetherOnceEveryEngineFinished) {
  FakeEngine a, b;
  auto d = SglangDriver::Create(Options({&a, &b}, {1, 1}));
  ASSERT_TRUE(d.ok());
  a.SlowOn("/end_weight_update", 300);
  (*d)->BeginPublication(5, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> ca = a.calls(), cb = b.calls();
  ASSERT_EQ(ca.back(), "/continue_generation");
  ASSERT_EQ(cb.back(), "/continue_generation");
  ASSERT_EQ(ca[ca.size() - 2], "/flush_cache");
  // a's flush is sent only once its slow end was answered (then its version): b's continue
  // came after it.
  EXPECT_GE(b.arrivals().back(), a.arrivals()[ca.size() - 2]);
  for (const EngineOutcome& o : (*d)->outcomes()) {
    EXPECT_FALSE(o.failed) << o.error;
    EXPECT_GE(o.pause.resumed, o.pause.last_update);
  }
}

// An engine that fails never holds the others' resume: its skipped continue frees its seat.
TEST(SglangDriver, AFailedEngineDoesNotHoldTheOthersResume) {
  FakeEngine a, b;
  SglangDriverOptions o = Options({&a, &b}, {1, 1});
  o.request_timeout = absl::Seconds(30);
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  a.FailOn("/end_weight_update", 0);
  (*d)->BeginPublication(6, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  const absl::Time start = absl::Now();
  const absl::Status idle = (*d)->WaitIdle(absl::Now() + absl::Seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the 30 s request timeout
  EXPECT_FALSE(idle.ok());                           // a failed
  EXPECT_FALSE(a.Called("/continue_generation"));
  EXPECT_EQ(b.calls().back(), "/continue_generation");
}

TEST(SglangDriver, EndpointsAreConfigurable) {
  FakeEngine a;
  SglangDriverOptions o = Options({&a}, {1});
  o.endpoints.pause = "";
  o.endpoints.flush = "";
  o.endpoints.begin = "";
  o.endpoints.end = "";
  o.endpoints.version = "/v2/version";
  o.endpoints.update = "/v2/update";
  o.endpoints.load_format = "";
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  (*d)->BeginPublication(3, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(a.calls(),
            (std::vector<std::string>{"/v2/update", "/v2/version", "/continue_generation"}));
  EXPECT_FALSE(json::parse(a.bodies()[0]).contains("load_format"));
}

TEST(SglangDriver, HttpErrorFailsThatEngineOnlyAndSkipsItsLaterCalls) {
  FakeEngine a, b;
  auto d = SglangDriver::Create(Options({&a, &b}, {1, 1}));
  ASSERT_TRUE(d.ok());
  b.FailOn("/update_weights_from_distributed", 2);
  (*d)->BeginPublication(9, /*lifecycle_calls=*/true);
  for (uint32_t i = 0; i < 3; ++i) (*d)->PostBucket(Bucket(i));
  (*d)->EndPublication();
  const absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find(b.url()), std::string::npos) << s;
  EXPECT_NE(s.message().find("HTTP 500"), std::string::npos) << s;
  auto out = (*d)->outcomes();
  EXPECT_FALSE(out[0].failed);
  EXPECT_TRUE(out[1].failed);
  // b saw pause, begin, bucket 0, bucket 1 (failed) and nothing after; a all 9 calls (its
  // continue was not held by b, whose skipped continue freed its seat).
  EXPECT_EQ(b.calls().size(), 4u);
  EXPECT_EQ(a.calls().size(), 9u);
  EXPECT_EQ(a.calls().back(), "/continue_generation");
  // The next publication starts clean.
  (*d)->BeginPublication(10, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  (*d)->EndPublication();
  EXPECT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
}

TEST(SglangDriver, SuccessFalseIsAFailure) {
  FakeEngine a;
  auto d = SglangDriver::Create(Options({&a}, {1}));
  ASSERT_TRUE(d.ok());
  a.SoftFailOn("/update_weights_from_distributed", /*status=*/200);
  (*d)->BeginPublication(1, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  const absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("discard the whole weights"), std::string::npos) << s;
}

TEST(SglangDriver, TimeoutsAndRefusedConnections) {
  FakeEngine a;
  SglangDriverOptions o = Options({&a}, {1});
  o.request_timeout = absl::Milliseconds(200);
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  a.SlowOn("/update_weights_from_distributed", 1000);
  (*d)->BeginPublication(1, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0));
  // The driver's deadline passes before the request's own timeout: DEADLINE_EXCEEDED.
  absl::Status s = (*d)->WaitIdle(absl::Now() + absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  // Then the request times out and the engine is failed.
  s = (*d)->WaitIdle(absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsAborted(s)) << s;

  SglangDriverOptions dead = o;
  dead.engines = {{"http://127.0.0.1:1", 1}};
  auto d2 = SglangDriver::Create(dead);
  ASSERT_TRUE(d2.ok());
  (*d2)->StartJoin();
  s = (*d2)->WaitIdle(absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("init_weights_update_group"), std::string::npos) << s;
}

TEST(SglangDriver, DestructionAbortsAHungRequestAndDropsTheQueue) {
  FakeEngine a;
  a.SlowOn("/init_weights_update_group", 1500);
  SglangDriverOptions o = Options({&a}, {1});
  o.request_timeout = absl::Seconds(60);
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  (*d)->StartJoin();
  for (int i = 0; i < 200 && a.calls().empty(); ++i) {  // the join is in flight (and hangs)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  (*d)->Leave();  // queued behind the hung join
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const absl::Time start = absl::Now();
  d->reset();
  // Not the request timeout (60 s) nor the engine's 1.5 s answer.
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1000));
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  EXPECT_EQ(a.calls(), std::vector<std::string>{"/init_weights_update_group"});
}

TEST(SglangDriver, TwoUpdatesInFlightOverlapButLifecycleCallsNever) {
  FakeEngine a;
  SglangDriverOptions o = Options({&a}, {1});
  o.requests_in_flight = 2;
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok());
  a.SlowOn("/update_weights_from_distributed", 150);
  (*d)->BeginPublication(9, /*lifecycle_calls=*/true);
  for (uint32_t i = 0; i < 4; ++i) (*d)->PostBucket(Bucket(i));
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(10)).ok());
  const std::vector<std::string> calls = a.calls();
  ASSERT_EQ(calls.size(), 10u);
  EXPECT_EQ(std::vector<std::string>(calls.begin(), calls.begin() + 2),
            (std::vector<std::string>{"/pause_generation", "/begin_weight_update"}));
  EXPECT_EQ(std::vector<std::string>(calls.end() - 4, calls.end()),
            (std::vector<std::string>{"/end_weight_update", "/update_weight_version",
                                      "/flush_cache", "/continue_generation"}));
  // Every bucket once, each naming its place in the publication.
  std::vector<int> seen;
  for (size_t i = 2; i < 6; ++i) {
    EXPECT_EQ(calls[i], "/update_weights_from_distributed");
    seen.push_back(json::parse(a.bodies()[i])["wpub_sequence"].get<int>());
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(a.max_active(), 2);  // two buckets were in flight together, never three
  EXPECT_FALSE(a.lifecycle_overlapped());
  EXPECT_EQ((*d)->outcomes()[0].requests, 10u);
}

TEST(SglangDriver, LeaveDropsTheUnsentRequestsOfAnAbortedPublication) {
  FakeEngine a;
  auto d = SglangDriver::Create(Options({&a}, {1}));
  ASSERT_TRUE(d.ok());
  a.SlowOn("/update_weights_from_distributed", 300);
  (*d)->BeginPublication(4, /*lifecycle_calls=*/true);
  for (uint32_t i = 0; i < 3; ++i) (*d)->PostBucket(Bucket(i));
  // Wait until the first update is in flight, then leave: buckets 1 and 2 must never be sent
  // (each would post a receive that no broadcast matches).
  for (int i = 0; i < 200 && a.calls().size() < 3; ++i) {  // pause, begin, the first update
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  (*d)->Leave();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> calls = a.calls();
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "/update_weights_from_distributed"), 1);
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls.back(), "/destroy_weights_update_group");
}

}  // namespace
}  // namespace wpub::rollout

namespace wpub::rollout {
namespace {

transport::SharedDeviceBytes SharedOf(const transport::BucketManifest& b, uint64_t slot) {
  transport::SharedDeviceBytes s;
  s.mem_handle = std::string(64, '\x05');
  s.event_handle = std::string(64, '\x06');
  s.allocation_bytes = b.nbytes * 2;
  s.nbytes = b.nbytes;
  s.device_uuid = "GPU-00112233-4455-6677-8899-aabbccddeeff";
  s.ref_counter = "/wpub_1_test";
  s.ref_counter_offset = slot;
  return s;
}

// Colocated engines (sglang-ipc): nothing to join or leave, each bucket's request is
// /update_weights_from_tensor with one base64 pickle per TP rank, inside SGLang's session
// (pause, begin, the buckets, end, version, continue); engine i's ranks take the reference-counter
// slots after the ranks of the engines before it.
TEST(SglangDriver, ColocatedEnginesTakeEachBucketAsTensorsInTheSession) {
  FakeEngine a, b;
  SglangDriverOptions o = Options({&a, &b}, {1, 2});
  o.colocated = true;
  o.master_port = 0;  // no TCPStore: nothing rendezvouses
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok()) << d.status();
  (*d)->StartJoin();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(a.calls().empty()) << "a colocated engine joins no group";
  (*d)->BeginPublication(4, /*lifecycle_calls=*/true);
  const transport::BucketManifest b0 = Bucket(0), b1 = Bucket(1);
  const transport::SharedDeviceBytes s0 = SharedOf(b0, 0), s1 = SharedOf(b1, 3);
  (*d)->PostBucket(b0, &s0);
  (*d)->PostBucket(b1, &s1);
  (*d)->EndPublication();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  (*d)->Leave();
  ASSERT_TRUE((*d)->WaitIdle(absl::Now() + absl::Seconds(5)).ok());
  const std::vector<std::string> want = {"/pause_generation",
                                         "/begin_weight_update",
                                         "/update_weights_from_tensor",
                                         "/update_weights_from_tensor",
                                         "/end_weight_update",
                                         "/update_weight_version",
                                         "/flush_cache",
                                         "/continue_generation"};
  EXPECT_EQ(a.calls(), want);
  EXPECT_EQ(b.calls(), want);
  const json body = json::parse(b.bodies()[3]);  // engine b, bucket 1
  ASSERT_EQ(body["serialized_named_tensors"].size(), 2u) << body.dump();
  EXPECT_EQ(body["load_format"], "flattened_bucket");
  EXPECT_EQ(body["flush_cache"], false);
  EXPECT_FALSE(body.contains("weight_version")) << "told only at the end";
  // Engine b's ranks are the group's ranks 2 and 3: slots 3 + 1 and 3 + 2 of bucket 1.
  for (int r = 0; r < 2; ++r) {
    std::string pickle;
    ASSERT_TRUE(
        absl::Base64Unescape(body["serialized_named_tensors"][r].get<std::string>(), &pickle));
    absl::StatusOr<std::string> want_pickle = SglangFlattenedBucketPickle(b1, s1, 3 + 1 + r);
    ASSERT_TRUE(want_pickle.ok());
    EXPECT_EQ(pickle, *want_pickle) << "rank " << r;
  }
}

// A bucket a colocated engine set is posted without its GPU-memory description (a host bucket
// of the CPU backend) fails every engine, naming it: nothing of it reached them, nothing commits.
TEST(SglangDriver, AColocatedBucketNotSharedFailsTheEngines) {
  FakeEngine a;
  SglangDriverOptions o = Options({&a}, {1});
  o.colocated = true;
  auto d = SglangDriver::Create(o);
  ASSERT_TRUE(d.ok()) << d.status();
  (*d)->BeginPublication(1, /*lifecycle_calls=*/true);
  (*d)->PostBucket(Bucket(0), nullptr);
  (void)(*d)->WaitIdle(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE((*d)->any_failed());
  const std::string error = (*d)->outcomes()[0].error;
  EXPECT_NE(error.find("bucket 0"), std::string::npos) << error;
  EXPECT_NE(error.find("GPU path"), std::string::npos) << error;
  for (const std::string& c : a.calls()) EXPECT_NE(c, "/update_weights_from_tensor");
}

}  // namespace
}  // namespace wpub::rollout
