// GPU backend tests on one GPU (label gpu; skipped without a device): every bucket equals the
// CPU backend's byte for byte -- device inputs read in place, host inputs through pinned
// staging, TP-shard parts along dim 0 and 1, rank-3 expert stacks split across parts, a
// misaligned input view, an odd-sized passthrough that misaligns the packed codes -- with
// device buckets (a copying reader; two readers through the transport group, one lagging, each
// with its own `done` event and no host copy) and their host copies; the device checksums equal the
// CPU's; the retained copy in device and pinned memory holds the CPU reference's bytes and
// checksums and replays them as device buckets; non-finite weights are rejected naming the tensor;
// and an independent CUPTI count of synchronizing calls equals the backend's own accounting, 2 per
// publication for 8 or 128 experts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>

#include "core/delta/bucket_patch.h"
#include "core/engine/cpu_backend.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/retained_memory.h"
#include "core/gpu/sm_partition.h"
#include "core/transport/planner.h"
#include "core/transport/retained_copy.h"
#include "core/transport/transport_group.h"
#include "tests/kernels_gpu/cupti_sync_counter.h"

namespace wpub::gpu {
namespace {

using engine::InputTensor;
using engine::OutputKind;

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

// Reads each device bucket the backend emits into device memory allocated up front, as the
// rollout group's broadcast reads it (after `ready`, recording `done`; no synchronizing call).
// `lag` bytes of device-to-device copying go in on its stream after `ready` and before each
// read: a reader slower than the producer.
class CopyReader {
 public:
  explicit CopyReader(uint64_t capacity, uint64_t lag = 0) : lag_(lag) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&buf_, capacity), cudaSuccess);
    if (lag_ > 0) {
      EXPECT_EQ(cudaMalloc(&lag_buf_, 2 * lag_), cudaSuccess);
    }
    capacity_ = capacity;
  }
  ~CopyReader() {
    cudaStreamSynchronize(stream_);
    cudaFree(buf_);
    if (lag_buf_ != nullptr) cudaFree(lag_buf_);
    cudaStreamDestroy(stream_);
  }
  // The emit hook: takes device buckets only.
  std::function<absl::Status(std::shared_ptr<const transport::Bucket>)> emit() {
    return [this](std::shared_ptr<const transport::Bucket> b) -> absl::Status {
      if (b->location != transport::BucketLocation::kDevice) {
        return absl::InternalError("the GPU backend emitted a host bucket");
      }
      return Take(b->manifest, b->device.data, b->manifest.nbytes, b->device.ready, b->device.done);
    };
  }
  absl::Status Take(const transport::BucketManifest& m, const void* data, uint64_t n,
                    cudaEvent_t ready, cudaEvent_t done) {
    if (used_ + n > capacity_) return absl::ResourceExhaustedError("reader full");
    cudaStreamWaitEvent(stream_, ready, 0);
    if (lag_ > 0) {
      cudaMemcpyAsync(static_cast<uint8_t*>(lag_buf_) + lag_, lag_buf_, lag_,
                      cudaMemcpyDeviceToDevice, stream_);
    }
    cudaMemcpyAsync(static_cast<uint8_t*>(buf_) + used_, data, n, cudaMemcpyDeviceToDevice,
                    stream_);
    cudaEventRecord(done, stream_);
    got_.push_back({m.index, used_, n});
    used_ += n;
    return absl::OkStatus();
  }
  // The received buckets on the host (after the publication).
  std::vector<std::vector<uint8_t>> Received() {
    cudaStreamSynchronize(stream_);
    std::vector<std::vector<uint8_t>> out;
    for (const auto& g : got_) {
      std::vector<uint8_t> b(g.n);
      cudaMemcpy(b.data(), static_cast<uint8_t*>(buf_) + g.off, g.n, cudaMemcpyDeviceToHost);
      out.push_back(std::move(b));
    }
    return out;
  }
  void Reset() {
    cudaStreamSynchronize(stream_);
    got_.clear();
    used_ = 0;
  }

 private:
  struct Got {
    uint32_t index;
    uint64_t off, n;
  };
  const uint64_t lag_;
  cudaStream_t stream_ = nullptr;
  void* buf_ = nullptr;
  void* lag_buf_ = nullptr;
  uint64_t capacity_ = 0, used_ = 0;
  std::vector<Got> got_;
};

