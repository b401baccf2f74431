// The rollout group as the daemon runs it -- the engine's publications, its retries of a version
// that left engines dirty, the group's probe, join, abort and re-formation -- against engines
// that answer as the released engines' code does (fake_sglang.h; wpub-recv's vLLM engine,
// clients/recv/vllm_engine.h), over an in-process channel instead of NCCL (no GPU: label unit).
// Each failure is followed by a committed next version on every live engine, no engine process
// lost to wpub, no engine left paused, no session left open and no mixed resume:
//  - a loader failure at bucket k (SGLang: 400 success=false; vLLM: 500, the worker leaves the
//    update): the version is retried and commits, vLLM byte for byte with the CPU oracle;
//  - an engine killed mid-publication: the retry re-forms the group without it;
//  - the trainer's cancel in the middle of the transfer, and while the group begins;
//  - the publication deadline passed by a stalled engine.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "clients/recv/vllm_engine.h"
#include "core/common/status.h"
#include "core/delta/bucket_patch.h"
#include "core/engine/engine.h"
#include "core/rollout/rollout_group.h"
#include "core/rollout/update_request.h"
#include "core/transport/checksum.h"
#include "core/transport/group_channel.h"
#include "nlohmann/json.hpp"
#include "tests/engine/engine_test_util.h"
#include "tests/rollout/fake_http.h"
#include "tests/rollout/fake_sglang.h"

