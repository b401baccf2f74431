// The spec's strict matrix on the GPU: {bf16, fp16, fp32 (quantize only)} x the 12 shapes x the
// 4 data families x the 9 modes, every output compared with the CPU reference byte for byte:
// amax and non-finite count, packed codes, linear and swizzled scales, decode scales,
// dequantized values and fused-QDQ values (as uint16, so signed zeros count).
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/reference.h"
#include "kernels/testing/test_data.h"
#include "tests/kernels_gpu/gpu_test_util.h"
#include "tests/kernels_gpu/quant_harness.h"

// Readable parameter values in test listings (gtest finds PrintTo by argument-dependent lookup).
namespace wpub::kernels {
void PrintTo(ElemType t, std::ostream* os) { *os << ElemTypeName(t); }
namespace testing {
void PrintTo(DataFamily f, std::ostream* os) { *os << DataFamilyName(f); }
}  // namespace testing
}  // namespace wpub::kernels

namespace wpub::kernels::cuda::testing {
namespace {

using ::wpub::kernels::testing::DataFamily;
using ::wpub::kernels::testing::DataFamilyName;
using ::wpub::kernels::testing::kAllDataFamilies;
using ::wpub::kernels::testing::kSpecShapes;
using ::wpub::kernels::testing::MakeTestTensor;
using ::wpub::kernels::testing::TestTensor;

using MatrixParam = std::tuple<ElemType, int, DataFamily>;

class StrictMatrixTest : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(StrictMatrixTest, AllModesMatchCpuReference) {
  WPUB_REQUIRE_CUDA();
  const auto [type, shape_index, family] = GetParam();
  const auto shape = kSpecShapes[shape_index];
  const TestTensor t = MakeTestTensor(family, type, shape.rows, shape.cols, /*seed=*/shape_index);
  const WeightDesc host = t.desc();
  std::string msg;

  DeviceWeight dev;
  ASSERT_TRUE(dev.Init(host));
  Stream stream;
  WPUB_CUDA_OK(Stream::Create(&stream));

  // Amax and non-finite count.
  DeviceBuffer d_amax = Poisoned(sizeof(float));
  DeviceBuffer d_bad = Poisoned(sizeof(int64_t));
  WPUB_KERNEL_OK(
      LaunchAmax(dev.desc(), d_amax.as<float>(), d_bad.as<int64_t>(), stream.get(), &msg));
  float cpu_amax = 0;
  int64_t cpu_bad = 0;
  ASSERT_EQ(ComputeAmax(host, &cpu_amax, &cpu_bad, AllCores(), &msg), KernelStatus::kOk) << msg;
  WPUB_CUDA_OK(stream.Synchronize());
  EXPECT_EQ(FloatBitsOf(Download<float>(d_amax.data(), 1))[0], FloatBitsOf({cpu_amax})[0]);
  EXPECT_EQ(Download<int64_t>(d_bad.data(), 1)[0], cpu_bad);

