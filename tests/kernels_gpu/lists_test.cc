// GPU vs CPU reference beyond the strict matrix: gate/up pairs sharing one amax, rank-3 stacks,
// multi-tensor lists of 1, 3, 8, 64 (and 200, past one launch's capacity) weights, multi-part
// inputs along dim 0 and dim 1, non-finite inputs, the global-scale contract, and argument
// validation (nothing is enqueued on a rejected call).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/reference.h"
#include "kernels/testing/test_data.h"
#include "tests/kernels_gpu/gpu_test_util.h"
#include "tests/kernels_gpu/quant_harness.h"

namespace wpub::kernels::cuda::testing {
namespace {

using ::wpub::kernels::testing::DataFamily;
using ::wpub::kernels::testing::MakeRandomTensor;
using ::wpub::kernels::testing::MakeTestTensor;
using ::wpub::kernels::testing::TestTensor;

const QuantMode kSomeModes[] = {
    QuantMode::Standard(),
    QuantMode::FourOverSix(ErrMetric::kMAE, 256, ErrKind::kExact),
    QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kFP16),
};

// Quantizes `weights` (host descs + device mirrors) as one list with the given per-weight
// device amax pointers and compares every weight with the CPU reference using cpu_amax[i].
void CheckQuantizeList(const std::vector<WeightDesc>& host, const std::vector<DeviceWeight>& dev,
                       const std::vector<const float*>& d_amax,
                       const std::vector<std::vector<float>>& cpu_amax, QuantMode mode,
                       bool swizzled, cudaStream_t stream, const LaunchLimits& limits = {}) {
  std::string msg;
  std::vector<DeviceQuantized> outs(host.size());
  std::vector<QuantizeJob> jobs(host.size());
  for (size_t i = 0; i < host.size(); ++i) {
    ASSERT_TRUE(outs[i].Init(host[i], swizzled));
    jobs[i].weight = dev[i].desc();
    jobs[i].out = outs[i].Output();
    jobs[i].amax = d_amax[i];
  }
  WPUB_KERNEL_OK(
      LaunchQuantize(jobs.data(), static_cast<int>(jobs.size()), mode, stream, &msg, limits));
  WPUB_CUDA_OK(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < host.size(); ++i) {
    HostQuantized want;
    ASSERT_EQ(CpuQuantize(host[i], cpu_amax[i].data(), mode, swizzled, &want, &msg),
              KernelStatus::kOk)
        << msg;
    ASSERT_EQ(CompareQuantized(outs[i].Download(), want), "")
        << "weight " << i << " of " << host.size() << ", mode " << mode.Name();
  }
}

// One amax launch over a list's device weights (under `limits`), checked bit for bit against the
// CPU reference; keeps the CPU amax per weight and the device amax pointers for quantize jobs.
struct ListAmax {
  DeviceBuffer d_amax, d_bad;
  std::vector<std::vector<float>> cpu;
  std::vector<const float*> d_ptrs;
};

void AmaxOfList(const std::vector<WeightDesc>& host, const std::vector<DeviceWeight>& dev,
                cudaStream_t stream, const LaunchLimits& limits, ListAmax* out) {
  const int count = static_cast<int>(host.size());
  std::vector<WeightDesc> dev_descs;
  for (const DeviceWeight& d : dev) dev_descs.push_back(d.desc());
  out->d_amax = Poisoned(count * sizeof(float));
  out->d_bad = Poisoned(count * sizeof(int64_t));
  std::string msg;
  WPUB_KERNEL_OK(LaunchAmax(dev_descs.data(), count, nullptr, count, out->d_amax.as<float>(),
                            out->d_bad.as<int64_t>(), stream, &msg, limits));
  out->cpu.assign(count, std::vector<float>(1));
  out->d_ptrs.clear();
  for (int i = 0; i < count; ++i) {
    ASSERT_EQ(ComputeAmax(host[i], out->cpu[i].data()), KernelStatus::kOk);
    out->d_ptrs.push_back(out->d_amax.as<float>() + i);
  }
  WPUB_CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<float> got = Download<float>(out->d_amax.data(), count);
  for (int i = 0; i < count; ++i) {
    ASSERT_EQ(FloatBitsOf({got[i]}), FloatBitsOf(out->cpu[i])) << "amax of weight " << i;
  }
}

class ListTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoCudaReason();
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
    ASSERT_EQ(Stream::Create(&stream_), cudaSuccess);
  }
  Stream stream_;
  std::string msg;
};

