// The rollout group as the engine connector on one GPU, against fake SGLang HTTP servers (label
// gpu; skips without a CUDA device): a daemon started without engines, an engine that is down, one
// whose join fails and one that does not answer in time (each named, each leaving NO engines and
// the half-formed group destroyed on the engine), Connect refused while a publication is in
// flight, and a publication without engines (no participants, buffers still ordered); the
// receiver endpoint's HTTP connections and /stats.
#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "clients/recv/nccl/receiver_endpoint.h"
#include "core/nccl/nccl_comm.h"
#include "core/rollout/rollout_group.h"
#include "tests/rollout/fake_http.h"

namespace wpub::nccl {
namespace {

// Answers every route with success, or HTTP 500 on `fail_path`; the join itself (the POST of
// the init route) `init_delay_ms` late, the join's probe GETs at once.
class FakeEngine : public rollout::testing::ScriptedEngine {
 public:
  FakeEngine(const std::string& fail_path, int init_delay_ms) {
    if (!fail_path.empty()) FailOn(fail_path, 0);
    if (init_delay_ms > 0) SlowOn("/init_weights_update_group", init_delay_ms, /*post_only=*/true);
  }
};

class NcclConnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs a CUDA device";
    }
    rollout::RolloutGroupOptions o;
    o.store.bind_address = "127.0.0.1";
    o.group_name = "wpub_connect";
    o.sglang.driver.connect_timeout = absl::Seconds(2);
    o.sglang.driver.request_timeout = absl::Seconds(5);
    auto t = rollout::RolloutGroup::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = std::move(*t);
  }

  static engine::RolloutConnectRequest Request(const std::string& url, absl::Duration timeout) {
    engine::RolloutConnectRequest r;
    r.engines = {{url, 1}};
    r.timeout = timeout;
    return r;
  }

  void ExpectNoEngines() {
    engine::RolloutGroupInfo g = transport_->Group();
    EXPECT_TRUE(g.engines.empty());
    EXPECT_FALSE(g.healthy);
    EXPECT_TRUE(transport_->Receivers().empty());
  }

  std::unique_ptr<rollout::RolloutGroup> transport_;
};

// `made` was refused for a channel count out of range, naming `field`.
template <class T>
void ExpectCtasRefused(const absl::StatusOr<T>& made, const std::string& field, int ctas) {
  ASSERT_FALSE(made.ok()) << field << " = " << ctas;
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  EXPECT_NE(made.status().message().find(field + " must be in [0, 64]"), std::string::npos)
      << made.status();
}

// The channel count is checked before any device call (runs without a GPU too).
TEST(NcclCommOptionsTest, CtasOutsideItsRangeIsInvalidArgument) {
  for (int ctas : {-1, kMaxCtas + 1}) {
    NcclCommOptions o;
    o.nranks = 2;
    o.ctas = ctas;
    ExpectCtasRefused(NcclComm::Create(o), "ctas", ctas);
    rollout::RolloutGroupOptions to;
    to.nccl_ctas = ctas;
    ExpectCtasRefused(rollout::RolloutGroup::Create(to), "nccl_ctas", ctas);
    wpub::recv::nccl::ReceiverEndpointOptions eo;
    eo.nccl_ctas = ctas;
    ExpectCtasRefused(wpub::recv::nccl::ReceiverEndpoint::Start(eo, {}), "nccl_ctas", ctas);
  }
  for (int ctas : {0, kMaxCtas}) EXPECT_TRUE(CheckCtas(ctas, "ctas").ok()) << ctas;
}

