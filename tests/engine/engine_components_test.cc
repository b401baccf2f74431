// Engines built with custom components (the GPU path's plug points): an extra transport driven
// next to the pull transport, with injected faults, a backend decorator that reports host
// synchronizations, and a backend that emits device buckets (as the GPU backend does).
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <functional>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"

#include "core/engine/cpu_backend.h"
#include "core/engine/engine.h"
#include "core/metrics/metrics.h"
#include "core/transport/testing/inproc_receiver.h"
#include "core/transport/transport_group.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

// A push-style transport double: one pretend engine that "receives" every bucket; faults on
// request.
class FakeTransport final : public transport::Transport {
 public:
  struct Log {
    std::mutex mu;
    std::vector<std::string> calls;
    uint64_t bytes = 0;
    std::set<const void*> dones;  // the `done` events of the device buckets it was given
  };
  // `device`: also takes device buckets (like the rollout group); it logs "device <index>" for
  // each.
  FakeTransport(Log* log, bool fail_wait, bool device = false)
      : log_(log), fail_wait_(fail_wait), device_(device) {}

  transport::TransportCapabilities capabilities() const override {
    transport::TransportCapabilities c;
    c.name = "fake";
    c.accepts = device_ ? transport::kHostOrDevice : transport::kHostOnly;
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest& m) override {
    Record("begin " + std::to_string(m.version));
    return std::vector<std::string>{"fake-engine"};
  }
  absl::Status Send(std::shared_ptr<const transport::Bucket> bucket) override {
    std::lock_guard lock(log_->mu);
    if (bucket->location == transport::BucketLocation::kDevice) {
      if (!device_) return absl::InternalError("a device bucket reached a host-only transport");
      log_->bytes += bucket->manifest.nbytes;
      log_->calls.push_back("device " + std::to_string(bucket->manifest.index));
      log_->dones.insert(bucket->device.done);
      return absl::OkStatus();
    }
    log_->bytes += bucket->bytes.size();
    return absl::OkStatus();
  }
  absl::Status WaitAcknowledged(absl::Time) override {
    Record("wait");
    if (fail_wait_) {
      failed_ = true;
      return absl::AbortedError("fake-engine: update_weights_from_distributed returned 500");
    }
    return absl::OkStatus();
  }
  absl::Status Commit() override {
    Record("commit");
    return absl::OkStatus();
  }
  void Abort(absl::string_view reason) override { Record("abort " + std::string(reason)); }
  std::vector<transport::ReceiverOutcome> Outcomes() const override {
    transport::ReceiverOutcome o;
    o.name = "fake-engine";
    if (failed_) {
      o.failure = transport::ReceiverFailure::kProtocol;
      o.error = "fake-engine: update_weights_from_distributed returned 500";
    }
    return {o};
  }
  std::vector<transport::ReceiverInfo> Receivers() const override {
    return {
        transport::ReceiverInfo{"fake-engine", transport::ReceiverState::kIdle, 0, absl::Now()}};
  }

 private:
  void Record(std::string s) {
    std::lock_guard lock(log_->mu);
    log_->calls.push_back(std::move(s));
  }
  Log* log_;
  bool fail_wait_;
  bool device_;
  std::atomic<bool> failed_{false};
};

// Wraps the CPU backend and reports two host synchronizations per publication, as the GPU
// backend would.
class SyncingBackend final : public Backend {
 public:
  std::string_view name() const override { return "syncing-cpu"; }
  absl::StatusOr<ExecutionResult> Execute(const ExecutionPlan& plan,
                                          const ExecutionHooks& hooks) override {
    hooks.syncs->Add(2);
    return inner_->Execute(plan, hooks);
  }

 private:
  std::unique_ptr<CpuBackend> inner_ = *CpuBackend::Create({});
};

TEST(EngineComponentsTest, ExtraTransportAndBackendTakePartInEveryPublication) {
  FakeTransport::Log log;
  EngineComponents components;
  components.backend = std::make_unique<SyncingBackend>();
  components.transports.push_back(std::make_unique<FakeTransport>(&log, false));
  prometheus::Registry registry;
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  auto metrics = metrics::EngineMetrics::Create(&registry);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto engine = Engine::Create(options, metrics->get(), std::move(components));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto receiver =
      transport::testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "pull"});
  ASSERT_TRUE(receiver.ok());

  auto session = (*engine)->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  EXPECT_EQ(report->host_syncs, 2u);
  EXPECT_EQ(report->receivers.size(), 2u);
  EXPECT_EQ(log.bytes, report->bytes_out);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"begin 1", "wait", "commit"}));
  EXPECT_EQ((*engine)->GetStatus().backend, "syncing-cpu");
  EXPECT_EQ((*engine)->GetStatus().receivers.size(), 2u);
  ASSERT_TRUE((*receiver)->WaitForOutcome(1, absl::Seconds(10)));
  EXPECT_EQ((*receiver)->committed_version(), 1u);
  for (const auto& family : registry.Collect()) {
    if (family.name == "wpub_host_syncs_total") {
      EXPECT_EQ(family.metric[0].counter.value, 2);
    }
  }
}