TEST_F(ListTest, GateUpPairSharesOneAmaxPerSlice) {
  for (int64_t slices : {1, 3}) {
    const TestTensor gate = MakeRandomTensor(ElemType::kBF16, 48, 128, 11, 1.0, slices);
    const TestTensor up = MakeRandomTensor(ElemType::kBF16, 48, 128, 12, 7.5, slices);
    DeviceWeight dg, du;
    ASSERT_TRUE(dg.Init(gate.desc()));
    ASSERT_TRUE(du.Init(up.desc()));
    DeviceBuffer d_amax = Poisoned(slices * sizeof(float));
    DeviceBuffer d_bad = Poisoned(slices * sizeof(int64_t));
    WPUB_KERNEL_OK(LaunchAmaxPair(dg.desc(), du.desc(), d_amax.as<float>(), d_bad.as<int64_t>(),
                                  stream_.get(), &msg));
    std::vector<float> cpu(slices);
    std::vector<int64_t> cpu_bad(slices);
    ASSERT_EQ(ComputePairAmax(gate.desc(), up.desc(), cpu.data(), cpu_bad.data(), AllCores(), &msg),
              KernelStatus::kOk);
    WPUB_CUDA_OK(stream_.Synchronize());
    EXPECT_EQ(FloatBitsOf(Download<float>(d_amax.data(), slices)), FloatBitsOf(cpu));
    EXPECT_EQ(Download<int64_t>(d_bad.data(), slices), cpu_bad);
    // The shared amax is the up tensor's here (larger sigma), so gate alone would differ.
    float gate_only = 0;
    ASSERT_EQ(ComputeAmax(gate.desc(), &gate_only), KernelStatus::kOk);
    EXPECT_NE(gate_only, cpu[0]);

    std::vector<DeviceWeight> dev(2);
    ASSERT_TRUE(dev[0].Init(gate.desc()));
    ASSERT_TRUE(dev[1].Init(up.desc()));
    for (QuantMode mode : kSomeModes) {
      CheckQuantizeList({gate.desc(), up.desc()}, dev, {d_amax.as<float>(), d_amax.as<float>()},
                        {cpu, cpu}, mode, /*swizzled=*/false, stream_.get());
    }
  }
}

TEST_F(ListTest, Rank3StackPerSliceAmaxScalesAndQdq) {
  for (ElemType type : {ElemType::kBF16, ElemType::kF16}) {
    const TestTensor t = MakeTestTensor(DataFamily::kRandom, type, 31, 128, 5, /*slices=*/5);
    DeviceWeight dev;
    ASSERT_TRUE(dev.Init(t.desc()));
    DeviceBuffer d_amax = Poisoned(5 * sizeof(float));
    WPUB_KERNEL_OK(LaunchAmax(dev.desc(), d_amax.as<float>(), nullptr, stream_.get(), &msg));
    std::vector<float> cpu(5);
    ASSERT_EQ(ComputeAmax(t.desc(), cpu.data()), KernelStatus::kOk);
    WPUB_CUDA_OK(stream_.Synchronize());
    ASSERT_EQ(FloatBitsOf(Download<float>(d_amax.data(), 5)), FloatBitsOf(cpu));
    for (int mi = 0; mi < kNumQuantModes; ++mi) {
      const QuantMode mode = QuantMode::FromIndex(mi);
      std::vector<DeviceWeight> devs(1);
      ASSERT_TRUE(devs[0].Init(t.desc()));
      CheckQuantizeList({t.desc()}, devs, {d_amax.as<float>()}, {cpu}, mode, true, stream_.get());
      // QDQ of the stack (per-slice amax) against the reference.
      const int64_t n = t.numel();
      DeviceBuffer d_out = Poisoned(n * 2);
      QdqJob qj;
      qj.weight = dev.desc();
      qj.out = d_out.data();
      qj.amax = d_amax.as<float>();
      WPUB_KERNEL_OK(LaunchQdq(&qj, 1, mode, stream_.get(), &msg));
      std::vector<uint16_t> want(n);
      const WeightDesc hd = t.desc();
      QdqTask task{&hd, cpu.data(), want.data()};
      ASSERT_EQ(FakeQuantize({&task, 1}, mode, AllCores(), &msg), KernelStatus::kOk);
      WPUB_CUDA_OK(stream_.Synchronize());
      ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_out.data(), n), want), "") << mode.Name();
    }
  }
}