namespace wpub::rollout {
namespace {

using engine::Engine;
using engine::EngineComponents;
using engine::EngineOptions;
using engine::PublicationReport;
using engine::PublicationStatus;
using testing::FakeSglang;
using testing::SglangRelease;

// The group's bytes without NCCL: every broadcast is handed to the sinks (the engines' receive
// sides) in order; a watchdog thread fails the publication on a peer's failure or the deadline,
// as NcclTransport's does.
class InprocChannel final : public transport::GroupChannel {
 public:
  using Sink = std::function<void(std::vector<uint8_t>)>;
  struct Shared {
    std::mutex mu;
    std::vector<Sink> sinks;
    int opens = 0;
    // Called at the start of every Begin (on the publication thread, inside the group's Begin).
    std::function<void()> on_begin;
  };
  explicit InprocChannel(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  ~InprocChannel() override { StopWatchdog(); }

  absl::StatusOr<transport::GroupId> NewId() override {
    transport::GroupId id;
    std::random_device rd;
    for (uint8_t& b : id) b = static_cast<uint8_t>(rd());
    return id;
  }
  absl::Status Open(int, const transport::GroupId&, std::function<std::string(int)>) override {
    std::lock_guard lock(mu_);
    open_ = true;
    std::lock_guard s(shared_->mu);
    ++shared_->opens;
    return absl::OkStatus();
  }
  void Close() override {
    std::lock_guard lock(mu_);
    open_ = false;
  }
  bool usable() const override {
    std::lock_guard lock(mu_);
    return open_;
  }
  std::string Describe() const override { return "an in-process channel"; }
  absl::Status WarmUp(absl::Time) override { return absl::OkStatus(); }
  void Begin(transport::PublicationWatch watch) override {
    std::function<void()> hook;
    {
      std::lock_guard s(shared_->mu);
      hook = shared_->on_begin;
    }
    if (hook) hook();
    StopWatchdog();
    {
      std::lock_guard lock(mu_);
      failure_ = absl::OkStatus();
      stop_ = false;
    }
    watch_ = std::move(watch);
    watchdog_ = std::thread([this] {
      std::unique_lock lock(mu_);
      while (!stop_) {
        lock.unlock();
        absl::Status why = absl::OkStatus();
        if (absl::Now() >= watch_.deadline)
          why = absl::DeadlineExceededError(watch_.deadline_message);
        if (why.ok() && watch_.peer_failure) why = watch_.peer_failure();
        if (!why.ok()) Fail(why);
        lock.lock();
        cv_.wait_for(lock, std::chrono::milliseconds(2));
      }
    });
  }
  absl::Status Send(const transport::Bucket& bucket, absl::Span<const uint64_t> chunks) override {
    if (absl::Status f = failure(); !f.ok()) return f;
    EXPECT_EQ(bucket.location, transport::BucketLocation::kHost);
    uint64_t at = 0;
    std::vector<uint64_t> sizes(chunks.begin(), chunks.end());
    if (sizes.empty()) sizes.push_back(bucket.bytes.size());
    std::vector<Sink> sinks;
    {
      std::lock_guard s(shared_->mu);
      sinks = shared_->sinks;
    }
    for (const uint64_t n : sizes) {
      std::vector<uint8_t> chunk(bucket.bytes.begin() + at, bucket.bytes.begin() + at + n);
      for (const Sink& sink : sinks) sink(chunk);
      at += n;
    }
    return absl::OkStatus();
  }
  absl::Status WaitSent(absl::Time) override { return failure(); }
  void End() override { StopWatchdog(); }
  void Fail(absl::Status why) override {
    std::lock_guard lock(mu_);
    if (failure_.ok()) failure_ = std::move(why);
    open_ = false;  // aborted: the next publication re-forms the group
  }
  absl::Status failure() const override {
    std::lock_guard lock(mu_);
    return failure_;
  }

 private:
  void StopWatchdog() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }
  const std::shared_ptr<Shared> shared_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  bool stop_ = true;
  absl::Status failure_;
  transport::PublicationWatch watch_;
  std::thread watchdog_;
};

// A vLLM engine's receive side on the in-process channel: the chunks broadcast since its join.
class ChannelDataPath final : public recv::VllmDataPath {
 public:
  absl::Status Join(const recv::VllmInitInfo&) override {
    std::lock_guard lock(mu_);
    chunks_.clear();  // a new group: nothing of the old one's broadcasts
    aborted_ = false;
    return absl::OkStatus();
  }
  absl::Status Receive(const recv::VllmUpdate& u, std::vector<uint8_t>* bytes) override {
    for (uint64_t expected : u.chunks) {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(10),
                        [&] { return aborted_ || !chunks_.empty(); }) ||
          aborted_) {
        return absl::DeadlineExceededError("no broadcast arrived");
      }
      std::vector<uint8_t> c = std::move(chunks_.front());
      chunks_.pop_front();
      if (c.size() != expected) {
        return absl::DataLossError(absl::StrCat(c.size(), " bytes broadcast, ", expected));
      }
      bytes->insert(bytes->end(), c.begin(), c.end());
    }
    return absl::OkStatus();
  }
  void Abort() override {
    std::lock_guard lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  void Push(std::vector<uint8_t> chunk) {
    std::lock_guard lock(mu_);
    chunks_.push_back(std::move(chunk));
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<uint8_t>> chunks_;
  bool aborted_ = false;
};

struct Daemon {
  std::shared_ptr<InprocChannel::Shared> channel = std::make_shared<InprocChannel::Shared>();
  RolloutGroup* group = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine;

  Daemon(const std::vector<EngineSpec>& engines, absl::Duration deadline = absl::Seconds(20),
         int max_attempts = 3, transport::RetainedCopyOptions retain = {},
         EngineOptions::Patches patches = {}) {
    RolloutGroupOptions o;
    o.store.bind_address = "127.0.0.1";
    o.group_name = "wpub_cpu";
    o.engines = engines;
    o.join_timeout = absl::Seconds(10);
    o.publication_deadline = deadline;
    o.sglang.driver.connect_timeout = absl::Seconds(2);
    o.sglang.driver.request_timeout = absl::Seconds(10);
    o.vllm.driver.connect_timeout = absl::Seconds(2);
    o.vllm.driver.request_timeout = absl::Seconds(10);
    o.vllm.driver.packed_buffer_bytes = 3000;        // several chunks per bucket
    o.engine_watch_interval = absl::ZeroDuration();  // the tests run the watch by hand
    auto g = RolloutGroup::Create(o, std::make_unique<InprocChannel>(channel));
    EXPECT_TRUE(g.ok()) << g.status();
    group = g->get();
    EngineComponents c;
    c.connector = group;
    c.transports.push_back(*std::move(g));
    EngineOptions eo;
    eo.bucket_bytes = 4096;
    eo.min_bucket_bytes = 1024;
    eo.max_attempts = max_attempts;
    eo.retain = retain;
    eo.patches = patches;
    auto e = Engine::Create(eo, nullptr, std::move(c));
    EXPECT_TRUE(e.ok()) << e.status();
    engine = *std::move(e);
  }
  void AddSink(InprocChannel::Sink sink) {
    std::lock_guard lock(channel->mu);
    channel->sinks.push_back(std::move(sink));
  }
  // One publication of the small model (seeded by the version), its report.
  PublicationReport Publish(uint64_t version,
                            const std::function<void(engine::PublicationSession&)>& during = {}) {
    auto session = engine->Open(engine::testing::Header(version));
    EXPECT_TRUE(session.ok()) << session.status();
    EXPECT_TRUE(engine::testing::Send(**session, Batches(version)).ok());
    std::thread side;
    if (during) side = std::thread([&] { during(**session); });
    absl::StatusOr<PublicationReport> r = (*session)->Commit();
    if (side.joinable()) side.join();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : PublicationReport{};
  }
  static std::vector<engine::testing::TestBatch> Batches(uint64_t version) {
    return engine::testing::ModelBatches(synthetic::ModelShape::Tiny(), version);
  }
  // The reports of the replays the engine ran (newest first), once it ran `n` in all.
  std::vector<engine::ReplayReport> WaitForReplays(size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::vector<engine::ReplayReport> r = engine->GetStatus().last_replays;
    while (r.size() < n && absl::Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      r = engine->GetStatus().last_replays;
    }
    return r;
  }
};

std::vector<EngineSpec> Specs(const std::vector<std::unique_ptr<FakeSglang>>& engines) {
  std::vector<EngineSpec> out;
  for (const auto& e : engines) out.push_back({e->url(), 1, "sglang", ""});
  return out;
}

std::vector<std::unique_ptr<FakeSglang>> SglangEngines(int n, SglangRelease release) {
  std::vector<std::unique_ptr<FakeSglang>> out;
  for (int i = 0; i < n; ++i)
    out.push_back(std::make_unique<FakeSglang>(testing::FakeSglangOptions{release}));
  return out;
}

void SetIncoming(const std::vector<std::unique_ptr<FakeSglang>>& engines, uint64_t version) {
  for (const auto& e : engines) e->SetIncoming(std::to_string(version));
}

// Every engine that is alive serves `version` whole, reports it, holds no open session.
void ExpectAllServe(const std::vector<std::unique_ptr<FakeSglang>>& engines, uint64_t version) {
  for (const auto& e : engines) {
    if (e->dead()) continue;
    EXPECT_TRUE(e->serving()) << e->url();
    EXPECT_EQ(e->held_version(), std::to_string(version)) << e->url();
    EXPECT_EQ(e->reported_version(), std::to_string(version)) << e->url();
    EXPECT_FALSE(e->session_open()) << e->url();
    EXPECT_EQ(e->mixed_resumes(), 0) << e->url();
  }
}

std::string Errors(const PublicationReport& r) {
  std::string out = r.error;
  for (const std::string& e : r.retry_errors) absl::StrAppend(&out, " | ", e);
  return out;
}

// `version` published to `engines` and committed on every live one, which serves it whole.
void ExpectCommits(Daemon& d, const std::vector<std::unique_ptr<FakeSglang>>& engines,
                   uint64_t version) {
  SetIncoming(engines, version);
  PublicationReport r = d.Publish(version);
  ASSERT_EQ(r.status, PublicationStatus::kCommitted) << Errors(r);
  ExpectAllServe(engines, version);
}

// vLLM engines (wpub-recv's emulation of vLLM's weight-transfer API) whose receive side is the
// in-process channel: `paths[i]` is owned by `engines[i]`; a stopped engine is null in both.
struct VllmEngines {
  std::vector<std::unique_ptr<recv::VllmEngine>> engines;
  std::vector<ChannelDataPath*> paths;
  // Starts one more engine; its spec for the daemon.
  EngineSpec Start() {
    auto path = std::make_unique<ChannelDataPath>();
    ChannelDataPath* raw = path.get();
    auto e = recv::VllmEngine::Start({}, std::move(path));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    paths.push_back(raw);
    engines.push_back(*std::move(e));
    return {engines.back()->url(), 1, "vllm", ""};
  }
  // Stops engine `i` (a process that exits); its data path goes with it.
  void Stop(size_t i) {
    engines[i].reset();
    paths[i] = nullptr;
  }
  // `d`'s broadcasts reach every live engine's data path, and only those.
  void Feed(Daemon& d) const {
    {
      std::lock_guard lock(d.channel->mu);
      d.channel->sinks.clear();
    }
    for (ChannelDataPath* p : paths) {
      if (p != nullptr) d.AddSink([p](std::vector<uint8_t> c) { p->Push(std::move(c)); });
    }
  }
};

// Every live vLLM engine serves `version`, resumed, no update open, no mix, and holds the CPU
// oracle's bytes of it tensor for tensor.
void ExpectVllmHolds(const std::vector<std::unique_ptr<recv::VllmEngine>>& engines,
                     uint64_t version) {
  const auto want = engine::testing::ExpectedOutputs(
      Daemon::Batches(version), *engine::testing::PlainPolicy(), kernels::QuantMode::Standard());
  for (const auto& e : engines) {
    if (e == nullptr) continue;  // stopped (a restart)
    const recv::VllmEngineState s = e->state();
    EXPECT_FALSE(s.paused) << e->url();
    EXPECT_FALSE(s.updating) << e->url();
    EXPECT_FALSE(s.mixed) << e->url();
    EXPECT_EQ(s.weight_version, std::to_string(version)) << e->url();
    ASSERT_EQ(s.weights.size(), want.size()) << e->url();
    for (const auto& [name, bytes] : want) {
      auto it = s.weights.find(name);
      ASSERT_NE(it, s.weights.end()) << name;
      EXPECT_EQ(it->second.second, bytes) << name;
    }
  }
}

TEST(RolloutGroupCpu, AnSglangLoaderFailureAtBucketKIsRetriedAndCommits) {
  for (const SglangRelease release : {SglangRelease::kV0_5_6, SglangRelease::kV0_5_16}) {
    SCOPED_TRACE(static_cast<int>(release));
    auto engines = SglangEngines(2, release);
    Daemon d(Specs(engines));
    SetIncoming(engines, 1);
    PublicationReport r1 = d.Publish(1);
    ASSERT_EQ(r1.status, PublicationStatus::kCommitted) << Errors(r1);
    ExpectAllServe(engines, 1);
    const int opens = d.channel->opens;
    // Engine 0 fails its second bucket's load (after loading half of it).
    engines[0]->FailUpdateAt(1);
    SetIncoming(engines, 2);
    PublicationReport r2 = d.Publish(2);
    ASSERT_EQ(r2.status, PublicationStatus::kCommitted) << Errors(r2);
    EXPECT_EQ(r2.attempts, 2u);
    ASSERT_EQ(r2.retry_errors.size(), 1u);
    EXPECT_NE(r2.retry_errors[0].find(engines[0]->url()), std::string::npos) << r2.retry_errors[0];
    EXPECT_NE(r2.retry_errors[0].find("POST /update_weights_from_distributed: HTTP 400"),
              std::string::npos)
        << r2.retry_errors[0];
    EXPECT_NE(r2.retry_errors[0].find("Please discard the whole weights"), std::string::npos)
        << r2.retry_errors[0];
    EXPECT_EQ(d.channel->opens, opens + 1) << "the retry re-formed the group";
    ExpectAllServe(engines, 2);
    SetIncoming(engines, 3);
    PublicationReport r3 = d.Publish(3);
    ASSERT_EQ(r3.status, PublicationStatus::kCommitted) << Errors(r3);
    EXPECT_TRUE(r3.retry_errors.empty());
    ExpectAllServe(engines, 3);
    for (const auto& e : engines) EXPECT_FALSE(e->dead()) << e->death();
  }
}

TEST(RolloutGroupCpu, AVllmLoaderFailureIsRetriedAndEveryEngineHoldsTheOraclesBytes) {
  VllmEngines vllm;
  std::vector<EngineSpec> specs;
  for (int i = 0; i < 2; ++i) specs.push_back(vllm.Start());
  auto& engines = vllm.engines;
  Daemon d(specs);
  vllm.Feed(d);
  auto expect_holds = [&](uint64_t version) { ExpectVllmHolds(engines, version); };
  PublicationReport r1 = d.Publish(1);
  ASSERT_EQ(r1.status, PublicationStatus::kCommitted) << Errors(r1);
  expect_holds(1);
  engines[0]->FailUpdateAt(1);  // the loader fails on the second bucket
  PublicationReport r2 = d.Publish(2);
  ASSERT_EQ(r2.status, PublicationStatus::kCommitted) << Errors(r2);
  ASSERT_EQ(r2.retry_errors.size(), 1u);
  EXPECT_NE(r2.retry_errors[0].find("POST /update_weights: HTTP 500"), std::string::npos)
      << r2.retry_errors[0];
  expect_holds(2);
  PublicationReport r3 = d.Publish(3);
  ASSERT_EQ(r3.status, PublicationStatus::kCommitted) << Errors(r3);
  EXPECT_TRUE(r3.error.empty()) << r3.error;
  EXPECT_TRUE(r3.retry_errors.empty());
  expect_holds(3);
}

TEST(RolloutGroupCpu, AnEngineKilledMidPublicationIsLeftOutAndTheRestCommit) {
  auto engines = SglangEngines(3, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines));
  ExpectCommits(d, engines, 1);
  SetIncoming(engines, 2);
  const size_t before = engines[1]->load_formats().size();
  PublicationReport r2 = d.Publish(2, [&](engine::PublicationSession&) {
    // SIGKILL once it loaded two buckets of version 2.
    while (engines[1]->load_formats().size() < before + 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    engines[1]->Kill();
  });
  // The engines that got buckets are dirty: the version is retried without the dead one.
  ASSERT_EQ(r2.status, PublicationStatus::kCommitted) << Errors(r2);
  EXPECT_TRUE(engines[1]->dead());
  ExpectAllServe(engines, 2);
  ExpectCommits(d, engines, 3);
  const engine::RolloutGroupInfo g = d.group->Group();
  ASSERT_EQ(g.engines.size(), 2u);  // re-formed without the dead one
}

TEST(RolloutGroupCpu, ATrainerCancelMidTransferLeavesEveryEngineAbleToTakeTheNext) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines));
  ExpectCommits(d, engines, 1);
  for (auto& e : engines) e->SetDelay(std::chrono::milliseconds(30));
  SetIncoming(engines, 2);
  const size_t before = engines[0]->load_formats().size();
  PublicationReport r2 = d.Publish(2, [&](engine::PublicationSession& s) {
    while (engines[0]->load_formats().size() < before + 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    s.Abort(absl::CancelledError("the trainer cancelled"));
  });
  EXPECT_EQ(r2.status, PublicationStatus::kAborted) << Errors(r2);
  for (auto& e : engines) {
    e->SetDelay(std::chrono::milliseconds(0));
    EXPECT_FALSE(e->session_open()) << e->url();
    EXPECT_FALSE(e->serving()) << e->url() << " holds part of 2 and must stay paused";
    EXPECT_EQ(e->reported_version(), "1");
  }
  const engine::RolloutGroupInfo g = d.group->Group();
  for (const auto& e : g.engines) EXPECT_EQ(e.state, transport::ReceiverState::kDirty) << e.url;
  ExpectCommits(d, engines, 3);
}