  const int64_t n = t.numel();
  const ElemType out_type = type == ElemType::kF32 ? ElemType::kBF16 : type;
  for (int mi = 0; mi < kNumQuantModes; ++mi) {
    const QuantMode mode = QuantMode::FromIndex(mi);
    SCOPED_TRACE(mode.Name());
    // Quantize, with the swizzled layout too.
    DeviceQuantized dq;
    ASSERT_TRUE(dq.Init(host, /*with_swizzled=*/true));
    QuantizeJob job;
    job.weight = dev.desc();
    job.out = dq.Output();
    job.amax = d_amax.as<float>();
    WPUB_KERNEL_OK(LaunchQuantize(&job, 1, mode, stream.get(), &msg));
    HostQuantized want;
    ASSERT_EQ(CpuQuantize(host, &cpu_amax, mode, true, &want, &msg), KernelStatus::kOk) << msg;
    WPUB_CUDA_OK(stream.Synchronize());
    const HostQuantized got = dq.Download();
    ASSERT_EQ(CompareQuantized(got, want), "");

    // Dequantize the GPU's own outputs; the reference decodes its own.
    DequantizeJob dj;
    dj.in.packed = dq.packed.as<uint8_t>();
    dj.in.scales = dq.scales.as<uint8_t>();
    dj.in.amax = d_amax.as<float>();
    dj.in.rows = shape.rows;
    dj.in.cols = shape.cols;
    dj.out_type = out_type;
    DeviceBuffer d_deq = Poisoned(n * 2);
    dj.out = d_deq.data();
    WPUB_KERNEL_OK(LaunchDequantize(&dj, 1, mode, stream.get(), &msg));
    QuantizedView hv;
    hv.packed = want.packed.data();
    hv.scales = want.scales.data();
    hv.amax = &cpu_amax;
    hv.rows = shape.rows;
    hv.cols = shape.cols;
    std::vector<uint16_t> want_deq(n);
    ASSERT_EQ(Dequantize(hv, mode, out_type, want_deq.data(), AllCores(), &msg), KernelStatus::kOk)
        << msg;

    // Fused QDQ, caller-provided amax and computed amax.
    std::vector<uint16_t> want_qdq;
    DeviceBuffer d_qdq = Poisoned(n * 2);
    DeviceBuffer d_qdq2 = Poisoned(n * 2);
    DeviceBuffer d_qdq3 = Poisoned(n * 2);
    DeviceBuffer d_qdq4 = Poisoned(n * 2);
    if (type != ElemType::kF32) {
      QdqJob qj;
      qj.weight = dev.desc();
      qj.out = d_qdq.data();
      qj.amax = d_amax.as<float>();
      WPUB_KERNEL_OK(LaunchQdq(&qj, 1, mode, stream.get(), &msg));
      qj.out = d_qdq2.data();
      qj.amax = nullptr;
      DeviceBuffer ws;
      WPUB_CUDA_OK(DeviceBuffer::Create(QdqComputeAmaxWorkspaceBytes(&qj, 1), &ws));
      WPUB_KERNEL_OK(LaunchQdqComputeAmax(&qj, 1, mode, ws.data(), ws.size(), stream.get(), &msg));
      // Both ways of computing the amax inside the call (kAuto takes one of them per mode).
      qj.out = d_qdq3.data();
      QdqAmaxOptions resident;
      resident.path = QdqAmaxPath::kResident;
      WPUB_KERNEL_OK(
          LaunchQdqComputeAmax(&qj, 1, mode, ws.data(), ws.size(), stream.get(), &msg, resident));
      qj.out = d_qdq4.data();
      QdqAmaxOptions two_pass;
      two_pass.path = QdqAmaxPath::kTwoPass;
      WPUB_KERNEL_OK(
          LaunchQdqComputeAmax(&qj, 1, mode, ws.data(), ws.size(), stream.get(), &msg, two_pass));
      want_qdq.resize(n);
      QdqTask task;
      task.weight = &host;
      task.amax = &cpu_amax;
      task.out = want_qdq.data();
      ASSERT_EQ(FakeQuantize({&task, 1}, mode, AllCores(), &msg), KernelStatus::kOk) << msg;
    }
    WPUB_CUDA_OK(stream.Synchronize());
    ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_deq.data(), n), want_deq), "") << "dequantize";
    if (type != ElemType::kF32) {
      const std::vector<uint16_t> got_qdq = Download<uint16_t>(d_qdq.data(), n);
      ASSERT_EQ(FirstMismatch(got_qdq, want_qdq), "") << "fused QDQ, given amax";
      ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_qdq2.data(), n), want_qdq), "")
          << "fused QDQ, computed amax";
      ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_qdq3.data(), n), want_qdq), "")
          << "fused QDQ, computed amax, resident";
      ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_qdq4.data(), n), want_qdq), "")
          << "fused QDQ, computed amax, two-pass";
      // The contract itself, on the device: qdq(x) == dequantize(quantize(x)).
      ASSERT_EQ(FirstMismatch(got_qdq, Download<uint16_t>(d_deq.data(), n)), "")
          << "qdq != dequantize(quantize)";
    }
  }
}

std::string MatrixName(const ::testing::TestParamInfo<MatrixParam>& info) {
  const auto [type, shape_index, family] = info.param;
  const auto shape = kSpecShapes[std::get<1>(info.param)];
  return std::string(ElemTypeName(type)) + "_" + std::to_string(shape.rows) + "x" +
         std::to_string(shape.cols) + "_" + DataFamilyName(family);
}

INSTANTIATE_TEST_SUITE_P(
    Spec, StrictMatrixTest,
    ::testing::Combine(::testing::Values(ElemType::kBF16, ElemType::kF16, ElemType::kF32),
                       ::testing::Range(0, 12), ::testing::ValuesIn(kAllDataFamilies)),
    MatrixName);

}  // namespace
}  // namespace wpub::kernels::cuda::testing