// A publisher keeps one connection per request lane for a whole publication (17+ update
// requests and the lifecycle calls): the receiver endpoint answers all of them on that connection
// (httplib's default would close it after 5) and serves its own /stats.
TEST_F(NcclConnectTest, ReceiverEndpointKeepsAConnectionForAPublicationsRequests) {
  wpub::recv::nccl::ReceiverEndpointOptions eo;
  eo.devices = {0};
  auto endpoint = wpub::recv::nccl::ReceiverEndpoint::Start(eo, {});
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>((*endpoint)->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // One response: headers, then Content-Length bytes of body.
  auto exchange = [fd](const std::string& request, std::string* headers, std::string* body) {
    if (::send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
      return false;
    }
    std::string got;
    char buf[4096];
    size_t end = std::string::npos, length = 0;
    for (;;) {
      if (end == std::string::npos && (end = got.find("\r\n\r\n")) != std::string::npos) {
        *headers = got.substr(0, end);
        const size_t at = headers->find("Content-Length: ");
        if (at == std::string::npos) return false;
        length = std::stoul(headers->substr(at + 16));
      }
      if (end != std::string::npos && got.size() >= end + 4 + length) {
        *body = got.substr(end + 4, length);
        return true;
      }
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return false;  // the server closed the connection
      got.append(buf, static_cast<size_t>(n));
    }
  };
  const std::string version = R"({"new_version": "7"})";
  for (int i = 0; i < 24; ++i) {
    std::string headers, body;
    const std::string request =
        i % 2 == 0 ? "GET /health HTTP/1.1\r\nHost: engine\r\n\r\n"
                   : "POST /update_weight_version HTTP/1.1\r\nHost: engine\r\nContent-Type: "
                     "application/json\r\nContent-Length: " +
                         std::to_string(version.size()) + "\r\n\r\n" + version;
    ASSERT_TRUE(exchange(request, &headers, &body)) << "request " << i << " on one connection";
    EXPECT_EQ(headers.rfind("HTTP/1.1 200", 0), 0u) << headers;
    EXPECT_EQ(headers.find("Connection: close"), std::string::npos) << "request " << i;
  }
  std::string headers, body;
  ASSERT_TRUE(exchange("GET /stats HTTP/1.1\r\nHost: engine\r\n\r\n", &headers, &body));
  EXPECT_EQ(body, "{}");  // no version received yet
  ::close(fd);
}

TEST_F(NcclConnectTest, StartsWithoutEngines) {
  ExpectNoEngines();
  EXPECT_EQ(transport_->Group().generation, 0u);
  EXPECT_NE(transport_->Group().store_address.find(std::to_string(transport_->store_port())),
            std::string::npos);
}

TEST_F(NcclConnectTest, EngineDownIsUnavailableNamingIt) {
  std::string url;
  {
    FakeEngine gone("", 0);
    url = gone.url();
  }  // nothing listens there any more
  auto g = transport_->Connect(Request(url, absl::Seconds(5)));
  EXPECT_TRUE(absl::IsUnavailable(g.status())) << g.status();
  EXPECT_NE(g.status().message().find(url), std::string::npos) << g.status();
  ExpectNoEngines();
}

TEST_F(NcclConnectTest, OneGroupSpeaksOneProtocolAndVllmEnginesAreProbedAsVllm) {
  engine::RolloutConnectRequest mixed;
  mixed.engines = {{"http://127.0.0.1:9", 1, "sglang"}, {"http://127.0.0.1:10", 1, "vllm"}};
  auto g = transport_->Connect(mixed);
  EXPECT_TRUE(absl::IsInvalidArgument(g.status())) << g.status();
  EXPECT_NE(g.status().message().find("different protocols"), std::string::npos) << g.status();
  EXPECT_NE(g.status().message().find("http://127.0.0.1:10 (vllm)"), std::string::npos)
      << g.status();
  // A vLLM engine set is the vLLM family's: its health check names it.
  engine::RolloutConnectRequest vllm;
  vllm.engines = {{"http://127.0.0.1:9", 1, "vllm"}};
  vllm.timeout = absl::Seconds(1);
  g = transport_->Connect(vllm);
  EXPECT_TRUE(absl::IsUnavailable(g.status())) << g.status();
  EXPECT_NE(g.status().message().find("vllm health check"), std::string::npos) << g.status();
  EXPECT_TRUE(transport_->Group().engines.empty());
}

TEST_F(NcclConnectTest, FailedJoinIsUnavailableAndTornDown) {
  FakeEngine engine("/init_weights_update_group", 0);
  auto g = transport_->Connect(Request(engine.url(), absl::Seconds(5)));
  EXPECT_TRUE(absl::IsUnavailable(g.status())) << g.status();
  EXPECT_NE(g.status().message().find(engine.url()), std::string::npos) << g.status();
  EXPECT_NE(g.status().message().find("HTTP 500"), std::string::npos) << g.status();
  ExpectNoEngines();
}

TEST_F(NcclConnectTest, SilentEngineIsDeadlineExceededAndTornDown) {
  FakeEngine engine("", 1500);  // joins after the 300 ms budget
  auto g = transport_->Connect(Request(engine.url(), absl::Milliseconds(300)));
  EXPECT_TRUE(absl::IsDeadlineExceeded(g.status())) << g.status();
  EXPECT_NE(g.status().message().find(engine.url()), std::string::npos) << g.status();
  ExpectNoEngines();
  // The group that did not form was destroyed on the engine once it answered.
  EXPECT_TRUE(engine.Called("/destroy_weights_update_group"));
  EXPECT_EQ(transport_->Group().generation, 1u);
}

TEST_F(NcclConnectTest, PublicationWithoutEnginesAndConnectWhileInFlight) {
  transport::PublicationManifest m;
  m.version = 7;
  auto names = transport_->Begin(m);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->empty());
  auto refused = transport_->Connect(Request("http://127.0.0.1:1", absl::Seconds(1)));
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("publication 7"), std::string::npos);
  // A device bucket: with no engines nothing reads it.
  cudaEvent_t ready = nullptr, done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 256), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, nullptr), cudaSuccess);
  auto b = std::make_shared<transport::Bucket>();
  b->manifest.nbytes = 256;
  b->location = transport::BucketLocation::kDevice;
  b->device.data = static_cast<const uint8_t*>(buf);
  b->device.ready = ready;
  b->device.done = done;
  EXPECT_TRUE(transport_->Send(b).ok());
  EXPECT_EQ(cudaEventSynchronize(done), cudaSuccess);
  EXPECT_TRUE(transport_->WaitAcknowledged(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(transport_->Commit().ok());
  EXPECT_TRUE(transport_->Outcomes().empty());
  cudaFree(buf);
  cudaEventDestroy(ready);
  cudaEventDestroy(done);
  // Not in flight any more: Connect runs (and fails on the dead URL, naming it).
  auto after = transport_->Connect(Request("http://127.0.0.1:1", absl::Seconds(1)));
  EXPECT_TRUE(absl::IsUnavailable(after.status())) << after.status();
}

// A group without engines (the other family's group of every GPU-path daemon) takes part in
// every publication: an aborted one must leave nothing behind, or the next publication -- and
// every later one -- ends with the old reason though its engines committed.
TEST_F(NcclConnectTest, AbortWithoutEnginesLeavesNothingForTheNextPublication) {
  for (uint64_t version = 1; version <= 3; ++version) {
    transport::PublicationManifest m;
    m.version = version;
    auto names = transport_->Begin(m);
    ASSERT_TRUE(names.ok()) << names.status();
    EXPECT_TRUE(names->empty());
    if (version == 1) {
      transport_->Abort("attempt 1 failed (an engine of the other family)");
      continue;
    }
    auto b = std::make_shared<transport::Bucket>();
    b->manifest.nbytes = 16;
    b->bytes.assign(16, 1);
    EXPECT_TRUE(transport_->Send(b).ok()) << "version " << version;
    EXPECT_TRUE(transport_->WaitAcknowledged(absl::Now() + absl::Seconds(5)).ok());
    const absl::Status committed = transport_->Commit();
    EXPECT_TRUE(committed.ok()) << "version " << version << ": " << committed;
    EXPECT_TRUE(transport_->Outcomes().empty());
  }
}

// A second engine family plugs in beside SGLang's through rollout::EngineFamily alone: the
// group probes through it, hands its driver the group's address (this store,
// "<base>_<incarnation>_1"), and a join its driver refuses leaves no engines connected, naming
// the family's error. A second group object of the same base name (a restarted daemon) names
// its groups differently.
class RefusingDriver final : public rollout::EngineDriver {
 public:
  explicit RefusingDriver(rollout::GroupAddress a)
      : address_(std::move(a)),
        layout_(*rollout::LayoutGroup(address_.engines, address_.group_name)) {}
  const rollout::GroupLayout& layout() const override { return layout_; }
  const std::vector<rollout::EngineSpec>& engines() const override { return address_.engines; }
  void StartJoin() override {}
  absl::Status WaitIdle(absl::Time) override {
    return absl::AbortedError("other-family: join refused");
  }
  void BeginPublication(uint64_t, bool) override {}
  void PostBucket(const transport::BucketManifest&, const transport::SharedDeviceBytes*) override {}
  void EndPublication() override {}
  std::vector<bool> ResumeAfterAbort(const std::set<std::string>&) override {
    return std::vector<bool>(address_.engines.size(), false);
  }
  void Leave() override {}
  std::vector<rollout::EngineOutcome> outcomes() const override { return {}; }
  bool any_failed() const override { return false; }

 private:
  const rollout::GroupAddress address_;
  const rollout::GroupLayout layout_;
};

class OtherFamily final : public rollout::EngineFamily {
 public:
  std::string_view name() const override { return "other-family"; }
  std::vector<bool> Probe(const std::vector<rollout::EngineSpec>& e,
                          absl::Duration) const override {
    ++probes;
    return std::vector<bool>(e.size(), true);
  }
  std::vector<uint64_t> WeightVersions(const std::vector<rollout::EngineSpec>& e,
                                       absl::Duration) const override {
    return std::vector<uint64_t>(e.size(), 0);
  }
  absl::StatusOr<std::unique_ptr<rollout::EngineDriver>> CreateDriver(
      const rollout::GroupAddress& a) const override {
    addresses.push_back(a);
    return std::make_unique<RefusingDriver>(a);
  }
  absl::Duration request_timeout() const override { return absl::Seconds(5); }
  absl::Duration connect_timeout() const override { return absl::Seconds(2); }
  absl::StatusOr<engine::PausePolicy> ResolvePause(const engine::PausePolicy& p) const override {
    return p;
  }
  mutable int probes = 0;
  mutable std::vector<rollout::GroupAddress> addresses;
};

TEST(RolloutGroupFamilyTest, AnotherEngineFamilyPlugsInWithoutTheTransport) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "needs a CUDA device";
  }
  auto family = std::make_shared<OtherFamily>();
  rollout::RolloutGroupOptions o;
  o.store.bind_address = "127.0.0.1";
  o.group_name = "wpub_other";
  o.family = family;
  auto group = rollout::RolloutGroup::Create(o);
  ASSERT_TRUE(group.ok()) << group.status();
  engine::RolloutConnectRequest r;
  r.engines = {{"http://127.0.0.1:9", 2}};
  r.timeout = absl::Seconds(2);
  auto g = (*group)->Connect(r);
  EXPECT_TRUE(absl::IsUnavailable(g.status())) << g.status();
  EXPECT_NE(g.status().message().find("other-family: join refused"), std::string::npos)
      << g.status();
  EXPECT_EQ(family->probes, 1);
  ASSERT_EQ(family->addresses.size(), 1u);
  EXPECT_EQ(family->addresses[0].group_name,
            absl::StrCat("wpub_other_", (*group)->incarnation(), "_1"));
  EXPECT_EQ(family->addresses[0].master_port, (*group)->store_port());
  ASSERT_EQ(family->addresses[0].engines.size(), 1u);
  EXPECT_EQ(family->addresses[0].engines[0].gpus, 2);
  EXPECT_TRUE((*group)->Group().engines.empty()) << "never half-connected";

  // A restarted daemon: the same base name, another incarnation, so the engines never see a
  // name an earlier daemon's group may still hold.
  auto restarted = rollout::RolloutGroup::Create(o);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_EQ((*restarted)->incarnation().size(), 8u);
  EXPECT_NE((*restarted)->incarnation(), (*group)->incarnation());
  EXPECT_FALSE((*restarted)->Connect(r).ok());
  ASSERT_EQ(family->addresses.size(), 2u);
  EXPECT_NE(family->addresses[1].group_name, family->addresses[0].group_name);
  EXPECT_EQ(family->addresses[1].group_name,
            absl::StrCat("wpub_other_", (*restarted)->incarnation(), "_1"));
}

}  // namespace
}  // namespace wpub::nccl