// The cancel lands while the group's Begin runs (after it took the publication, before it asked
// the engines to pause and open their session): the Begin still asks them, so the resume is
// owed to the abort that follows on the publication thread -- no engine is left paused or with
// its session open, none took a byte of version 2, and the next version commits.
TEST(RolloutGroupCpu, ACancelWhileTheGroupBeginsResumesTheEnginesItPaused) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines));
  ExpectCommits(d, engines, 1);
  SetIncoming(engines, 2);
  auto session = d.engine->Open(engine::testing::Header(2));
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(engine::testing::Send(**session, Daemon::Batches(2)).ok());
  std::atomic<int> hooked{0};
  {
    std::lock_guard lock(d.channel->mu);
    d.channel->on_begin = [&] {
      if (hooked++ > 0) return;
      // Another thread, as the trainer's cancel arrives: the group's lock is held by this Begin.
      std::thread cancel([&] { (*session)->Abort(absl::CancelledError("the trainer cancelled")); });
      cancel.join();
    };
  }
  const size_t loads_before = engines[0]->load_formats().size();
  absl::StatusOr<PublicationReport> r2 = (*session)->Commit();
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->status, PublicationStatus::kAborted) << Errors(*r2);
  EXPECT_EQ(hooked.load(), 1);
  EXPECT_EQ(engines[0]->load_formats().size(), loads_before) << "no bucket of 2 was sent";
  for (auto& e : engines) {
    EXPECT_FALSE(e->session_open()) << e->url();
    EXPECT_TRUE(e->serving()) << e->url() << " took no byte of 2: resumed on 1";
    EXPECT_EQ(e->reported_version(), "1") << e->url();
    EXPECT_EQ(e->mixed_resumes(), 0) << e->url();
  }
  for (const auto& e : d.group->Group().engines) {
    EXPECT_NE(e.state, transport::ReceiverState::kDirty) << e.url;
  }
  {
    std::lock_guard lock(d.channel->mu);
    d.channel->on_begin = nullptr;
  }
  session->reset();
  ExpectCommits(d, engines, 3);
}

