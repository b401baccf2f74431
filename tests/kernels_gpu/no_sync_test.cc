// No host synchronization: quantize and fused QDQ captured into a CUDA graph and replayed with
// new data (still exact against the CPU reference), and an independent CUPTI count of
// synchronizing CUDA runtime calls during the amax + scales + quantize of 64 experts (zero),
// with the launch count independent of the number of experts.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/reference.h"
#include "kernels/testing/test_data.h"
#include "tests/kernels_gpu/cupti_sync_counter.h"
#include "tests/kernels_gpu/gpu_test_util.h"
#include "tests/kernels_gpu/quant_harness.h"

namespace wpub::kernels::cuda::testing {
namespace {

using ::wpub::kernels::testing::MakeRandomTensor;
using ::wpub::kernels::testing::TestTensor;

// A list of experts on the device with their quantize and QDQ outputs, all preallocated.
struct Experts {
  std::vector<TestTensor> host;
  std::vector<DeviceWeight> dev;
  std::vector<WeightDesc> dev_descs;
  std::vector<DeviceQuantized> quant;
  std::vector<DeviceBuffer> qdq_out;
  DeviceBuffer amax;
  DeviceBuffer nonfinite;
  DeviceBuffer s_enc;
  DeviceBuffer qdq_ws;
  std::vector<QuantizeJob> qjobs;
  std::vector<QdqJob> qdq_jobs;

  bool Init(int count, int64_t rows, int64_t cols, uint64_t seed) {
    dev.resize(count);
    quant.resize(count);
    for (int i = 0; i < count; ++i) {
      host.push_back(MakeRandomTensor(ElemType::kBF16, rows, cols, seed + i, 0.02 * (1 + i % 7)));
      if (!dev[i].Init(host[i].desc())) return false;
      dev_descs.push_back(dev[i].desc());
      if (!quant[i].Init(host[i].desc(), /*with_swizzled=*/true)) return false;
      qdq_out.push_back(Poisoned(host[i].numel() * 2));
    }
    amax = Poisoned(count * sizeof(float));
    nonfinite = Poisoned(count * sizeof(int64_t));
    s_enc = Poisoned(count * sizeof(float));
    for (int i = 0; i < count; ++i) {
      QuantizeJob j;
      j.weight = dev_descs[i];
      j.out = quant[i].Output();
      j.amax = amax.as<float>() + i;
      qjobs.push_back(j);
      QdqJob q;
      q.weight = dev_descs[i];
      q.out = qdq_out[i].data();
      qdq_jobs.push_back(q);
    }
    return DeviceBuffer::Create(QdqComputeAmaxWorkspaceBytes(qdq_jobs.data(), count), &qdq_ws) ==
           cudaSuccess;
  }

  // New contents for the same shapes (as a trainer step would produce).
  bool Refill(uint64_t seed) {
    for (size_t i = 0; i < host.size(); ++i) {
      host[i] = MakeRandomTensor(ElemType::kBF16, host[i].rows, host[i].cols, seed + i,
                                 0.03 * (1 + i % 5));
      if (!dev[i].Refill(host[i].desc())) return false;
    }
    return true;
  }

  // Enqueues amax -> scales -> quantize -> fused QDQ (computed amax), no synchronization.
  KernelStatus Enqueue(QuantMode mode, cudaStream_t stream, std::string* msg) {
    const int n = static_cast<int>(host.size());
    KernelStatus st = LaunchAmax(dev_descs.data(), n, nullptr, n, amax.as<float>(),
                                 nonfinite.as<int64_t>(), stream, msg);
    if (st != KernelStatus::kOk) return st;
    st = LaunchGlobalScales(amax.as<float>(), n, mode.e4m3_max, s_enc.as<float>(), nullptr, stream);
    if (st != KernelStatus::kOk) return st;
    st = LaunchQuantize(qjobs.data(), n, mode, stream, msg);
    if (st != KernelStatus::kOk) return st;
    return LaunchQdqComputeAmax(qdq_jobs.data(), n, mode, qdq_ws.data(), qdq_ws.size(), stream,
                                msg);
  }

  // Compares every output with the CPU reference; "" when all match.
  std::string Check(QuantMode mode) {
    for (size_t i = 0; i < host.size(); ++i) {
      const WeightDesc hd = host[i].desc();
      float cpu_amax = 0;
      if (ComputeAmax(hd, &cpu_amax) != KernelStatus::kOk) return "reference amax failed";
      const float got_amax = Download<float>(amax.as<float>() + i, 1)[0];
      if (FloatBitsOf({got_amax}) != FloatBitsOf({cpu_amax})) {
        return "amax of expert " + std::to_string(i);
      }
      HostQuantized want;
      std::string err;
      if (CpuQuantize(hd, &cpu_amax, mode, true, &want, &err) != KernelStatus::kOk) return err;
      const std::string m = CompareQuantized(quant[i].Download(), want);
      if (!m.empty()) return "quantize expert " + std::to_string(i) + ": " + m;
      std::vector<uint16_t> want_qdq(host[i].numel());
      QdqTask task{&hd, &cpu_amax, want_qdq.data()};
      if (FakeQuantize({&task, 1}, mode) != KernelStatus::kOk) return "reference QDQ failed";
      const std::string q =
          FirstMismatch(Download<uint16_t>(qdq_out[i].data(), want_qdq.size()), want_qdq);
      if (!q.empty()) return "QDQ expert " + std::to_string(i) + ": " + q;
    }
    return "";
  }
};

class NoSyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoCudaReason();
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
    ASSERT_EQ(Stream::Create(&stream_), cudaSuccess);
  }
  Stream stream_;
  std::string msg;
};