// A CopyReader as a transport that reads device memory, as a rollout group does.
class DeviceReaderTransport final : public transport::Transport {
 public:
  DeviceReaderTransport(std::string name, uint64_t lag)
      : name_(std::move(name)), reader_(64 << 20, lag) {}
  transport::TransportCapabilities capabilities() const override {
    transport::TransportCapabilities c;
    c.name = name_;
    c.accepts = transport::kHostOrDevice;
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest&) override {
    reader_.Reset();
    return std::vector<std::string>{name_};
  }
  absl::Status Send(std::shared_ptr<const transport::Bucket> b) override {
    if (b->location != transport::BucketLocation::kDevice) {
      ++host_buckets;
      return absl::OkStatus();
    }
    dones.insert(b->device.done);
    return reader_.Take(b->manifest, b->device.data, b->manifest.nbytes, b->device.ready,
                        b->device.done);
  }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  std::vector<transport::ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<transport::ReceiverInfo> Receivers() const override { return {}; }
  std::vector<std::vector<uint8_t>> Received() { return reader_.Received(); }
  int host_buckets = 0;
  std::set<cudaEvent_t> dones;

 private:
  const std::string name_;
  CopyReader reader_;
};

uint16_t Bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// A publication's inputs held twice: on the host (for the CPU reference) and on the device.
struct Model {
  struct Part {
    std::vector<uint8_t> host;
    void* dev = nullptr;
    size_t dev_offset = 0;  // misaligned views start this many bytes into the allocation
    Shape shape;
  };
  struct Tensor {
    TensorDesc desc;
    int concat_dim = 0;
    std::vector<Part> parts;
    bool quantize = false;
    int pair = -1;
  };
  std::vector<Tensor> tensors;
  std::mt19937 rng{7};