// An abort from another thread (the engine shutting down) lands while Commit waits for the
// engines' end calls: the end calls are their last word -- no resume-after-abort runs beside
// them, drops them or marks the engines dirty -- and the version commits on every engine.
TEST(RolloutGroupCpu, AnAbortDuringTheEndCallsLeavesThemTheEnginesLastWord) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines));
  ExpectCommits(d, engines, 1);
  const size_t per_version = engines[0]->load_formats().size();
  ASSERT_GT(per_version, 0u);
  for (auto& e : engines) e->SetDelay(std::chrono::milliseconds(400), "/end_weight_update");
  SetIncoming(engines, 2);
  PublicationReport r2 = d.Publish(2, [&](engine::PublicationSession&) {
    // Every bucket of 2 loaded: Commit posts the end calls next, each answered 400 ms late.
    while (engines[0]->load_formats().size() < 2 * per_version ||
           engines[1]->load_formats().size() < 2 * per_version) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    d.group->Abort("the engine is shutting down");
  });
  for (auto& e : engines) e->SetDelay(std::chrono::milliseconds(0));
  ASSERT_EQ(r2.status, PublicationStatus::kCommitted) << Errors(r2);
  ExpectAllServe(engines, 2);
  for (const auto& e : d.group->Group().engines) {
    EXPECT_NE(e.state, transport::ReceiverState::kDirty) << e.url;
  }
  ExpectCommits(d, engines, 3);
}

TEST(RolloutGroupCpu, ADeadlinePassedByAStalledEngineFailsInTimeAndTheNextCommits) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines), /*deadline=*/absl::Milliseconds(800));
  ExpectCommits(d, engines, 1);
  // Every update answered later than the deadline.
  engines[1]->SetDelay(std::chrono::milliseconds(1500), "/update_weights_from_distributed");
  SetIncoming(engines, 2);
  const absl::Time t0 = absl::Now();
  PublicationReport r2 = d.Publish(2);
  EXPECT_EQ(r2.status, PublicationStatus::kAborted) << Errors(r2);
  // The watchdog's deadline, or the acknowledgement wait's own at the same instant: both name
  // the deadline's cause.
  const std::string why = Errors(r2);
  EXPECT_TRUE(why.find("did not reach every engine within") != std::string::npos ||
              why.find("engines did not answer in time: " + engines[1]->url()) != std::string::npos)
      << why;
  // Three attempts (the engines got buckets: dirty), each the deadline plus the stalled answer.
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
  engines[1]->SetDelay(std::chrono::milliseconds(0));
  ExpectCommits(d, engines, 3);
  for (const auto& e : engines) EXPECT_FALSE(e->dead()) << e->death();
}

// Restore (--retain host): every attempt of v2 fails (max_attempts 1) after the engines loaded
// part of it; the daemon replays the retained v1 through the real drivers -- SGLang's session
// rules per release -- and every engine serves v1 whole, resumed, its session closed, before
// the trainer publishes again.
TEST(RolloutGroupCpu, SglangEnginesLeftDirtyAreRestoredToTheCommittedVersion) {
  for (const SglangRelease release : {SglangRelease::kV0_5_6, SglangRelease::kV0_5_16}) {
    SCOPED_TRACE(static_cast<int>(release));
    auto engines = SglangEngines(2, release);
    Daemon d(Specs(engines), absl::Seconds(20), /*max_attempts=*/1,
             {.where = transport::RetainWhere::kHost});
    ExpectCommits(d, engines, 1);
    engines[0]->FailUpdateAt(1);
    SetIncoming(engines, 2);
    // The second Begin from now is the restore's: its broadcasts carry v1.
    std::atomic<int> begins{0};
    {
      std::lock_guard lock(d.channel->mu);
      d.channel->on_begin = [&] {
        if (++begins == 2) SetIncoming(engines, 1);
      };
    }
    PublicationReport r2 = d.Publish(2);
    ASSERT_EQ(r2.status, PublicationStatus::kAborted) << Errors(r2);
    const std::vector<engine::ReplayReport> r = d.WaitForReplays(1);
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].kind, engine::ReplayKind::kRestore);
    EXPECT_TRUE(r[0].completed) << r[0].error;
    EXPECT_EQ(r[0].version, 1u);
    EXPECT_EQ(r[0].receivers.size(), 2u);
    ExpectAllServe(engines, 1);
    {
      std::lock_guard lock(d.channel->mu);
      d.channel->on_begin = nullptr;
    }
    ExpectCommits(d, engines, 3);
    for (const auto& e : engines) EXPECT_FALSE(e->dead()) << e->death();
  }
}