TEST_F(NoSyncTest, GraphCapturedQuantizeAndQdqReplayWithNewDataStayExact) {
  for (QuantMode mode :
       {QuantMode::Standard(), QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kExact)}) {
    SCOPED_TRACE(mode.Name());
    Experts e;
    ASSERT_TRUE(e.Init(8, 96, 512, 1000));
    WPUB_CUDA_OK(Graph::BeginCapture(stream_.get()));
    const KernelStatus st = e.Enqueue(mode, stream_.get(), &msg);
    Graph graph;
    const cudaError_t end = Graph::EndCapture(stream_.get(), &graph);
    ASSERT_EQ(st, KernelStatus::kOk) << msg;
    ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
    size_t nodes = 0;
    WPUB_CUDA_OK(cudaGraphGetNodes(graph.graph(), nullptr, &nodes));
    EXPECT_GT(nodes, 3u);
    for (uint64_t round = 0; round < 3; ++round) {
      SCOPED_TRACE("replay " + std::to_string(round));
      if (round > 0) {
        ASSERT_TRUE(e.Refill(5000 + 100 * round));
      }
      for (size_t i = 0; i < e.quant.size(); ++i) {  // poison outputs between replays
        WPUB_CUDA_OK(cudaMemset(e.quant[i].packed.data(), 0xA5, e.quant[i].packed.size()));
        WPUB_CUDA_OK(cudaMemset(e.qdq_out[i].data(), 0xA5, e.qdq_out[i].size()));
      }
      WPUB_CUDA_OK(cudaDeviceSynchronize());  // legacy-stream memsets before the replay
      WPUB_CUDA_OK(graph.Launch(stream_.get()));
      WPUB_CUDA_OK(stream_.Synchronize());
      ASSERT_EQ(e.Check(mode), "");
    }
  }
}

// Runs the enqueue of `count` experts under a CUPTI subscriber.
void CountCalls(int count, Stream& stream, int* sync_calls, int* launches, std::string* names) {
  Experts e;
  ASSERT_TRUE(e.Init(count, 128, 2048, 77));
  WPUB_CUDA_OK(stream.Synchronize());
  SyncCounter counter;
  std::string err;
  ASSERT_TRUE(counter.Start(&err)) << err;
  std::string msg;
  const QuantMode mode = QuantMode::FourOverSix(ErrMetric::kMAE, 256, ErrKind::kExact);
  const KernelStatus st = e.Enqueue(mode, stream.get(), &msg);
  counter.Stop();
  ASSERT_EQ(st, KernelStatus::kOk) << msg;
  *sync_calls = counter.synchronizing_calls();
  *names = counter.SynchronizingCallNames();
  *launches = 0;
  for (const auto& [name, n] : counter.calls_by_name()) {
    if (name.rfind("cudaLaunch", 0) == 0) *launches += n;
  }
  WPUB_CUDA_OK(stream.Synchronize());
  ASSERT_EQ(e.Check(mode), "");
}

TEST_F(NoSyncTest, CuptiCountsNoSynchronizingCallsWhileQuantizing64Experts) {
  int sync64 = -1, launches64 = -1, sync8 = -1, launches8 = -1;
  std::string names;
  CountCalls(64, stream_, &sync64, &launches64, &names);
  if (HasFatalFailure()) return;
  EXPECT_EQ(sync64, 0) << "synchronizing calls: " << names;
  // The subscriber must have seen the launches (amax, scales, quantize, amax + QDQ).
  EXPECT_GE(launches64, 4);
  CountCalls(8, stream_, &sync8, &launches8, &names);
  if (HasFatalFailure()) return;
  EXPECT_EQ(sync8, 0) << names;
  EXPECT_EQ(launches64, launches8) << "launches must not grow with the number of experts";

  // Positive control: the same counter does see a synchronizing call.
  SyncCounter counter;
  std::string err;
  ASSERT_TRUE(counter.Start(&err)) << err;
  WPUB_CUDA_OK(cudaStreamSynchronize(stream_.get()));
  counter.Stop();
  EXPECT_EQ(counter.synchronizing_calls(), 1) << counter.SynchronizingCallNames();
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
