// A 1 GiB bf16 tensor ([32768, 16384], 2^29 elements) compared with the CPU reference in full:
// amax, standard and 4over6 quantize (every code, scale and the decode scale) and fused QDQ
// (every output element as uint16).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/reference.h"
#include "tests/kernels_gpu/gpu_test_util.h"
#include "tests/kernels_gpu/quant_harness.h"

namespace wpub::kernels::cuda::testing {
namespace {

constexpr int64_t kRows = 32768;
constexpr int64_t kCols = 16384;
static_assert(kRows * kCols * 2 == int64_t{1} << 30, "one GiB of bf16");

// Deterministic bf16 values spread over many binades (exponents 100..140, both signs, every
// mantissa), with some all-zero and tiny blocks; filled on all cores (splitmix64 per element).
std::vector<uint16_t> MakeData() {
  std::vector<uint16_t> v(static_cast<size_t>(kRows * kCols));
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  const size_t chunk = (v.size() + threads - 1) / threads;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const size_t end = std::min(v.size(), (t + 1) * chunk);
      for (size_t i = t * chunk; i < end; ++i) {
        uint64_t z = i + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const uint32_t block = static_cast<uint32_t>(i / 16);
        uint32_t exp = 100 + static_cast<uint32_t>((z >> 8) % 41);
        if (block % 97 == 0) exp = 0;            // zero / subnormal blocks
        if (block % 89 == 0) exp = 1 + exp % 3;  // tiny normal blocks (scale underflow)
        v[i] = static_cast<uint16_t>(((z >> 1) & 0x8000u) | (exp << 7) | (z & 0x7Fu));
      }
    });
  }
  for (std::thread& th : pool) th.join();
  return v;
}

TEST(LargeTensorTest, OneGiBTensorComparedInFull) {
  WPUB_REQUIRE_CUDA();
  std::string msg;
  const std::vector<uint16_t> data = MakeData();
  const WeightDesc host = WeightDesc::Dense(data.data(), kRows, kCols, ElemType::kBF16);
  DeviceWeight dev;
  ASSERT_TRUE(dev.Init(host));
  Stream stream;
  WPUB_CUDA_OK(Stream::Create(&stream));

  DeviceBuffer d_amax = Poisoned(4);
  WPUB_KERNEL_OK(LaunchAmax(dev.desc(), d_amax.as<float>(), nullptr, stream.get(), &msg));
  float cpu_amax = 0;
  ASSERT_EQ(ComputeAmax(host, &cpu_amax, nullptr, AllCores()), KernelStatus::kOk);
  WPUB_CUDA_OK(stream.Synchronize());
  ASSERT_EQ(FloatBitsOf(Download<float>(d_amax.data(), 1)), FloatBitsOf({cpu_amax}));

  for (QuantMode mode :
       {QuantMode::Standard(), QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kExact)}) {
    SCOPED_TRACE(mode.Name());
    DeviceQuantized dq;
    ASSERT_TRUE(dq.Init(host, /*with_swizzled=*/false));
    QuantizeJob job;
    job.weight = dev.desc();
    job.out = dq.Output();
    job.amax = d_amax.as<float>();
    WPUB_KERNEL_OK(LaunchQuantize(&job, 1, mode, stream.get(), &msg));
    HostQuantized want;
    ASSERT_EQ(CpuQuantize(host, &cpu_amax, mode, false, &want, &msg), KernelStatus::kOk);
    WPUB_CUDA_OK(stream.Synchronize());
    ASSERT_EQ(CompareQuantized(dq.Download(), want), "");
  }

  const QuantMode mode = QuantMode::Standard();
  DeviceBuffer d_out = Poisoned(data.size() * 2);
  QdqJob qj;
  qj.weight = dev.desc();
  qj.out = d_out.data();
  qj.amax = d_amax.as<float>();
  WPUB_KERNEL_OK(LaunchQdq(&qj, 1, mode, stream.get(), &msg));
  std::vector<uint16_t> want(data.size());
  QdqTask task{&host, &cpu_amax, want.data()};
  ASSERT_EQ(FakeQuantize({&task, 1}, mode, AllCores()), KernelStatus::kOk);
  WPUB_CUDA_OK(stream.Synchronize());
  ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_out.data(), data.size()), want), "");

  // The resident fused QDQ with its amax computed: one slice of 2^25 blocks, most of it spilled
  // past the grid's shared memory and read twice.
  DeviceBuffer d_out2 = Poisoned(data.size() * 2);
  qj.out = d_out2.data();
  DeviceBuffer ws;
  WPUB_CUDA_OK(DeviceBuffer::Create(QdqComputeAmaxWorkspaceBytes(&qj, 1), &ws));
  QdqAmaxOptions resident;
  resident.path = QdqAmaxPath::kResident;
  WPUB_KERNEL_OK(
      LaunchQdqComputeAmax(&qj, 1, mode, ws.data(), ws.size(), stream.get(), &msg, resident));
  WPUB_CUDA_OK(stream.Synchronize());
  ASSERT_EQ(FloatBitsOf(Download<float>(ws.data(), 1)), FloatBitsOf({cpu_amax}));
  ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_out2.data(), data.size()), want), "");

  // kAuto on a slice of many grid stashes takes the two-pass path: the same bytes again.
  DeviceBuffer d_out3 = Poisoned(data.size() * 2);
  qj.out = d_out3.data();
  WPUB_KERNEL_OK(LaunchQdqComputeAmax(&qj, 1, mode, ws.data(), ws.size(), stream.get(), &msg));
  WPUB_CUDA_OK(stream.Synchronize());
  ASSERT_EQ(FloatBitsOf(Download<float>(ws.data(), 1)), FloatBitsOf({cpu_amax}));
  ASSERT_EQ(FirstMismatch(Download<uint16_t>(d_out3.data(), data.size()), want), "");
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