// vLLM engines (wpub-recv's emulation of vLLM's weight-transfer API, bytes over the in-process
// channel): a loader failure leaves them dirty, the restore puts v1 back byte for byte; then an
// engine restarted empty joins with ConnectEngines and is caught up to the committed version
// without the trainer publishing.
TEST(RolloutGroupCpu, VllmEnginesAreRestoredByteForByteAndARestartedOneIsCaughtUp) {
  VllmEngines vllm;
  std::vector<EngineSpec> specs;
  for (int i = 0; i < 2; ++i) specs.push_back(vllm.Start());
  auto& engines = vllm.engines;
  Daemon d(specs, absl::Seconds(20), /*max_attempts=*/1, {.where = transport::RetainWhere::kHost});
  vllm.Feed(d);
  auto expect_holds = [&](uint64_t version) { ExpectVllmHolds(engines, version); };
  PublicationReport r1 = d.Publish(1);
  ASSERT_EQ(r1.status, PublicationStatus::kCommitted) << Errors(r1);
  expect_holds(1);
  engines[0]->FailUpdateAt(1);  // the loader fails on the second bucket
  PublicationReport r2 = d.Publish(2);
  ASSERT_EQ(r2.status, PublicationStatus::kAborted) << Errors(r2);
  std::vector<engine::ReplayReport> r = d.WaitForReplays(1);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(r[0].completed) << r[0].error;
  expect_holds(1);

  // Engine 1 restarts (a new process: empty weights, no version) and joins again.
  vllm.Stop(1);
  specs[1] = vllm.Start();
  vllm.Feed(d);
  engine::RolloutConnectRequest join;
  for (const EngineSpec& s : specs) join.engines.push_back({s.url, 1, "vllm"});
  absl::StatusOr<engine::RolloutGroupInfo> g = d.engine->ConnectEngines(join);
  ASSERT_TRUE(g.ok()) << g.status();
  r = d.WaitForReplays(2);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].kind, engine::ReplayKind::kCatchUp);
  EXPECT_TRUE(r[0].completed) << r[0].error;
  EXPECT_EQ(r[0].version, 1u);
  expect_holds(1);
  PublicationReport r3 = d.Publish(3);
  ASSERT_EQ(r3.status, PublicationStatus::kCommitted) << Errors(r3);
  expect_holds(3);
}

// Each engine's pause window in the report: pause answered .. resume answered, split where the
// time went. Engine 0 takes 30 ms to load each bucket, engine 1 150 ms to end its session; an
// aborted version leaves the dirty engines paused, their windows open.
TEST(RolloutGroupCpu, EachEnginesPauseWindowSaysWhereItsTimeWent) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  engines[0]->SetDelay(std::chrono::milliseconds(30), "/update_weights_from_distributed");
  engines[1]->SetDelay(std::chrono::milliseconds(150), "/end_weight_update");
  Daemon d(Specs(engines), absl::Seconds(20), /*max_attempts=*/1);
  SetIncoming(engines, 1);
  const PublicationReport r = d.Publish(1);
  ASSERT_EQ(r.status, PublicationStatus::kCommitted) << Errors(r);
  ASSERT_EQ(r.receivers.size(), 2u);
  for (const transport::ReceiverOutcome& o : r.receivers) {
    SCOPED_TRACE(o.name);
    EXPECT_EQ(o.family, "sglang");
    EXPECT_TRUE(o.pause.paused);
    EXPECT_TRUE(o.pause.resumed);
    EXPECT_NEAR(o.pause.waiting + o.pause.transfer + o.pause.finalization, o.pause.seconds, 1e-9);
    EXPECT_GE(o.pause.waiting, 0);
    EXPECT_LE(o.pause.seconds, r.wall_seconds);
  }
  const transport::ReceiverOutcome& slow_loads =
      r.receivers[0].name == engines[0]->url() ? r.receivers[0] : r.receivers[1];
  const transport::ReceiverOutcome& slow_end =
      r.receivers[0].name == engines[1]->url() ? r.receivers[0] : r.receivers[1];
  // Every bucket's answer took 30 ms: the first is answered 30 ms after it was sent at least.
  EXPECT_GE(slow_loads.pause.transfer, 0.030);
  EXPECT_GE(slow_end.pause.finalization, 0.150);
  EXPECT_LT(slow_end.pause.transfer, slow_loads.pause.transfer);
  ExpectAllServe(engines, 1);

  // v2 fails at engine 0's second bucket: both engines loaded some of it and stay paused.
  engines[0]->FailUpdateAt(1);
  SetIncoming(engines, 2);
  const PublicationReport r2 = d.Publish(2);
  ASSERT_EQ(r2.status, PublicationStatus::kAborted) << Errors(r2);
  for (const transport::ReceiverOutcome& o : r2.receivers) {
    SCOPED_TRACE(o.name);
    EXPECT_TRUE(o.dirty);
    EXPECT_TRUE(o.pause.paused);
    EXPECT_FALSE(o.pause.resumed);
    EXPECT_NEAR(o.pause.waiting + o.pause.transfer + o.pause.finalization, o.pause.seconds, 1e-9);
  }
  SetIncoming(engines, 3);
  ExpectCommits(d, engines, 3);
}