  ~Model() {
    for (auto& t : tensors) {
      for (auto& p : t.parts) cudaFree(p.dev);
    }
  }
  void Add(std::string name, DType dtype, Shape full, std::vector<Shape> parts, int concat,
           bool quantize, int pair = -1, size_t misalign = 0) {
    Tensor t;
    t.desc = TensorDesc{std::move(name), dtype, std::move(full)};
    t.concat_dim = concat;
    t.quantize = quantize;
    t.pair = pair;
    std::normal_distribution<float> nd(0.f, 0.05f);
    for (Shape& s : parts) {
      Part p;
      p.shape = s;
      const size_t n = static_cast<size_t>(NumElements(s));
      p.host.resize(n * static_cast<size_t>(DTypeSize(dtype)));
      for (size_t i = 0; i < n; ++i) {
        float v = nd(rng);
        if (i % 97 == 0) v *= 20;
        if (dtype == DType::kFloat32) {
          std::memcpy(p.host.data() + 4 * i, &v, 4);
        } else {
          const uint16_t h = Bf16(v);
          std::memcpy(p.host.data() + 2 * i, &h, 2);
        }
      }
      p.dev_offset = misalign;
      EXPECT_EQ(cudaMalloc(&p.dev, p.host.size() + 256), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(static_cast<uint8_t*>(p.dev) + misalign, p.host.data(), p.host.size(),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      t.parts.push_back(std::move(p));
    }
    tensors.push_back(std::move(t));
  }
  void SetHost(size_t tensor, size_t part, size_t byte, uint16_t value) {
    Part& p = tensors[tensor].parts[part];
    std::memcpy(p.host.data() + byte, &value, 2);
    cudaMemcpy(static_cast<uint8_t*>(p.dev) + p.dev_offset + byte, &value, 2,
               cudaMemcpyHostToDevice);
  }

  // The plan over host (device = false) or device part pointers.
  engine::ExecutionPlan Plan(bool device, uint64_t bucket_bytes,
                             std::vector<InputTensor>* inputs) const {
    engine::ExecutionPlan plan;
    plan.version = 1;
    std::vector<uint32_t> units;
    inputs->clear();
    std::vector<int> group(tensors.size(), -1);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      InputTensor in;
      in.desc = t.desc;
      in.concat_dim = t.concat_dim;
      for (const Part& p : t.parts) {
        const uint8_t* data =
            device ? static_cast<const uint8_t*>(p.dev) + p.dev_offset : p.host.data();
        in.parts.push_back(engine::PartView{data, p.shape, p.host.size()});
      }
      inputs->push_back(std::move(in));
      if (!t.quantize) {
        plan.outputs.push_back(t.desc);
        plan.sources.push_back({OutputKind::kPassthrough, i, -1});
        units.push_back(1);
        continue;
      }
      const Shape& s = t.desc.shape;
      const bool stack = s.size() == 3;
      if (t.pair >= 0) {
        group[i] = group[static_cast<size_t>(t.pair)];
        plan.amax_groups[static_cast<size_t>(group[i])].members.push_back(i);
      } else {
        group[i] = static_cast<int>(plan.amax_groups.size());
        plan.amax_groups.push_back({{i}, stack ? s[0] : 1});
      }
      Shape packed = s, scales = s;
      packed.back() /= 2;
      scales.back() /= 16;
      const std::string stem = t.desc.name.substr(0, t.desc.name.size() - 7);
      plan.outputs.push_back({stem + ".weight", DType::kUInt8, packed});
      plan.outputs.push_back({stem + ".weight_scale", DType::kFloat8E4M3, scales});
      plan.outputs.push_back(
          {stem + ".weight_scale_2", DType::kFloat32, stack ? Shape{s[0]} : Shape{}});
      for (auto k : {OutputKind::kPacked, OutputKind::kScales, OutputKind::kDecodeScale}) {
        plan.sources.push_back({k, i, group[i]});
      }
      units.push_back(3);
    }
    plan.inputs = inputs;
    auto buckets = transport::PlanBuckets(plan.outputs, units, bucket_bytes);
    EXPECT_TRUE(buckets.ok()) << buckets.status();
    plan.buckets = *buckets;
    return plan;
  }
};

// A model exercising every input path of the backend.
void BuildMixed(Model& m) {
  m.Add("norm.weight", DType::kBFloat16, {3}, {{3}}, 0, false);  // odd: misaligns packed codes
  m.Add("bias.weight", DType::kFloat32, {5}, {{5}}, 0, false);
  m.Add("attn.weight", DType::kBFloat16, {32, 48}, {{32, 24}, {32, 24}}, 1, false);
  m.Add("a.weight", DType::kBFloat16, {64, 256}, {{64, 256}}, 0, true);
  m.Add("gate.weight", DType::kBFloat16, {128, 256}, {{64, 256}, {64, 256}}, 0, true);
  m.Add("up.weight", DType::kBFloat16, {128, 256}, {{64, 256}, {64, 256}}, 0, true, 4);
  m.Add("down.weight", DType::kBFloat16, {256, 128}, {{256, 64}, {256, 64}}, 1, true);
  m.Add("experts.weight", DType::kBFloat16, {4, 64, 128}, {{2, 64, 128}, {2, 64, 128}}, 0, true);
  m.Add("view.weight", DType::kBFloat16, {32, 64}, {{32, 64}}, 0, true, -1, /*misalign=*/2);
}

// The manifest of `plan`'s buckets as publication `version`.
transport::PublicationManifest ManifestOf(const engine::ExecutionPlan& plan, uint64_t version) {
  transport::PublicationManifest manifest;
  manifest.version = version;
  for (const transport::BucketLayout& l : plan.buckets) {
    manifest.buckets.push_back(transport::MakeBucketManifest(l, plan.outputs));
  }
  return manifest;
}

// Runs `plan` on `backend`, every bucket sent through `group`; the host syncs it counted.
absl::StatusOr<uint64_t> ExecuteThrough(GpuBackend& backend, transport::TransportGroup& group,
                                        const engine::ExecutionPlan& plan) {
  engine::SyncCounter syncs;
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  hooks.emit = [&](std::shared_ptr<const transport::Bucket> b) { return group.Send(b); };
  auto r = backend.Execute(plan, hooks);
  if (!r.ok()) return r.status();
  return syncs.count();
}

// The CPU reference's buckets.
std::vector<std::shared_ptr<const transport::Bucket>> Reference(const Model& m, uint64_t bucket) {
  std::vector<InputTensor> inputs;
  engine::ExecutionPlan plan = m.Plan(false, bucket, &inputs);
  auto cpu = engine::CpuBackend::Create({2});
  std::vector<std::shared_ptr<const transport::Bucket>> out;
  engine::SyncCounter syncs;
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  hooks.emit = [&](std::shared_ptr<const transport::Bucket> b) {
    out.push_back(std::move(b));
    return absl::OkStatus();
  };
  EXPECT_TRUE((*cpu)->Execute(plan, hooks).ok());
  return out;
}

// Runs `m`'s plan (parts in device or host memory) on `backend` into `sink` (emptied first); the
// buckets the sink received.
absl::StatusOr<std::vector<std::vector<uint8_t>>> RunInto(GpuBackend& backend, const Model& m,
                                                          bool device_inputs, uint64_t bucket,
                                                          CopyReader& sink) {
  sink.Reset();
  std::vector<InputTensor> inputs;
  engine::ExecutionPlan plan = m.Plan(device_inputs, bucket, &inputs);
  engine::SyncCounter syncs;
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  hooks.emit = sink.emit();
  absl::StatusOr<engine::ExecutionResult> r = backend.Execute(plan, hooks);
  if (!r.ok()) return r.status();
  return sink.Received();
}

class GpuBackendTest : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GpuBackendTest, DeviceBucketsEqualCpuReference) {
  Model m;
  BuildMixed(m);
  const auto want = Reference(m, GetParam());
  ASSERT_FALSE(want.empty());
  CopyReader sink(64 << 20);
  GpuBackendOptions o;
  auto backend = GpuBackend::Create(o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  for (bool device_inputs : {true, false}) {
    auto run = RunInto(**backend, m, device_inputs, GetParam(), sink);
    ASSERT_TRUE(run.ok()) << run.status();
    const auto& got = *run;
    ASSERT_EQ(got.size(), want.size());
    for (size_t b = 0; b < got.size(); ++b) {
      EXPECT_EQ(got[b], want[b]->bytes) << "bucket " << b << (device_inputs ? " device" : " host");
      EXPECT_EQ((*backend)->last_checksums()[b], want[b]->manifest.checksum) << "bucket " << b;
    }
  }
}

TEST_P(GpuBackendTest, HostBucketsEqualCpuReference) {
  Model m;
  BuildMixed(m);
  const auto want = Reference(m, GetParam());
  auto backend = GpuBackend::Create({});
  ASSERT_TRUE(backend.ok());
  std::vector<InputTensor> inputs;
  engine::ExecutionPlan plan = m.Plan(true, GetParam(), &inputs);
  std::vector<std::shared_ptr<const transport::Bucket>> got;
  engine::SyncCounter syncs;
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  // No transport reads device memory: the transport group asks each bucket for its host copy.
  hooks.emit = [&](std::shared_ptr<const transport::Bucket> b) -> absl::Status {
    if (b->location != transport::BucketLocation::kDevice || !b->device.copy_to_host) {
      return absl::InternalError("expected a device bucket with a host copy");
    }
    absl::StatusOr<std::shared_ptr<const transport::Bucket>> host = b->device.copy_to_host();
    if (!host.ok()) return host.status();
    got.push_back(*std::move(host));
    return absl::OkStatus();
  };
  ASSERT_TRUE((*backend)->Execute(plan, hooks).ok());
  ASSERT_EQ(got.size(), want.size());
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_EQ(got[b]->bytes, want[b]->bytes) << "bucket " << b;
    EXPECT_EQ(got[b]->manifest, want[b]->manifest) << "bucket " << b;
  }
}