// Weights of varied shapes and types for list tests.
std::vector<TestTensor> MakeList(int count, bool include_fp32) {
  static constexpr int64_t kRows[] = {1, 7, 32, 128, 3, 64, 16, 200};
  static constexpr int64_t kCols[] = {16, 64, 128, 2048, 48, 256, 512, 32};
  std::vector<TestTensor> out;
  for (int i = 0; i < count; ++i) {
    const ElemType type = include_fp32 && i % 3 == 2 ? ElemType::kF32
                          : i % 2 == 0               ? ElemType::kBF16
                                                     : ElemType::kF16;
    out.push_back(
        MakeRandomTensor(type, kRows[i % 8], kCols[(i * 3) % 8], 100 + i, 0.01 * (1 + i % 13)));
  }
  return out;
}

// 200 and 1100 weights take several launches (kMaxItemsPerLaunch items per quantize and QDQ
// launch, 8x that per amax launch).
TEST_F(ListTest, QuantizeAndQdqListsOf1To1100Weights) {
  for (int count : {1, 3, 8, 64, 200, 1100}) {
    SCOPED_TRACE("list of " + std::to_string(count));
    for (bool fp32 : {true, false}) {
      const std::vector<TestTensor> tensors = MakeList(count, fp32);
      std::vector<WeightDesc> host;
      std::vector<DeviceWeight> dev(count);
      for (int i = 0; i < count; ++i) {
        host.push_back(tensors[i].desc());
        ASSERT_TRUE(dev[i].Init(host[i]));
      }
      // One amax call for the whole list.
      ListAmax amax;
      ASSERT_NO_FATAL_FAILURE(AmaxOfList(host, dev, stream_.get(), {}, &amax));
      const std::vector<std::vector<float>>& cpu = amax.cpu;
      for (QuantMode mode : kSomeModes) {
        CheckQuantizeList(host, dev, amax.d_ptrs, cpu, mode, count <= 8, stream_.get());
      }
      if (fp32) continue;
      // Fused QDQ of the whole list with the amax computed inside the call.
      std::vector<QdqJob> jobs(count);
      std::vector<DeviceBuffer> outs;
      for (int i = 0; i < count; ++i) {
        outs.push_back(Poisoned(tensors[i].numel() * 2));
        jobs[i].weight = dev[i].desc();
        jobs[i].out = outs[i].data();
      }
      DeviceBuffer ws;
      WPUB_CUDA_OK(DeviceBuffer::Create(QdqComputeAmaxWorkspaceBytes(jobs.data(), count), &ws));
      const QuantMode mode = QuantMode::FourOverSix(ErrMetric::kMSE, 256, ErrKind::kExact);
      WPUB_KERNEL_OK(LaunchQdqComputeAmax(jobs.data(), count, mode, ws.data(), ws.size(),
                                          stream_.get(), &msg));
      WPUB_CUDA_OK(stream_.Synchronize());
      const std::vector<float> ws_amax = Download<float>(ws.data(), count);
      for (int i = 0; i < count; ++i) {
        ASSERT_EQ(FloatBitsOf({ws_amax[i]}), FloatBitsOf(cpu[i])) << "workspace amax " << i;
        std::vector<uint16_t> want(tensors[i].numel());
        QdqTask task{&host[i], nullptr, want.data()};
        ASSERT_EQ(FakeQuantize({&task, 1}, mode), KernelStatus::kOk);
        ASSERT_EQ(FirstMismatch(Download<uint16_t>(outs[i].data(), want.size()), want), "")
            << "QDQ weight " << i;
      }
    }
  }
}