// The pause policy of an engine set (ConnectEngines' `pause`, else the daemon's): each family
// carries it out with its own routes, a policy it cannot carry out is refused before any engine
// is contacted (the connected set stays and keeps committing), and the group reports each
// engine's policy as its family resolved it.
TEST(RolloutGroupCpu, EachEngineSetsPausePolicyIsCarriedOutOrRefusedUpFront) {
  using P = engine::PausePolicy;
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines));
  // The default, abort:flush: in-flight requests end, the cache goes after the update.
  engines[0]->SetWaitingRequests(4);
  ExpectCommits(d, engines, 1);
  EXPECT_EQ(engines[0]->last_pause_mode(), "abort");
  for (const engine::RolloutEngineInfo& e : d.group->Group().engines) {
    EXPECT_EQ(engine::PausePolicyName(e.pause), "abort:flush");
  }
  engine::RolloutConnectRequest request;
  for (const auto& e : engines) request.engines.push_back({e->url(), 1, "sglang"});
  const auto connect = [&](P policy) {
    request.pause = policy;
    return d.group->Connect(request);
  };
  // SGLang has no mode that lets in-flight requests finish, and refuses a flush while retracted
  // requests wait: both refused naming the policy and the family; the group stays and commits.
  for (const P refused :
       {P{P::InFlight::kWait, P::Cache::kDefault}, P{P::InFlight::kRetract, P::Cache::kFlush},
        P{P::InFlight::kKeep, P::Cache::kFlush}}) {
    absl::StatusOr<engine::RolloutGroupInfo> g = connect(refused);
    ASSERT_TRUE(absl::IsInvalidArgument(g.status())) << g.status();
    EXPECT_NE(g.status().message().find("for sglang engines"), std::string::npos) << g.status();
  }
  EXPECT_TRUE(d.group->Group().healthy);
  ExpectCommits(d, engines, 2);
  // retract (its cache kept, as SGLang can): the retracted requests wait through the update,
  // and no flush is asked for.
  absl::StatusOr<engine::RolloutGroupInfo> g = connect({P::InFlight::kRetract, P::Cache::kDefault});
  ASSERT_TRUE(g.ok()) << g.status();
  for (const engine::RolloutEngineInfo& e : g->engines) {
    EXPECT_EQ(engine::PausePolicyName(e.pause), "retract:keep");
  }
  engines[0]->SetWaitingRequests(4);
  SetIncoming(engines, 3);
  PublicationReport r = d.Publish(3);
  ASSERT_EQ(r.status, PublicationStatus::kCommitted) << Errors(r);
  EXPECT_EQ(engines[0]->last_pause_mode(), "retract");
  for (const transport::ReceiverOutcome& o : r.receivers) EXPECT_TRUE(o.error.empty()) << o.error;
  ExpectAllServe(engines, 3);

  // vLLM: keep (frozen with their KV: clear_cache=false), retract (mode keep with the cache
  // cleared), and keep:flush refused (clearing the cache in mode keep is retract).
  VllmEngines vllm;
  Daemon v({vllm.Start()});
  vllm.Feed(v);
  engine::RolloutConnectRequest vr;
  vr.engines.push_back({vllm.engines[0]->url(), 1, "vllm"});
  vr.pause = P{P::InFlight::kKeep, P::Cache::kFlush};
  absl::StatusOr<engine::RolloutGroupInfo> vg = v.group->Connect(vr);
  ASSERT_TRUE(absl::IsInvalidArgument(vg.status())) << vg.status();
  EXPECT_NE(vg.status().message().find("retract:flush"), std::string::npos) << vg.status();
  const std::pair<P, bool> cases[] = {{P{P::InFlight::kKeep, P::Cache::kDefault}, false},
                                      {P{P::InFlight::kRetract, P::Cache::kDefault}, true}};
  uint64_t version = 1;
  for (const auto& [policy, clears] : cases) {
    vr.pause = policy;
    vg = v.group->Connect(vr);
    ASSERT_TRUE(vg.ok()) << vg.status();
    vllm.Feed(v);
    PublicationReport vr_report = v.Publish(version);
    ASSERT_EQ(vr_report.status, PublicationStatus::kCommitted) << Errors(vr_report);
    ExpectVllmHolds(vllm.engines, version++);
    EXPECT_EQ(vllm.engines[0]->state().pause_mode, "keep");
    EXPECT_EQ(vllm.engines[0]->state().pause_clear_cache, clears);
  }
}

// An SGLang engine that restarts between publications comes back on its start-up checkpoint,
// out of the NCCL group: the engine watch finds it (healthy, reporting less than it was given),
// the group re-forms with it and it is caught up from the retained copy -- before the trainer's
// next version, and without disturbing the watch's next round.
TEST(RolloutGroupCpu, AnEngineRestartedBetweenPublicationsIsCaughtUpByTheWatch) {
  auto engines = SglangEngines(2, SglangRelease::kV0_5_16);
  Daemon d(Specs(engines), absl::Seconds(20), /*max_attempts=*/3,
           {.where = transport::RetainWhere::kHost});
  ExpectCommits(d, engines, 1);
  EXPECT_TRUE(d.group->WatchEnginesOnce().empty());  // both report v1: nothing to do
  engines[1]->Restart();
  ASSERT_EQ(engines[1]->reported_version(), "");
  SetIncoming(engines, 1);  // a catch-up carries the committed version
  EXPECT_EQ(d.group->WatchEnginesOnce(), std::vector<std::string>{engines[1]->url()});
  const std::vector<engine::ReplayReport> r = d.WaitForReplays(1);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].kind, engine::ReplayKind::kCatchUp);
  EXPECT_TRUE(r[0].completed) << r[0].error;
  EXPECT_NE(r[0].trigger.find("came back holding"), std::string::npos) << r[0].trigger;
  ExpectAllServe(engines, 1);
  EXPECT_TRUE(d.group->WatchEnginesOnce().empty());  // caught up: no second catch-up
  EXPECT_EQ(d.engine->GetStatus().last_replays.size(), 1u);
  // A killed engine is not "back", but the watch has the next publication re-form the group
  // without it: the version is not lost to a pause request the dead engine cannot answer.
  engines[0]->Kill();
  EXPECT_TRUE(d.group->WatchEnginesOnce().empty());
  ExpectCommits(d, engines, 2);
  EXPECT_EQ(d.group->Group().engines.size(), 1u);
  EXPECT_TRUE(d.group->WatchEnginesOnce().empty());  // still down: nothing to do
  // The engine left out comes back (a restarted process, its start-up checkpoint): the watch
  // shows it behind and the group re-forms with it; it is caught up to v2 without a
  // publication, and the next version reaches both.
  engines[0]->Restart();
  SetIncoming(engines, 2);
  EXPECT_EQ(d.group->WatchEnginesOnce(), std::vector<std::string>{engines[0]->url()});
  const std::vector<engine::ReplayReport> again = d.WaitForReplays(2);
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[0].kind, engine::ReplayKind::kCatchUp);  // the newest first
  EXPECT_TRUE(again[0].completed) << again[0].error;
  EXPECT_EQ(again[0].version, 2u);
  ExpectAllServe(engines, 2);
  EXPECT_EQ(d.group->Group().engines.size(), 2u);
  EXPECT_TRUE(d.group->WatchEnginesOnce().empty());  // in the group again, holding v2
  ExpectCommits(d, engines, 3);
}