// Counts ReleaseMemory calls and whether one came while its transports still held a bucket.
class ReleasingBackend final : public Backend {
 public:
  explicit ReleasingBackend(FakeTransport::Log* log) : log_(log) {}
  std::string_view name() const override { return "releasing-cpu"; }
  absl::StatusOr<ExecutionResult> Execute(const ExecutionPlan& plan,
                                          const ExecutionHooks& hooks) override {
    held_ = 4096;  // as the GPU backend's buffers grow to the buckets
    return inner_->Execute(plan, hooks);
  }
  uint64_t held_bytes() const override { return held_.load(); }
  uint64_t ReleaseMemory() override {
    held_ = 0;
    ++releases;
    if (still_active) active_at_release.push_back(still_active());
    // The publication's transports have ended it (committed or aborted) by now.
    std::lock_guard lock(log_->mu);
    calls_at_release = log_->calls;
    return 4096;
  }
  std::atomic<int> releases{0};
  std::vector<std::string> calls_at_release;
  // Whether the publication still held the engine's slot at each release (no queued Open can
  // have begun its Execute beside it).
  std::function<bool()> still_active;
  std::vector<bool> active_at_release;

 private:
  FakeTransport::Log* log_;
  std::unique_ptr<CpuBackend> inner_ = *CpuBackend::Create({});
  std::atomic<uint64_t> held_{0};
};

// --release_gpu_memory: the backend frees its memory after every publication, once the
// transports committed it, and not at all without the option; a publication whose header asks
// (PublicationHeader.release_gpu_memory) has it freed after that publication only, also when it
// ends before its Commit (aborted while the trainer sends). Each release comes before the
// publication gives up the engine's slot.
TEST(EngineComponentsTest, TheBackendReleasesItsMemoryAfterEachPublicationWhenAsked) {
  // never; every publication (the option); v2's header asks; v2's header asks and v2 is aborted
  for (int mode : {0, 1, 2, 3}) {
    const bool release = mode == 1;
    FakeTransport::Log log;
    EngineComponents components;
    auto backend = std::make_unique<ReleasingBackend>(&log);
    ReleasingBackend* b = backend.get();
    components.backend = std::move(backend);
    components.transports.push_back(std::make_unique<FakeTransport>(&log, false));
    prometheus::Registry registry;
    EngineOptions options;
    options.bucket_bytes = 4096;
    options.min_bucket_bytes = 1024;
    options.release_backend_memory = release;
    auto metrics = metrics::EngineMetrics::Create(&registry);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    auto engine = Engine::Create(options, metrics->get(), std::move(components));
    ASSERT_TRUE(engine.ok()) << engine.status();
    b->still_active = [&] { return (*engine)->GetStatus().active.has_value(); };
    for (uint64_t v = 1; v <= 3; ++v) {
      PublicationHeader header = testing::Header(v);
      header.release_backend_memory = mode >= 2 && v == 2;
      auto session = (*engine)->Open(header);
      ASSERT_TRUE(session.ok());
      ASSERT_TRUE(
          testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), v)).ok());
      if (mode == 3 && v == 2) {
        (*session)->Abort(absl::CancelledError("the trainer stopped"));
        EXPECT_EQ(b->releases.load(), 1) << "released when the aborted publication ended";
        continue;
      }
      auto report = (*session)->Commit();
      ASSERT_TRUE(report.ok());
      EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
    }
    EXPECT_EQ(b->releases.load(), mode == 0 ? 0 : mode == 1 ? 3 : 1) << "mode " << mode;
    EXPECT_EQ(b->active_at_release, std::vector<bool>(b->releases.load(), true))
        << "mode " << mode << ": a release after the publication gave up its slot";
    // What it keeps between publications is in the status (and wpub_backend_held_bytes): v3
    // grew it again unless every publication releases.
    EXPECT_EQ((*engine)->GetStatus().backend_held_bytes, release ? 0u : 4096u) << "mode " << mode;
    if (mode == 1 || mode == 2) {
      ASSERT_FALSE(b->calls_at_release.empty());
      EXPECT_EQ(b->calls_at_release.back(), "commit") << "released before the commit";
    }
  }
}

