// Engines built with custom components (the GPU path's plug points): an extra transport driven
// next to the pull transport, with injected faults, and a backend decorator that reports host
// synchronizations.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <atomic>
#include <mutex>

#include "absl/strings/str_cat.h"

#include "core/engine/cpu_backend.h"
#include "core/engine/engine.h"
#include "core/engine/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

// A push-style transport double: one pretend engine that "receives" every bucket; faults on
// request.
class FakeTransport final : public Transport {
 public:
  struct Log {
    std::mutex mu;
    std::vector<std::string> calls;
    uint64_t bytes = 0;
  };
  FakeTransport(Log* log, bool fail_wait) : log_(log), fail_wait_(fail_wait) {}

  TransportCapabilities capabilities() const override {
    TransportCapabilities c;
    c.name = "fake";
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& m) override {
    Record("begin " + std::to_string(m.version));
    return std::vector<std::string>{"fake-engine"};
  }
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override {
    std::lock_guard lock(log_->mu);
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
  std::vector<ReceiverOutcome> Outcomes() const override {
    ReceiverOutcome o;
    o.name = "fake-engine";
    if (failed_) {
      o.failure = ReceiverFailure::kProtocol;
      o.error = "fake-engine: update_weights_from_distributed returned 500";
    }
    return {o};
  }
  std::vector<ReceiverInfo> Receivers() const override {
    return {ReceiverInfo{"fake-engine", ReceiverState::kIdle, 0, absl::Now()}};
  }

 private:
  void Record(std::string s) {
    std::lock_guard lock(log_->mu);
    log_->calls.push_back(std::move(s));
  }
  Log* log_;
  bool fail_wait_;
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
  auto engine = Engine::Create(options, &registry, std::move(components));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto receiver = testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "pull"});
  ASSERT_TRUE(receiver.ok());

  auto session = (*engine)->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(testing::Send(**session, testing::ModelBatches(testing::SmallShape(), 1)).ok());
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

TEST(EngineComponentsTest, AFailingExtraTransportAbortsThePullReceiversToo) {
  FakeTransport::Log log;
  EngineComponents components;
  components.transports.push_back(std::make_unique<FakeTransport>(&log, true));
  auto engine = Engine::Create(EngineOptions{}, nullptr, std::move(components));
  ASSERT_TRUE(engine.ok());
  auto receiver = testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "pull"});
  ASSERT_TRUE(receiver.ok());
  auto session = (*engine)->Open(testing::Header(1));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(testing::Send(**session, testing::ModelBatches(testing::SmallShape(), 1)).ok());
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
  auto batches = testing::ModelBatches(testing::SmallShape(), 4);
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
  auto receiver = testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "r"});
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