// wpub-recv's NCCL engine with --engine_patches (clients/recv/nccl/receiver_endpoint.cc and
// bucket_receiver.cc, ReceiveKept, at 9626607: this project's own engine, modelled route for
// route; every answer as its Reply writes it -- 200 or 400, {"success", "message"} with the
// status's message) on the in-process channel: its server info lists "wpub_bucket_patches": [3],
// /get_model_info reports the last announced version; every bucket it receives is kept by its
// wpub_sequence (a request without one is refused, its broadcast taken); an update request with
// "wpub_patch" takes a format 3 patch broadcast and applies it to the kept bucket when that
// bucket's checksum is the patch's base (answering 400 success=false otherwise, the broadcast
// taken), keeping the result only when it has the target's checksum. `takes_patches` false: the
// same engine without
// --engine_patches (no kept weights, no /get_model_info; its whole buckets are kept here only
// for the test's comparison).
class KeptWeightsEngine {
 public:
  explicit KeptWeightsEngine(bool takes_patches) : takes_patches_(takes_patches) {
    httplib::Server& s = http_.server();
    s.Get("/health", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"ok": true})", "application/json");
    });
    s.Get("/flush_cache",
          [](const httplib::Request&, httplib::Response& r) { Reply(r, absl::OkStatus()); });
    s.Get("/server_info", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(takes_patches_ ? R"({"version": "wpub-recv", "wpub_bucket_versions": true, )"
                                     R"("wpub_bucket_patches": [3]})"
                                   : R"({"version": "wpub-recv", "wpub_bucket_versions": true})",
                    "application/json");
    });
    s.Post("/update_weights_from_distributed",
           [this](const httplib::Request& q, httplib::Response& r) { Reply(r, Update(q.body)); });
    if (takes_patches_) {
      s.Get("/get_model_info", [this](const httplib::Request&, httplib::Response& r) {
        std::lock_guard lock(mu_);
        nlohmann::json j = {{"model_path", "wpub-recv"}};
        j["weight_version"] = version_.empty() ? nlohmann::json(nullptr) : nlohmann::json(version_);
        r.set_content(j.dump(), "application/json");
      });
    }
    s.Post("/update_weight_version", [this](const httplib::Request& q, httplib::Response& r) {
      const nlohmann::json j = nlohmann::json::parse(q.body, nullptr, false);
      std::lock_guard lock(mu_);
      if (j.is_object()) version_ = j.value("new_version", std::string());
      Reply(r, absl::OkStatus());
    });
    // A new group: nothing of the old one's broadcasts (an aborted group's never arrive).
    s.Post("/init_weights_update_group", [this](const httplib::Request&, httplib::Response& r) {
      std::lock_guard lock(mu_);
      chunks_.clear();
      Reply(r, absl::OkStatus());
    });
    for (const char* path :
         {"/destroy_weights_update_group", "/pause_generation", "/begin_weight_update",
          "/end_weight_update", "/continue_generation", "/flush_cache"}) {
      s.Post(path,
             [](const httplib::Request&, httplib::Response& r) { Reply(r, absl::OkStatus()); });
    }
    for (const char* path :
         {"/init_weights_update_group", "/destroy_weights_update_group",
          "/update_weights_from_distributed", "/update_weight_version", "/pause_generation",
          "/begin_weight_update", "/end_weight_update", "/continue_generation"}) {
      s.Get(path, [](const httplib::Request&, httplib::Response& r) { r.status = 405; });
    }
    http_.Start();
  }
  std::string url() const { return http_.url(); }
  EngineSpec spec() const { return {url(), 1, "sglang", ""}; }
  // A broadcast of the channel (its sink).
  void Push(std::vector<uint8_t> chunk) {
    std::lock_guard lock(mu_);
    chunks_.push_back(std::move(chunk));
    cv_.notify_all();
  }
  std::vector<std::vector<uint8_t>> kept() const {
    std::lock_guard lock(mu_);
    return kept_;
  }
  std::string version() const {
    std::lock_guard lock(mu_);
    return version_;
  }
  uint64_t patched() const { return patched_.load(); }
  uint64_t refused() const { return refused_.load(); }
  // Bucket `index` of the kept weights changes under the engine (memory it does not verify).
  void Corrupt(size_t index) {
    std::lock_guard lock(mu_);
    kept_.at(index).at(0) ^= 1;
  }

 private:
  static void Reply(httplib::Response& r, const absl::Status& s) {
    r.status = s.ok() ? 200 : 400;
    r.set_content(
        nlohmann::json({{"success", s.ok()},
                        {"message", s.ok() ? std::string("ok") : std::string(s.message())}})
            .dump(),
        "application/json");
  }
  absl::Status Update(const std::string& body) {
    WPUB_ASSIGN_OR_RETURN(UpdateRequest u, DecodeUpdateRequest(body));
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(10), [&] { return !chunks_.empty(); })) {
      return absl::DeadlineExceededError("no broadcast arrived");
    }
    std::vector<uint8_t> got = std::move(chunks_.front());
    chunks_.pop_front();
    // The bucket's index: wpub_sequence, which wpubd sends engines that take patches.
    if (u.fields.sequence < 0 && takes_patches_) {
      return absl::FailedPreconditionError("an engine that keeps its weights needs wpub_sequence");
    }
    // Without a sequence (the engine without --engine_patches: kept here for the comparison
    // only) each version's requests count from 0; its comparisons involve no retries.
    if (u.fields.weight_version != receiving_) {
      receiving_ = u.fields.weight_version;
      index_ = 0;
    }
    const size_t i = u.fields.sequence >= 0 ? static_cast<size_t>(u.fields.sequence) : index_;
    index_ = i + 1;
    if (kept_.size() <= i) kept_.resize(i + 1);
    if (!u.fields.patch.has_value()) {
      if (got.size() != u.nbytes) return absl::DataLossError("the broadcast's size");
      kept_[i] = std::move(got);
      return absl::OkStatus();
    }
    const UpdatePatch& p = *u.fields.patch;
    if (got.size() != p.bytes) return absl::DataLossError("the patch broadcast's size");
    if (!takes_patches_ ||
        transport::Checksum(kept_[i].data(), kept_[i].size()) != p.base_checksum) {
      ++refused_;
      return absl::FailedPreconditionError(absl::StrCat(
          "version ", u.fields.weight_version, " bucket ", i, ": a patch against v", p.base_version,
          takes_patches_ ? ", whose bucket this engine does not hold"
                         : ": this engine keeps no weights (wpub-recv --engine_patches)"));
    }
    absl::StatusOr<std::vector<uint8_t>> next =
        delta::ApplyBucketPatch(got, kept_[i], {.base_checksum = p.base_checksum});
    if (!next.ok()) return next.status();
    if (transport::Checksum(next->data(), next->size()) != p.target_checksum) {
      return absl::DataLossError("the patched bucket is not the target");
    }
    kept_[i] = *std::move(next);
    ++patched_;
    return absl::OkStatus();
  }

  const bool takes_patches_;
  testing::LocalHttpServer http_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<uint8_t>> chunks_;
  std::vector<std::vector<uint8_t>> kept_;
  std::string receiving_, version_;
  size_t index_ = 0;
  std::atomic<uint64_t> patched_{0}, refused_{0};
};