TEST(EngineComponentsTest, AFailingExtraTransportAbortsThePullReceiversToo) {
  FakeTransport::Log log;
  EngineComponents components;
  components.transports.push_back(std::make_unique<FakeTransport>(&log, true));
  auto engine = Engine::Create(EngineOptions{}, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok());
  auto receiver =
      transport::testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "pull"});
  ASSERT_TRUE(receiver.ok());
  auto session = (*engine)->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kAborted);
  EXPECT_NE(report->error.find("fake-engine"), std::string::npos) << report->error;
  ASSERT_TRUE((*receiver)->WaitForOutcome(1, absl::Seconds(10)));
  EXPECT_EQ((*receiver)->aborted_versions(), std::vector<uint64_t>{1});
  EXPECT_EQ((*engine)->GetStatus().committed_version, 0u);
  ASSERT_GE(log.calls.size(), 3u);
  EXPECT_EQ(log.calls.back().rfind("abort", 0), 0u);
}

// Emits every bucket as a device bucket, as the GPU backend does (its "device memory" is the
// CPU backend's host bucket), with `readers` reader events (stand-ins: distinct addresses, never
// dereferenced) and a host copy that counts how often it is asked for.
class DeviceBucketBackend final : public Backend {
 public:
  explicit DeviceBucketBackend(size_t readers = 1) : readers_(readers) {}
  std::string_view name() const override { return "device-cpu"; }
  CUevent_st* event(size_t r) { return reinterpret_cast<CUevent_st*>(&events_[r]); }
  absl::StatusOr<ExecutionResult> Execute(const ExecutionPlan& plan,
                                          const ExecutionHooks& hooks) override {
    ExecutionHooks inner = hooks;
    inner.emit = [&](std::shared_ptr<const transport::Bucket> host) -> absl::Status {
      auto device = std::make_shared<transport::Bucket>();
      device->version = host->version;
      device->manifest = host->manifest;
      device->manifest.checksum = 0;  // on the device until the end, as in the GPU backend
      device->location = transport::BucketLocation::kDevice;
      device->device.data = host->bytes.data();
      for (size_t r = 0; r < readers_; ++r) device->device.reader_done[r] = event(r);
      device->device.done = device->device.reader_done[0];
      device->device.copy_to_host =
          [this, host]() -> absl::StatusOr<std::shared_ptr<const transport::Bucket>> {
        ++copies;
        return host;
      };
      return hooks.emit(std::move(device));
    };
    return inner_->Execute(plan, inner);
  }
  std::atomic<int> copies{0};

 private:
  const size_t readers_;
  std::array<char, transport::kMaxDeviceReaders> events_{};
  std::unique_ptr<CpuBackend> inner_ = *CpuBackend::Create({});
};

// One road for every bucket: a device bucket reaches the transport that reads device memory
// as it is, and the pull transport's receivers through one host copy per bucket, made only
// when they take part; the publication commits promptly either way and bytes_out counts each
// bucket once.
TEST(EngineComponentsTest, DeviceBucketsReachEveryTransportInALocationItAccepts) {
  FakeTransport::Log log;
  auto fake = std::make_unique<FakeTransport>(&log, false, /*device=*/true);
  auto backend = std::make_unique<DeviceBucketBackend>();
  DeviceBucketBackend* device_backend = backend.get();
  EngineComponents components;
  components.backend = std::move(backend);
  components.transports.push_back(std::move(fake));
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  options.ack_deadline = absl::Seconds(20);
  auto engine = Engine::Create(options, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<transport::testing::InprocReceiver> receiver;
  for (uint64_t version = 1; version <= 2; ++version) {
    if (version == 2) {
      auto r =
          transport::testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "pull"});
      ASSERT_TRUE(r.ok());
      receiver = *std::move(r);
    }
    {
      std::lock_guard lock(log.mu);
      log.bytes = 0;
      log.calls.clear();
    }
    device_backend->copies = 0;
    const auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), version);
    auto session = (*engine)->Open(testing::Header(version));
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE(testing::Send(**session, batches).ok());
    const absl::Time t0 = absl::Now();
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status, PublicationStatus::kCommitted)
        << "version " << version << ": " << report->error;
    EXPECT_LT(absl::Now() - t0, absl::Seconds(10)) << "waited for an acknowledgement";
    ASSERT_GT(report->buckets, 1u);
    EXPECT_EQ(log.bytes, report->bytes_out) << "each bucket reaches the device reader once";
    EXPECT_GT(report->bytes_out, 0u);
    // The host copy is made only for the pull receiver, once per bucket.
    EXPECT_EQ(device_backend->copies.load(), receiver ? static_cast<int>(report->buckets) : 0);
    std::vector<std::string> want = {"begin " + std::to_string(version)};
    for (uint32_t b = 0; b < report->buckets; ++b) want.push_back("device " + std::to_string(b));
    want.push_back("wait");
    want.push_back("commit");
    EXPECT_EQ(log.calls, want);
    if (receiver) {
      ASSERT_TRUE(receiver->WaitForOutcome(version, absl::Seconds(10)));
      EXPECT_EQ(receiver->committed_version(), version);
      EXPECT_EQ(receiver->checksum_mismatches(), 0u);
      EXPECT_TRUE(receiver->committed_tensors() ==
                  testing::ExpectedOutputs(batches, *testing::PlainPolicy(),
                                           kernels::QuantMode::Standard()));
    }
  }
}