// The two ways of LaunchQdqComputeAmax give the reference's bytes, amax and non-finite counts in
// every mode:
// the resident path with CTAs that keep 1 KiB, 4 KiB or all the shared memory they can (small
// stashes make these small weights take many rounds, spill past the grid's shared memory, and
// need several launches for 200 slices), and the two-pass path. The lists mix bf16 and fp16
// (one launch per type, one barrier counter across them), hold a rank-3 stack (one round item
// per slice), a weight fake-quantized in place, and a weight with inf and NaN elements.
TEST_F(ListTest, QdqComputeAmaxResidentRoundsSpillsAndTwoPassAgree) {
  struct Case {
    int count;
    QuantMode mode;
  };
  std::vector<Case> cases;
  for (int mi = 0; mi < kNumQuantModes; ++mi) cases.push_back({9, QuantMode::FromIndex(mi)});
  cases.push_back({200, QuantMode::Standard()});
  for (const Case& c : cases) {
    std::vector<TestTensor> tensors = MakeList(c.count, /*include_fp32=*/false);
    // A stack of 3 slices, and a weight larger than a 1 KiB-per-CTA grid holds (132 KiB on an
    // H200): 512 x 512 bf16 = 512 KiB.
    tensors[1] = MakeTestTensor(DataFamily::kRandom, ElemType::kF16, 40, 96, 21, /*slices=*/3);
    tensors[2] = MakeRandomTensor(ElemType::kBF16, 512, 512, 22, 0.02);
    // inf and NaN in weight 3 (bf16 bits), counted by the amax pass.
    uint16_t* bits3 = reinterpret_cast<uint16_t*>(tensors[3].bytes.data());
    if (tensors[3].type == ElemType::kF16) {
      bits3[5] = 0x7C00;  // +inf
      bits3[9] = 0xFE00;  // NaN
    } else {
      bits3[5] = 0xFF80;  // -inf
      bits3[9] = 0x7FC1;  // NaN
    }
    const int count = c.count;
    std::vector<WeightDesc> host;
    std::vector<DeviceWeight> dev(count);
    int64_t slices = 0;
    for (int i = 0; i < count; ++i) {
      host.push_back(tensors[i].desc());
      ASSERT_TRUE(dev[i].Init(host[i]));
      slices += host[i].num_slices;
    }
    // The CPU reference: amax and non-finite count per slice, then the fake quantization.
    std::vector<float> want_amax;
    std::vector<int64_t> want_bad;
    std::vector<std::vector<uint16_t>> want(count);
    for (int i = 0; i < count; ++i) {
      std::vector<float> a(host[i].num_slices);
      std::vector<int64_t> b(host[i].num_slices);
      ASSERT_EQ(ComputeAmax(host[i], a.data(), b.data()), KernelStatus::kOk);
      want_amax.insert(want_amax.end(), a.begin(), a.end());
      want_bad.insert(want_bad.end(), b.begin(), b.end());
      want[i].resize(tensors[i].numel());
      QdqTask task{&host[i], a.data(), want[i].data()};
      ASSERT_EQ(FakeQuantize({&task, 1}, c.mode), KernelStatus::kOk);
    }
    ASSERT_EQ(want_bad[host[0].num_slices + host[1].num_slices + host[2].num_slices], 2);

    struct Run {
      QdqAmaxPath path;
      int64_t cta_bytes;
    };
    for (const Run run : {Run{QdqAmaxPath::kResident, 1024}, Run{QdqAmaxPath::kResident, 4096},
                          Run{QdqAmaxPath::kResident, 0}, Run{QdqAmaxPath::kTwoPass, 0}}) {
      SCOPED_TRACE(std::string(c.mode.Name()) + ", " + std::to_string(count) + " weights, " +
                   (run.path == QdqAmaxPath::kTwoPass
                        ? "two-pass"
                        : "resident, " + std::to_string(run.cta_bytes) + " bytes per CTA"));
      // Weight 0 in place: its output is its input (refilled for every run).
      ASSERT_TRUE(dev[0].Refill(host[0]));
      std::vector<QdqJob> jobs(count);
      std::vector<DeviceBuffer> outs(count);
      for (int i = 0; i < count; ++i) {
        jobs[i].weight = dev[i].desc();
        if (i == 0) {
          jobs[i].out = const_cast<void*>(dev[i].desc().parts[0].data);
        } else {
          outs[i] = Poisoned(tensors[i].numel() * 2);
          jobs[i].out = outs[i].data();
        }
      }
      const size_t ws_bytes = QdqComputeAmaxWorkspaceBytes(jobs.data(), count);
      DeviceBuffer ws = Poisoned(ws_bytes);
      QdqAmaxOptions opt;
      opt.path = run.path;
      opt.resident_cta_bytes = run.cta_bytes;
      WPUB_KERNEL_OK(LaunchQdqComputeAmax(jobs.data(), count, c.mode, ws.data(), ws_bytes,
                                          stream_.get(), &msg, opt));
      WPUB_CUDA_OK(stream_.Synchronize());
      ASSERT_EQ(FloatBitsOf(Download<float>(ws.data(), slices)), FloatBitsOf(want_amax));
      const size_t count_at = QdqWorkspaceCountOffset(jobs.data(), count);
      ASSERT_EQ(Download<int64_t>(static_cast<uint8_t*>(ws.data()) + count_at, slices), want_bad);
      for (int i = 0; i < count; ++i) {
        ASSERT_EQ(FirstMismatch(Download<uint16_t>(jobs[i].out, want[i].size()), want[i]), "")
            << "weight " << i;
      }
    }
  }
}