PublicationReport PublishStepped(Daemon& d, uint64_t version) {
  auto session = d.engine->Open(engine::testing::Header(version));
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return {};
  EXPECT_TRUE(engine::testing::Send(**session, engine::testing::SteppedBatches(
                                                   synthetic::ModelShape::Tiny(), 1, version))
                  .ok());
  absl::StatusOr<PublicationReport> r = (*session)->Commit();
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : PublicationReport{};
}

// Engines that keep their weights and take patches get, after the first version, each bucket as
// its patch against the committed version, and hold every version exactly as an engine that
// got it whole (a daemon without patches beside, the same versions); every --patches_full_every
// -th version goes whole; the patches are a small share of the bytes.
TEST(RolloutGroupCpu, EnginesThatKeepTheirWeightsGetPatchesAndHoldEveryVersionExactly) {
  std::vector<std::unique_ptr<KeptWeightsEngine>> engines;
  for (int i = 0; i < 2; ++i) engines.push_back(std::make_unique<KeptWeightsEngine>(true));
  Daemon d({engines[0]->spec(), engines[1]->spec()}, absl::Seconds(20), /*max_attempts=*/1,
           {.where = transport::RetainWhere::kHost},
           {.enabled = true, .full_every = 3, .max_patch_fraction = 0.5});
  for (const auto& e : engines) d.AddSink([p = e.get()](std::vector<uint8_t> c) { p->Push(c); });
  KeptWeightsEngine reference(false);
  Daemon whole({reference.spec()}, absl::Seconds(20), 1, {.where = transport::RetainWhere::kHost});
  whole.AddSink([p = &reference](std::vector<uint8_t> c) { p->Push(std::move(c)); });
  // full_every 3: v1 (no base) and v4 (the third in a row) go whole.
  for (uint64_t v = 1; v <= 5; ++v) {
    SCOPED_TRACE(absl::StrCat("v", v));
    const PublicationReport r = PublishStepped(d, v);
    ASSERT_EQ(r.status, PublicationStatus::kCommitted) << Errors(r);
    const PublicationReport w = PublishStepped(whole, v);
    ASSERT_EQ(w.status, PublicationStatus::kCommitted) << Errors(w);
    const EnginePatchStats p = d.group->last_patches();
    if (v == 1 || v == 4) {
      EXPECT_EQ(p.base_version, 0u);
      EXPECT_EQ(p.patched_buckets, 0u);
    } else {
      EXPECT_EQ(p.base_version, v - 1);
      EXPECT_GT(p.patched_buckets, 0u);
      EXPECT_LT(p.patch_bytes * 4, p.patched_bucket_bytes) << "patches of a few bytes each";
    }
    for (const auto& e : engines) {
      EXPECT_EQ(e->version(), std::to_string(v));
      EXPECT_EQ(e->kept(), reference.kept()) << "the patched engine's weights differ";
      EXPECT_EQ(e->refused(), 0u);
    }
  }
  EXPECT_GT(engines[0]->patched(), 0u);
  EXPECT_EQ(reference.patched(), 0u);
}

// An engine whose copy of a bucket is not the base refuses its patch (taking the broadcast); the
// version is retried whole on the engines it left dirty and commits, and the next is patched
// again. An engine set with one engine that takes no patches gets whole versions.
TEST(RolloutGroupCpu, AnEngineWithoutThePatchBaseIsRetriedWholeAndPatchedAgainAfter) {
  std::vector<std::unique_ptr<KeptWeightsEngine>> engines;
  for (int i = 0; i < 2; ++i) engines.push_back(std::make_unique<KeptWeightsEngine>(true));
  Daemon d({engines[0]->spec(), engines[1]->spec()}, absl::Seconds(20), /*max_attempts=*/3,
           {.where = transport::RetainWhere::kHost}, {.enabled = true, .full_every = 0});
  for (const auto& e : engines) d.AddSink([p = e.get()](std::vector<uint8_t> c) { p->Push(c); });
  ASSERT_EQ(PublishStepped(d, 1).status, PublicationStatus::kCommitted);
  const std::vector<std::vector<uint8_t>> v1 = engines[0]->kept();
  ASSERT_EQ(engines[1]->kept(), v1);
  engines[1]->Corrupt(0);
  const PublicationReport r2 = PublishStepped(d, 2);
  ASSERT_EQ(r2.status, PublicationStatus::kCommitted) << Errors(r2);
  EXPECT_EQ(r2.attempts, 2u) << Errors(r2);
  // The first attempt's error names the engine, the bucket and why.
  ASSERT_EQ(r2.retry_errors.size(), 1u) << Errors(r2);
  EXPECT_NE(r2.retry_errors[0].find(engines[1]->url()), std::string::npos) << Errors(r2);
  EXPECT_NE(r2.retry_errors[0].find("bucket 0: a patch against v1, whose bucket this engine does "
                                    "not hold"),
            std::string::npos)
      << Errors(r2);
  EXPECT_EQ(engines[1]->refused(), 1u);
  EXPECT_EQ(d.group->last_patches().patched_buckets, 0u) << "the retry goes whole";
  EXPECT_EQ(engines[0]->kept(), engines[1]->kept());
  const PublicationReport r3 = PublishStepped(d, 3);
  ASSERT_EQ(r3.status, PublicationStatus::kCommitted) << Errors(r3);
  EXPECT_GT(d.group->last_patches().patched_buckets, 0u);
  EXPECT_EQ(engines[0]->kept(), engines[1]->kept());

  KeptWeightsEngine plain(false);
  KeptWeightsEngine keeps(true);
  Daemon mixed({plain.spec(), keeps.spec()}, absl::Seconds(20), 1,
               {.where = transport::RetainWhere::kHost}, {.enabled = true, .full_every = 0});
  for (KeptWeightsEngine* e : {&plain, &keeps}) mixed.AddSink([e](auto c) { e->Push(c); });
  for (uint64_t v = 1; v <= 3; ++v) {
    ASSERT_EQ(PublishStepped(mixed, v).status, PublicationStatus::kCommitted);
    EXPECT_EQ(mixed.group->last_patches().patched_buckets, 0u);
    EXPECT_EQ(plain.kept(), keeps.kept());
  }
}

}  // namespace
}  // namespace wpub::rollout