// The transport group alone: a device bucket reaches two host-only members through ONE host
// copy; without a host copy it is INTERNAL naming the transport and the bucket, and nothing is
// sent.
TEST(EngineComponentsTest, TransportGroupMakesOneHostCopyAndNamesWhatCannotTakeABucket) {
  FakeTransport::Log log_a, log_b;
  FakeTransport a(&log_a, false), b(&log_b, false);
  auto group = transport::TransportGroup::Create({&a, &b});
  ASSERT_TRUE(group.ok()) << group.status();
  transport::PublicationManifest m;
  m.version = 3;
  ASSERT_TRUE((*group)->Begin(m).ok());
  auto host = std::make_shared<transport::Bucket>();
  host->version = 3;
  host->manifest.index = 7;
  host->manifest.nbytes = 5;
  host->bytes = {1, 2, 3, 4, 5};
  int copies = 0;
  auto device = std::make_shared<transport::Bucket>(*host);
  device->bytes.clear();
  device->location = transport::BucketLocation::kDevice;
  device->device.copy_to_host = [&]() -> absl::StatusOr<std::shared_ptr<const transport::Bucket>> {
    ++copies;
    return host;
  };
  ASSERT_TRUE((*group)->Send(device).ok());
  EXPECT_EQ(copies, 1);
  EXPECT_EQ(log_a.bytes, 5u);
  EXPECT_EQ(log_b.bytes, 5u);
  device->device.copy_to_host = nullptr;
  const absl::Status s = (*group)->Send(device);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(testing::HasSubstr(s, "transport fake cannot take bucket 7")) << s;
  EXPECT_EQ(log_a.bytes, 5u) << "nothing sent";
}

// One committed publication of the tiny model to two transports that read device bytes (two
// rollout groups, one per engine family), over a producer with `readers` reader events.
struct TwoReaders {
  FakeTransport::Log first, second;
  std::vector<const void*> events;  // the producer's reader events
  int copies = 0;                   // host copies the producer made
  PublicationReport report;
};
void PublishToTwoDeviceReaders(size_t readers, TwoReaders* out) {
  auto backend = std::make_unique<DeviceBucketBackend>(readers);
  DeviceBucketBackend* device_backend = backend.get();
  for (size_t r = 0; r < readers; ++r) out->events.push_back(device_backend->event(r));
  EngineComponents components;
  components.backend = std::move(backend);
  components.transports.push_back(std::make_unique<FakeTransport>(&out->first, false, true));
  components.transports.push_back(std::make_unique<FakeTransport>(&out->second, false, true));
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  auto engine = Engine::Create(options, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto session = (*engine)->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 1)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  ASSERT_GT(report->buckets, 1u);
  EXPECT_EQ(out->first.bytes, report->bytes_out);
  EXPECT_EQ(out->second.bytes, report->bytes_out);
  out->copies = device_backend->copies.load();
  out->report = *report;
}

// A producer with an event for each: both read every bucket's device bytes, each recording its
// own `done`, and no host copy is made.
TEST(EngineComponentsTest, TwoDeviceReadersReadTheDeviceBytesEachWithItsOwnDoneEvent) {
  TwoReaders t;
  ASSERT_NO_FATAL_FAILURE(PublishToTwoDeviceReaders(2, &t));
  EXPECT_EQ(t.first.calls.size(), t.second.calls.size());
  EXPECT_EQ(t.first.dones, std::set<const void*>{t.events[0]});
  EXPECT_EQ(t.second.dones, std::set<const void*>{t.events[1]});
  EXPECT_EQ(t.copies, 0);
}