// An occupancy cap (LaunchLimits) changes where CTAs run, never a byte: amax and quantize of a
// list under caps of 1, 2 and 3 CTAs per SM equal the CPU reference.
TEST_F(ListTest, OccupancyCapLeavesAmaxAndQuantizeBytesUnchanged) {
  constexpr int kCount = 8;
  for (const int cap : {1, 2, 3}) {
    SCOPED_TRACE("at most " + std::to_string(cap) + " CTAs per SM");
    for (bool fp32 : {true, false}) {
      const std::vector<TestTensor> tensors = MakeList(kCount, fp32);
      std::vector<WeightDesc> host;
      std::vector<DeviceWeight> dev(kCount);
      for (int i = 0; i < kCount; ++i) {
        host.push_back(tensors[i].desc());
        ASSERT_TRUE(dev[i].Init(host[i]));
      }
      ListAmax amax;
      ASSERT_NO_FATAL_FAILURE(AmaxOfList(host, dev, stream_.get(), LaunchLimits{cap}, &amax));
      for (QuantMode mode : kSomeModes) {
        CheckQuantizeList(host, dev, amax.d_ptrs, amax.cpu, mode, true, stream_.get(),
                          LaunchLimits{cap});
      }
    }
  }
}

// A weight assembled from parts: the GPU reads every part in place.
struct PartedWeight {
  std::vector<TestTensor> parts;
  WeightDesc desc;
};

PartedWeight MakeParted(ElemType type, ConcatDim dim, const std::vector<int64_t>& extents,
                        int64_t other, int64_t slices) {
  PartedWeight w;
  w.desc.type = type;
  w.desc.concat = dim;
  w.desc.num_slices = slices;
  for (size_t i = 0; i < extents.size(); ++i) {
    const int64_t rows = dim == ConcatDim::kRows ? extents[i] : other;
    const int64_t cols = dim == ConcatDim::kRows ? other : extents[i];
    w.parts.push_back(MakeRandomTensor(type, rows, cols, 40 + i, 0.5 + i, slices));
  }
  for (const TestTensor& t : w.parts) w.desc.AddPart(t.data(), t.rows, t.cols);
  return w;
}

TEST_F(ListTest, MultiPartInputsAlongDim0AndDim1) {
  std::vector<PartedWeight> cases;
  cases.push_back(MakeParted(ElemType::kBF16, ConcatDim::kRows, {5, 16, 1}, 64, 1));
  cases.push_back(MakeParted(ElemType::kF16, ConcatDim::kCols, {32, 16, 80}, 37, 1));
  cases.push_back(MakeParted(ElemType::kF32, ConcatDim::kCols, {128, 128}, 130, 2));
  cases.push_back(MakeParted(ElemType::kBF16, ConcatDim::kRows, {128, 3, 129}, 48, 3));
  std::vector<WeightDesc> host;
  std::vector<DeviceWeight> dev(cases.size());
  std::vector<DeviceBuffer> amax;
  std::vector<const float*> d_ptrs;
  std::vector<std::vector<float>> cpu;
  for (size_t i = 0; i < cases.size(); ++i) {
    host.push_back(cases[i].desc);
    ASSERT_TRUE(dev[i].Init(host[i]));
    const int64_t s = host[i].num_slices;
    amax.push_back(Poisoned(s * sizeof(float)));
    WPUB_KERNEL_OK(
        LaunchAmax(dev[i].desc(), amax.back().as<float>(), nullptr, stream_.get(), &msg));
    d_ptrs.push_back(amax.back().as<float>());
    cpu.emplace_back(s);
    ASSERT_EQ(ComputeAmax(host[i], cpu.back().data()), KernelStatus::kOk);
  }
  WPUB_CUDA_OK(stream_.Synchronize());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_EQ(FloatBitsOf(Download<float>(d_ptrs[i], cpu[i].size())), FloatBitsOf(cpu[i])) << i;
  }
  for (int mi = 0; mi < kNumQuantModes; ++mi) {
    CheckQuantizeList(host, dev, d_ptrs, cpu, QuantMode::FromIndex(mi), true, stream_.get());
  }
}