// wpubd --release_gpu_memory: after a publication the backend frees every buffer it grew
// (staging, scratch, arena, host stage, bounce) and says how many bytes; a second release finds
// nothing; held_bytes() says what is kept; the next publication grows them again and its buckets
// are the reference's.
TEST_P(GpuBackendTest, ReleasedMemoryIsGrownAgainForTheNextPublication) {
  Model m;
  BuildMixed(m);
  const auto want = Reference(m, GetParam());
  ASSERT_FALSE(want.empty());
  CopyReader sink(64 << 20);
  auto backend = GpuBackend::Create({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  for (int round = 0; round < 3; ++round) {
    auto run = RunInto(**backend, m, round % 2 == 0, GetParam(), sink);
    ASSERT_TRUE(run.ok()) << "round " << round << ": " << run.status();
    const auto& got = *run;
    ASSERT_EQ(got.size(), want.size()) << "round " << round;
    for (size_t b = 0; b < got.size(); ++b) {
      EXPECT_EQ(got[b], want[b]->bytes) << "round " << round << " bucket " << b;
    }
    // At least a staging buffer as large as a bucket was held -- and reported.
    const uint64_t held = (*backend)->held_bytes();
    EXPECT_GE(held, want.front()->bytes.size()) << "round " << round;
    EXPECT_EQ((*backend)->ReleaseMemory(), held) << "round " << round;
    EXPECT_EQ((*backend)->held_bytes(), 0u) << "round " << round;
    EXPECT_EQ((*backend)->ReleaseMemory(), 0u) << "round " << round;
  }
}

INSTANTIATE_TEST_SUITE_P(BucketSizes, GpuBackendTest,
                         ::testing::Values(uint64_t{2} << 10, uint64_t{64} << 10,
                                           uint64_t{16} << 20));

// The compute stream on an SM partition (a green context), its kernels capped at one CTA per SM
// (the other tests run without a cap): the same bytes, amax first
// or pipelined; the partition's size is checked and reported.
TEST(GpuBackend, ComputeOnAnSmPartitionEqualsCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  int total = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&total, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(PartitionedStream::Create(0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionedStream::Create(0, total + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const int sms : {16, total}) {
    auto p = PartitionedStream::Create(0, sms);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GE((*p)->sms(), sms);
    EXPECT_LE((*p)->sms(), total);
  }
  Model m;
  BuildMixed(m);
  const uint64_t bucket = uint64_t{64} << 10;
  const auto want = Reference(m, bucket);
  for (const bool reject_first : {true, false}) {
    CopyReader sink(64 << 20);
    GpuBackendOptions o;
    o.compute_sms = 16;
    o.overlap_ctas_per_sm = 1;  // and the quantize/amax kernels at one CTA per SM
    o.reject_before_send = reject_first;
    auto backend = GpuBackend::Create(o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    const auto got = RunInto(**backend, m, /*device_inputs=*/true, bucket, sink);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), want.size());
    for (size_t b = 0; b < got->size(); ++b) {
      EXPECT_EQ((*got)[b], want[b]->bytes) << "bucket " << b << " reject_first " << reject_first;
    }
  }
  GpuBackendOptions bad;
  bad.compute_sms = total + 1;
  EXPECT_EQ(GpuBackend::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// Two device readers (the SGLang and vLLM rollout groups) through the transport group: both read
// every bucket from the same staging buffers, each recording its own `done`; the producer reuses
// a buffer only after both, so the lagging reader (a 64 MiB copy before each read) still gets
// the CPU reference's bytes. No host copy, no host sync beyond the publication's own.
TEST(GpuBackend, TwoDeviceReadersReadTheSameBucketsWithoutAHostCopy) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Model m;
  BuildMixed(m);
  const uint64_t bucket = uint64_t{2} << 10;  // many buckets: each staging buffer reused often
  const auto want = Reference(m, bucket);
  // More buckets than twice the backend's two staging buffers: each is reused at least twice
  // while the slow reader may still be reading it.
  ASSERT_GT(want.size(), 4u);
  DeviceReaderTransport fast("sglang-group", 0), slow("vllm-group", uint64_t{64} << 20);
  auto group = transport::TransportGroup::Create({&fast, &slow});
  ASSERT_TRUE(group.ok()) << group.status();
  auto backend = GpuBackend::Create({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  for (int round = 0; round < 2; ++round) {
    std::vector<InputTensor> inputs;
    engine::ExecutionPlan plan = m.Plan(true, bucket, &inputs);
    ASSERT_TRUE((*group)->Begin(transport::PublicationManifest{}).ok());
    auto r = ExecuteThrough(**backend, **group, plan);
    ASSERT_TRUE(r.ok()) << r.status();
    for (DeviceReaderTransport* t : {&fast, &slow}) {
      const auto got = t->Received();
      ASSERT_EQ(got.size(), want.size()) << t->capabilities().name;
      for (size_t b = 0; b < got.size(); ++b) {
        EXPECT_EQ(got[b], want[b]->bytes) << t->capabilities().name << " bucket " << b;
      }
      EXPECT_EQ(t->host_buckets, 0) << t->capabilities().name;
    }
    // The first publication also allocates its buffers (one counted sync each).
    if (round > 0) {
      EXPECT_EQ(*r, 2u);
    }
  }
  // Each reader recorded events of its own (one per staging buffer), none of the other's.
  EXPECT_EQ(fast.dones.size(), 2u);
  EXPECT_EQ(slow.dones.size(), 2u);
  for (cudaEvent_t e : fast.dones) EXPECT_EQ(slow.dones.count(e), 0u);
}

// The retained copy in device and in pinned memory (core/gpu/retained_memory.h) as the last
// device reader of the transport group beside a lagging engine: it copies every bucket with no
// host copy and no synchronization counted to the publication; once committed it holds the CPU
// reference's bytes and its manifest the CPU reference's checksums (summed on the device); an
// aborted version leaves it as it was; a replay emits device buckets that a reader takes as it
// takes a publication's, and their host copies are the same bytes. A third version reuses the
// first one's buffer (two versions' worth held, no more).
TEST(GpuBackend, TheRetainedCopyInDeviceOrPinnedMemoryHoldsTheReferenceAndReplaysIt) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Model m;
  BuildMixed(m);
  const uint64_t bucket = uint64_t{2} << 10;
  const auto want = Reference(m, bucket);
  ASSERT_GT(want.size(), 4u);
  for (transport::RetainWhere where :
       {transport::RetainWhere::kDevice, transport::RetainWhere::kPinned}) {
    SCOPED_TRACE(transport::RetainWhereName(where));
    auto memory = GpuRetainedMemory::Create({0, where});
    ASSERT_TRUE(memory.ok()) << memory.status();
    auto copy = transport::RetainedCopy::Create({.where = where}, *memory);
    ASSERT_TRUE(copy.ok()) << copy.status();
    DeviceReaderTransport engine("sglang-group", uint64_t{16} << 20);
    auto group = transport::TransportGroup::Create({&engine, copy->get()});
    ASSERT_TRUE(group.ok()) << group.status();
    auto backend = GpuBackend::Create({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    uint64_t one_version = 0;
    for (uint64_t version = 1; version <= 3; ++version) {
      std::vector<InputTensor> inputs;
      engine::ExecutionPlan plan = m.Plan(true, bucket, &inputs);
      plan.version = version;
      const transport::PublicationManifest manifest = ManifestOf(plan, version);
      ASSERT_TRUE((*group)->Begin(manifest).ok());
      auto syncs = ExecuteThrough(**backend, **group, plan);
      ASSERT_TRUE(syncs.ok()) << syncs.status();
      EXPECT_EQ(engine.host_buckets, 0);
      if (version > 1) {
        EXPECT_EQ(*syncs, 2u);  // the copy adds none per bucket
      }
      if (version == 2) {
        (*group)->Abort("test: an aborted version");
        ASSERT_NE((*copy)->Retained(), nullptr);
        EXPECT_EQ((*copy)->Retained()->manifest.version, 1u);
        continue;
      }
      ASSERT_TRUE((*group)->Commit().ok());
      const auto retained = (*copy)->Retained();
      ASSERT_NE(retained, nullptr) << (*copy)->Info().reason;
      EXPECT_EQ(retained->manifest.version, version);
      ASSERT_EQ(retained->bucket_count(), want.size());
      for (size_t b = 0; b < want.size(); ++b) {
        EXPECT_EQ(retained->manifest.buckets[b].checksum, want[b]->manifest.checksum)
            << "bucket " << b;
      }
      const transport::RetainedCopyInfo info = (*copy)->Info();
      if (version == 1) {
        one_version = info.held_bytes;
        EXPECT_GE(one_version, retained->bytes);
      } else {
        // The staged buffer, reused since; pinned memory adds the replay's two bounce buffers.
        uint64_t bounce = 0;
        for (const auto& w : want) bounce = std::max<uint64_t>(bounce, w->manifest.nbytes);
        EXPECT_GE(info.held_bytes, 2 * one_version);
        EXPECT_LE(info.held_bytes,
                  2 * one_version + (where == transport::RetainWhere::kPinned ? 2 * bounce : 0));
      }
      // A replay: device buckets, read in place or through the bounce buffers.
      DeviceReaderTransport late("late-engine", 0);
      ASSERT_TRUE(late.Begin(manifest).ok());
      for (size_t b = 0; b < want.size(); ++b) {
        auto emitted = retained->BucketAt(b);
        ASSERT_TRUE(emitted.ok()) << emitted.status();
        ASSERT_EQ((*emitted)->location, transport::BucketLocation::kDevice);
        ASSERT_TRUE(late.Send(*emitted).ok());
        if (b == 1) {
          auto host = (*emitted)->device.copy_to_host();
          ASSERT_TRUE(host.ok()) << host.status();
          EXPECT_EQ((*host)->bytes, want[b]->bytes);
        }
        auto copy_of = retained->HostBucketAt(b);  // what a bucket patch is diffed against
        ASSERT_TRUE(copy_of.ok()) << copy_of.status();
        EXPECT_EQ((*copy_of)->bytes, want[b]->bytes) << "host copy of bucket " << b;
      }
      const auto got = late.Received();
      ASSERT_EQ(got.size(), want.size());
      for (size_t b = 0; b < got.size(); ++b) {
        EXPECT_EQ(got[b], want[b]->bytes) << "replayed bucket " << b;
      }
    }
  }
}

// A delta publication's patch, made on the device between the retained version and the one
// staging (GpuRetainedMemory's Patch: xor runs on the device, units on the host), is byte for
// byte the host diff of the CPU reference's buckets (delta::DiffBucket, format 2), with the
// device's word counts format 1's, for buckets that changed, did not change, and under a limit that
// sends every bucket whole; a pinned copy leaves patches to the host; a patch waiting for a
// bucket of a staging that stopped returns at once.
TEST(GpuBackend, TheDeviceCopyMakesTheHostDiffsPatchByteForByte) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Model m;
  BuildMixed(m);
  const uint64_t bucket = uint64_t{2} << 10;
  auto memory = GpuRetainedMemory::Create({0, transport::RetainWhere::kDevice});
  ASSERT_TRUE(memory.ok()) << memory.status();
  auto copy = transport::RetainedCopy::Create({.where = transport::RetainWhere::kDevice}, *memory);
  ASSERT_TRUE(copy.ok()) << copy.status();
  DeviceReaderTransport engine("sglang-group", 0);
  auto group = transport::TransportGroup::Create({&engine, copy->get()});
  ASSERT_TRUE(group.ok()) << group.status();
  auto backend = GpuBackend::Create({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  // Publishes and commits the model as `version`; `during` sees the staging bytes after the
  // backend ran, before the commit.
  auto publish = [&](uint64_t version,
                     const std::function<void(transport::RetainedBytes*)>& during) {
    std::vector<InputTensor> inputs;
    engine::ExecutionPlan plan = m.Plan(true, bucket, &inputs);
    plan.version = version;
    ASSERT_TRUE((*group)->Begin(ManifestOf(plan, version)).ok());
    const std::shared_ptr<transport::RetainedBytes> staging = (*copy)->StagingBytes(version);
    ASSERT_NE(staging, nullptr);
    auto r = ExecuteThrough(**backend, **group, plan);
    ASSERT_TRUE(r.ok()) << r.status();
    during(staging.get());
    ASSERT_TRUE((*group)->Commit().ok());
  };
  publish(1, [](transport::RetainedBytes*) {});
  const auto v1 = Reference(m, bucket);
  // v2: one bf16 element of the dense layer and a few of quantized tensors move (a block's
  // codes, one scale, maybe the amax); most buckets keep every byte.
  m.SetHost(2, 0, 6, 0x3f80);
  m.SetHost(3, 0, 2 * 300, 0x3f00);
  m.SetHost(7, 1, 2 * 5000, 0xbf20);
  const auto v2 = Reference(m, bucket);
  ASSERT_EQ(v1.size(), v2.size());
  size_t patched = 0, unchanged = 0;
  publish(2, [&](transport::RetainedBytes* staging) {
    const auto base = (*copy)->Retained();
    ASSERT_NE(base, nullptr);
    ASSERT_EQ(base->manifest.version, 1u);
    for (size_t i = 0; i < v2.size(); ++i) {
      SCOPED_TRACE(i);
      const uint64_t c1 = v1[i]->manifest.checksum, c2 = v2[i]->manifest.checksum;
      EXPECT_EQ(base->manifest.buckets[i].checksum, c1);
      for (double fraction : {0.5, 0.0}) {
        auto got = staging->Patch(*base->memory, base->manifest.buckets[i], v2[i]->manifest, c2,
                                  fraction, absl::Seconds(10));
        ASSERT_TRUE(got.ok()) << got.status();
        const delta::BucketPatchPlan want = delta::DiffBucket(v1[i]->span(), c1, v2[i]->span(), c2,
                                                              {.max_patch_fraction = fraction});
        ASSERT_EQ(got->made, !want.full) << got->why;
        // The device counts words (its format 1 xor runs), as DiffBucket does in format 1.
        const delta::BucketPatchPlan runs =
            delta::DiffBucket(v1[i]->span(), c1, v2[i]->span(), c2,
                              {.max_patch_fraction = 100, .format = delta::PatchFormat::kWordRuns});
        EXPECT_EQ(got->changed_words, runs.changed_words);
        EXPECT_EQ(got->runs, runs.runs);
        if (!got->made) continue;
        EXPECT_EQ(got->changed_units, want.changed_units);
        EXPECT_EQ(got->bytes, want.patch);
        auto rebuilt = delta::ApplyBucketPatch(got->bytes, v1[i]->span());
        ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
        EXPECT_EQ(*rebuilt, v2[i]->bytes);
        ++(want.changed_units == 0 ? unchanged : patched);
      }
    }
  });
  EXPECT_GT(patched, 0u);
  EXPECT_GT(unchanged, 0u);
  EXPECT_GT((*copy)->Info().held_bytes, 0u);
  // A staging that stopped (the publication aborted before a bucket was copied): at once.
  {
    std::vector<InputTensor> inputs;
    const transport::PublicationManifest manifest = ManifestOf(m.Plan(true, bucket, &inputs), 3);
    ASSERT_TRUE((*group)->Begin(manifest).ok());
    const std::shared_ptr<transport::RetainedBytes> staging = (*copy)->StagingBytes(3);
    ASSERT_NE(staging, nullptr);
    (*group)->Abort("test: aborted before any bucket");
    const auto base = (*copy)->Retained();
    const absl::Time start = absl::Now();
    auto got = staging->Patch(*base->memory, base->manifest.buckets[0], manifest.buckets[0], 0, 0.5,
                              absl::Seconds(30));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  // Pinned memory: UNIMPLEMENTED (its bytes are on the host already).
  auto pinned = GpuRetainedMemory::Create({0, transport::RetainWhere::kPinned});
  ASSERT_TRUE(pinned.ok());
  auto pinned_copy =
      transport::RetainedCopy::Create({.where = transport::RetainWhere::kPinned}, *pinned);
  ASSERT_TRUE(pinned_copy.ok());
  transport::PublicationManifest empty;
  empty.version = 1;
  ASSERT_TRUE((*pinned_copy)->Begin(empty).ok());
  ASSERT_TRUE((*pinned_copy)->Commit().ok());
  ASSERT_NE((*pinned_copy)->Retained(), nullptr);
  empty.version = 2;
  ASSERT_TRUE((*pinned_copy)->Begin(empty).ok());
  auto staging = (*pinned_copy)->StagingBytes(2);
  ASSERT_NE(staging, nullptr);
  auto got = staging->Patch(*(*pinned_copy)->Retained()->memory, {}, {}, 0, 0.5, absl::Seconds(1));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnimplemented) << got.status();
  (*pinned_copy)->Abort("test");
}

TEST(GpuBackend, NonFiniteRejectedNamingTheTensorUnlessAllowed) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Model m;
  BuildMixed(m);
  m.SetHost(6, 1, 10, 0x7F80);  // +inf in down.weight's second part
  CopyReader sink(64 << 20);
  GpuBackendOptions o;
  auto backend = GpuBackend::Create(o);
  ASSERT_TRUE(backend.ok());
  std::vector<InputTensor> inputs;
  engine::ExecutionPlan plan = m.Plan(true, 64 << 10, &inputs);
  engine::SyncCounter syncs;
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  hooks.emit = sink.emit();
  auto r = (*backend)->Execute(plan, hooks);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("down.weight"), std::string::npos) << r.status();
  EXPECT_TRUE(sink.Received().empty()) << "a bucket was sent before the rejection";
  plan.allow_non_finite = true;
  sink.Reset();
  r = (*backend)->Execute(plan, hooks);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->non_finite, 1u);
  // Warm now: a rejection costs exactly the status read and the drain of the buckets packed
  // behind it (they read the inputs in place), and returns with nothing in flight.
  plan.allow_non_finite = false;
  sink.Reset();
  engine::SyncCounter rejected;
  hooks.syncs = &rejected;
  r = (*backend)->Execute(plan, hooks);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_TRUE(sink.Received().empty()) << "a bucket was sent before the rejection";
  EXPECT_EQ(rejected.count(), 2u) << "the status read and the drain";
  EXPECT_EQ(cudaStreamQuery((*backend)->compute_stream()), cudaSuccess);
}

TEST(GpuBackend, CuptiCountsMatchTheAccountingAndDoNotGrowWithExperts) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  kernels::cuda::testing::SyncCounter cupti;
  std::string err;
  const bool have_cupti = cupti.Start(&err);
  CopyReader sink(256 << 20);
  GpuBackendOptions o;
  auto backend = GpuBackend::Create(o);
  ASSERT_TRUE(backend.ok());
  std::map<int, uint64_t> steady;
  for (int experts : {8, 128}) {
    Model m;
    for (int e = 0; e < experts; ++e) {
      const std::string x = "layers.0.experts." + std::to_string(e) + ".";
      const int gate = static_cast<int>(m.tensors.size());
      m.Add(x + "gate_proj.weight", DType::kBFloat16, {64, 128}, {{64, 128}}, 0, true);
      m.Add(x + "up_proj.weight", DType::kBFloat16, {64, 128}, {{64, 128}}, 0, true, gate);
      m.Add(x + "down_proj.weight", DType::kBFloat16, {128, 64}, {{128, 64}}, 0, true);
    }
    m.Add("layers.0.norm.weight", DType::kBFloat16, {128}, {{128}}, 0, false);
    for (int rep = 0; rep < 2; ++rep) {
      sink.Reset();
      std::vector<InputTensor> inputs;
      engine::ExecutionPlan plan = m.Plan(true, 64 << 10, &inputs);
      engine::SyncCounter syncs;
      engine::ExecutionHooks hooks;
      hooks.syncs = &syncs;
      hooks.emit = sink.emit();
      const int before = have_cupti ? cupti.synchronizing_calls() : 0;
      ASSERT_TRUE((*backend)->Execute(plan, hooks).ok());
      if (have_cupti) {
        EXPECT_EQ(static_cast<uint64_t>(cupti.synchronizing_calls() - before), syncs.count())
            << "synchronizing calls outside the accounting: " << cupti.SynchronizingCallNames();
      }
      if (rep == 1) steady[experts] = syncs.count();
    }
  }
  if (have_cupti) cupti.Stop();
  EXPECT_EQ(steady[8], 2u);
  EXPECT_EQ(steady[128], 2u);
  if (!have_cupti) GTEST_SKIP() << "CUPTI unavailable (" << err << "); accounting checked only";
}

}  // namespace
}  // namespace wpub::gpu