// A producer with one reader event: the first device reader with participants gets every device
// bucket as it is, the other the one host copy per bucket.
TEST(EngineComponentsTest, ADeviceReaderTheProducerHasNoEventForTakesTheHostCopy) {
  TwoReaders t;
  ASSERT_NO_FATAL_FAILURE(PublishToTwoDeviceReaders(1, &t));
  size_t device_first = 0, device_second = 0;
  for (const std::string& c : t.first.calls) device_first += c.rfind("device ", 0) == 0;
  for (const std::string& c : t.second.calls) device_second += c.rfind("device ", 0) == 0;
  EXPECT_EQ(device_first, t.report.buckets);
  EXPECT_EQ(device_second, 0u);
  EXPECT_EQ(t.copies, static_cast<int>(t.report.buckets));
}

// Resolves "CUDA IPC" handles to host buffers (handle byte 0 = buffer index): exercises the
// engine's IPC plumbing on a machine without a GPU, since the CPU backend reads host pointers.
class HostIpcResolver final : public CudaIpcResolver {
 public:
  explicit HostIpcResolver(std::vector<std::vector<uint8_t>>* buffers, int* ends)
      : buffers_(buffers), ends_(ends) {}
  absl::StatusOr<const uint8_t*> Resolve(const CudaIpcSource& source, uint64_t expected_bytes,
                                         absl::string_view tensor) override {
    const size_t i = source.handle[0];
    if (i >= buffers_->size() || source.offset + expected_bytes > (*buffers_)[i].size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", tensor, ": stale CUDA IPC handle ", i));
    }
    return (*buffers_)[i].data() + source.offset;
  }
  void EndPublication() override { ++*ends_; }

 private:
  std::vector<std::vector<uint8_t>>* buffers_;
  int* ends_;
};

TEST(EngineComponentsTest, CudaIpcPartsGoThroughTheResolver) {
  // Tensors of the small model, the expert ones "in trainer GPU memory".
  auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 4);
  std::vector<std::vector<uint8_t>> buffers;
  for (auto& b : batches) {
    for (auto& t : b.tensors) {
      if (t.input.desc.name.find(".mlp.experts.") == std::string::npos) continue;
      CudaIpcSource src;
      src.handle[0] = static_cast<uint8_t>(buffers.size());
      src.device_uuid = "GPU-00000000-0000-0000-0000-000000000000";
      src.length = t.full.size();
      buffers.push_back(t.full);
      t.input.parts = {TensorPart{src, t.input.desc.shape}};
      t.part_bytes = {{}};
    }
  }
  ASSERT_LT(buffers.size(), 256u);
  int ends = 0;
  EngineComponents components;
  components.cuda_ipc = std::make_unique<HostIpcResolver>(&buffers, &ends);
  auto engine = Engine::Create(EngineOptions{}, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok());
  auto receiver =
      transport::testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "r"});
  ASSERT_TRUE(receiver.ok());
  {
    auto session = (*engine)->Open(testing::Header(1));
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE(testing::Send(**session, batches).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  }
  ASSERT_TRUE((*receiver)->WaitForOutcome(1, absl::Seconds(10)));
  EXPECT_TRUE(
      (*receiver)->committed_tensors() ==
      testing::ExpectedOutputs(batches, *testing::PlainPolicy(), kernels::QuantMode::Standard()));
  EXPECT_EQ(ends, 1);  // at Open

  // A stale handle is the resolver's error, naming the tensor; a wrong length is caught first.
  auto session = (*engine)->Open(testing::Header(2));
  ASSERT_TRUE(session.ok());
  EXPECT_EQ(ends, 2);
  TensorInput gate;
  gate.desc = {"model.layers.1.mlp.experts.0.gate_proj.weight", DType::kBFloat16, {32, 64}};
  CudaIpcSource stale;
  stale.handle[0] = 255;
  stale.length = 4096;
  gate.parts = {TensorPart{stale, gate.desc.shape}};
  absl::Status s =
      (*session)->AddBatch(BatchInput{"decoder.layers.1.mlp.experts.linear_fc1.weight0", {gate}});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::HasSubstr(s, gate.desc.name)) << s;
  auto again = (*engine)->Open(testing::Header(2));
  ASSERT_TRUE(again.ok());
  std::get<CudaIpcSource>(gate.parts[0].source).length = 4095;
  s = (*again)->AddBatch(BatchInput{"decoder.layers.1.mlp.experts.linear_fc1.weight0", {gate}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::HasSubstr(s, "CUDA IPC length 4095")) << s;
}

}  // namespace
}  // namespace wpub::engine