TEST_F(ListTest, NonFiniteInputsCountedAndQuantizedLikeTheReference) {
  for (ElemType type : {ElemType::kBF16, ElemType::kF16, ElemType::kF32}) {
    TestTensor t = MakeRandomTensor(type, 33, 96, 9, 2.0);
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    ::wpub::kernels::testing::StoreFromDouble(t.data(), 5, type, inf);
    ::wpub::kernels::testing::StoreFromDouble(t.data(), 700, type, -inf);
    ::wpub::kernels::testing::StoreFromDouble(t.data(), 1000, type, nan);
    for (int i = 1600; i < 1616; ++i) {  // one all-NaN block
      ::wpub::kernels::testing::StoreFromDouble(t.data(), i, type, nan);
    }
    DeviceWeight dev;
    ASSERT_TRUE(dev.Init(t.desc()));
    DeviceBuffer d_amax = Poisoned(4);
    DeviceBuffer d_bad = Poisoned(8);
    WPUB_KERNEL_OK(
        LaunchAmax(dev.desc(), d_amax.as<float>(), d_bad.as<int64_t>(), stream_.get(), &msg));
    float cpu = 0;
    int64_t cpu_bad = 0;
    ASSERT_EQ(ComputeAmax(t.desc(), &cpu, &cpu_bad), KernelStatus::kOk);
    WPUB_CUDA_OK(stream_.Synchronize());
    EXPECT_EQ(cpu_bad, 19);
    EXPECT_EQ(Download<int64_t>(d_bad.data(), 1)[0], cpu_bad);
    ASSERT_EQ(FloatBitsOf(Download<float>(d_amax.data(), 1)), FloatBitsOf({cpu}));
    std::vector<DeviceWeight> devs(1);
    ASSERT_TRUE(devs[0].Init(t.desc()));
    for (int mi = 0; mi < kNumQuantModes; ++mi) {
      const std::vector<std::vector<float>> cpu_list(1, std::vector<float>(1, cpu));
      CheckQuantizeList({t.desc()}, devs, {d_amax.as<float>()}, cpu_list, QuantMode::FromIndex(mi),
                        false, stream_.get());
    }
  }
}

// Float bits with every NaN replaced by one pattern.
std::vector<uint32_t> NanCanonical(const std::vector<float>& v) {
  std::vector<uint32_t> bits = FloatBitsOf(v);
  for (uint32_t& b : bits) {
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) b = 0x7FC00000u;
  }
  return bits;
}

TEST_F(ListTest, GlobalScaleContractBitsAndShape) {
  const float kValues[] = {0.0f,
                           1.0f,
                           3.5f,
                           std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           -0.0f,
                           std::numeric_limits<float>::denorm_min()};
  for (int e : {256, 448}) {
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{}, {1}, {8}, {2, 4}, {10}}) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      F32Array in;
      in.shape = shape;
      for (int64_t i = 0; i < n; ++i) in.values.push_back(kValues[i % 10]);
      F32Array enc, dec;
      ASSERT_EQ(GlobalEncodeScales(in, e, &enc), KernelStatus::kOk);
      ASSERT_EQ(GlobalDecodeScales(in, e, &dec), KernelStatus::kOk);
      DeviceBuffer d_in = Upload(in.values);
      DeviceBuffer d_enc = Poisoned(n * 4);
      DeviceBuffer d_dec = Poisoned(n * 4);
      ASSERT_EQ(LaunchGlobalScales(d_in.as<float>(), n, e, d_enc.as<float>(), d_dec.as<float>(),
                                   stream_.get()),
                KernelStatus::kOk);
      WPUB_CUDA_OK(stream_.Synchronize());
      // Bit for bit, NaN == NaN (the spec's rule: the device's division returns its canonical
      // NaN 0x7FFFFFFF where the host's keeps the input's quiet NaN).
      EXPECT_EQ(NanCanonical(Download<float>(d_enc.data(), n)), NanCanonical(enc.values));
      EXPECT_EQ(NanCanonical(Download<float>(d_dec.data(), n)), NanCanonical(dec.values));
      EXPECT_EQ(enc.shape, shape);
    }
  }
  EXPECT_EQ(LaunchGlobalScales(nullptr, 1, 448, nullptr, nullptr, stream_.get()),
            KernelStatus::kInvalidArgument);
  DeviceBuffer tmp = Poisoned(16);
  EXPECT_EQ(LaunchGlobalScales(tmp.as<float>(), 1, 300, tmp.as<float>(), nullptr, stream_.get()),
            KernelStatus::kInvalidArgument);
}

TEST_F(ListTest, RejectsBadArgumentsBeforeAnyLaunch) {
  const TestTensor good = MakeRandomTensor(ElemType::kBF16, 4, 64, 1);
  DeviceWeight dev;
  ASSERT_TRUE(dev.Init(good.desc()));
  DeviceBuffer d_amax = Upload(std::vector<float>{1.0f});
  DeviceQuantized out;
  ASSERT_TRUE(out.Init(good.desc(), false));
  const std::vector<uint8_t> poison = Download<uint8_t>(out.packed.data(), out.packed.size());

  QuantizeJob jobs[2];
  jobs[0].weight = dev.desc();
  jobs[0].out = out.Output();
  jobs[0].amax = d_amax.as<float>();
  // Job 1: K = 40 (not a multiple of 16). The first, valid job must not be launched either.
  jobs[1] = jobs[0];
  jobs[1].weight.parts[0].rows = 8;
  jobs[1].weight.parts[0].cols = 40;
  EXPECT_EQ(LaunchQuantize(jobs, 2, QuantMode::Standard(), stream_.get(), &msg),
            KernelStatus::kInvalidArgument);
  EXPECT_NE(msg.find("weight 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple of 16"), std::string::npos) << msg;
  WPUB_CUDA_OK(stream_.Synchronize());
  EXPECT_EQ(Download<uint8_t>(out.packed.data(), out.packed.size()), poison);

  QuantMode bad_mode = QuantMode::FourOverSix(ErrMetric::kMAE, 300, ErrKind::kExact);
  EXPECT_EQ(LaunchQuantize(jobs, 1, bad_mode, stream_.get(), &msg), KernelStatus::kInvalidArgument);
  QuantizeJob misaligned = jobs[0];
  misaligned.weight.parts[0].data = static_cast<const char*>(dev.desc().parts[0].data) + 2;
  misaligned.weight.parts[0].rows = 2;
  EXPECT_EQ(LaunchQuantize(&misaligned, 1, QuantMode::Standard(), stream_.get(), &msg),
            KernelStatus::kUnsupported);
  QuantizeJob straddling = jobs[0];
  straddling.weight.concat = ConcatDim::kCols;
  straddling.weight.parts[0].cols = 24;
  straddling.weight.AddPart(dev.desc().parts[0].data, 4, 24);
  EXPECT_EQ(LaunchQuantize(&straddling, 1, QuantMode::Standard(), stream_.get(), &msg),
            KernelStatus::kUnsupported);
  EXPECT_NE(msg.find("multiple of 16"), std::string::npos) << msg;

  QdqJob qj;
  qj.weight = dev.desc();
  qj.out = out.packed.data();
  EXPECT_EQ(LaunchQdq(&qj, 1, QuantMode::Standard(), stream_.get(), &msg),
            KernelStatus::kInvalidArgument);  // amax missing
  EXPECT_EQ(LaunchQdqComputeAmax(&qj, 1, QuantMode::Standard(), out.scales.data(), 1, stream_.get(),
                                 &msg),
            KernelStatus::kWorkspaceTooSmall);
  QdqJob fp32 = qj;
  fp32.weight.type = ElemType::kF32;
  fp32.amax = d_amax.as<float>();
  EXPECT_EQ(LaunchQdq(&fp32, 1, QuantMode::Standard(), stream_.get(), &msg),
            KernelStatus::kUnsupported);
  WPUB_CUDA_OK(stream_.Synchronize());
  EXPECT_EQ(Download<uint8_t>(out.packed.data(), out.packed.size()), poison);
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
