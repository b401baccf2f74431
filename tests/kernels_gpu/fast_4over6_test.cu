// The device build of kernels/cuda/fast_4over6.h against the shared scalar functions, on the
// device: the scaled E2M1 rounding for every fp32 input below its limit, DivSix over its whole
// domain, and fuzzed blocks through the cheap 4over6 path (candidate table built on the device,
// as the kernels do) against QuantizeBlockPacked, and their fused-QDQ values against
// DecodeElement, in all 8 4over6 modes. The CPU tests
// (tests/kernels_cpu/fast_4over6_test.cc) prove the same source built for the host; this checks
// that the device intrinsics (e4m3x2 conversion, viaddmax, fminf/fmaxf, rcp) agree.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/fast_4over6.h"
#include "tests/kernels_gpu/gpu_test_util.h"

namespace wpub::kernels::cuda::testing {
namespace {

using detail::Candidate;
using detail::CandidateTable;
using detail::CheapSlice;
using detail::PackedBlock;

struct Counts {
  unsigned long long mismatches;
  unsigned long long first;  // smallest mismatching input
  unsigned long long cheap;  // blocks the cheap path took
};

__device__ void Fail(Counts* c, uint64_t input) {
  atomicAdd(&c->mismatches, 1ull);
  atomicMin(&c->first, static_cast<unsigned long long>(input));
}

// kind 0: RoundE2M1Scaled over |v'| < 7 * 2^-6 (both signs); kind 1: DivSix over its domain.
__global__ void ExhaustiveKernel(int kind, uint64_t n, Counts* out) {
  const uint32_t limit = FloatBits(detail::kSimpleLimit);
  const uint32_t lo = FloatBits(detail::kDivSixMin);
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (kind == 0) {
      const uint32_t bits =
          i < limit ? static_cast<uint32_t>(i) : (static_cast<uint32_t>(i - limit) | 0x80000000u);
      const float v = BitsFloat(bits);
      const float want = FMul(FAbs(E2M1ToFloat(FloatToE2M1(FMul(v, 0x1p6f)))), detail::kCodeScale);
      if (FloatBits(detail::RoundE2M1Scaled(v)) != FloatBits(want)) Fail(out, bits);
    } else {
      const float b = i == 0 ? 0.0f : BitsFloat(static_cast<uint32_t>(lo + i - 1));
      if (FloatBits(detail::DivSix(b)) != FloatBits(__fdiv_rn(b, 6.0f))) Fail(out, FloatBits(b));
    }
  }
}

__device__ uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ float Bf16Round(float v) { return Bf16ToFloat(FloatToBf16(v)); }

// Fuzzed bf16-valued blocks: mostly ordinary values at one of 64 magnitudes (so blocks of one
// CTA share a tensor amax, as in a real tensor), with E2M1 boundary values, zeros of both signs,
// tiny values, and rarely inf/NaN mixed in.
__device__ void FuzzBlock(uint64_t seed, float scale, float (&x)[kBlockSize]) {
  for (int i = 0; i < kBlockSize; ++i) {
    const uint64_t r = Mix(seed * 131 + i + 1);
    const uint32_t kind = r % 256;
    float v;
    if (kind == 0) {
      v = __uint_as_float(0x7FC00000u);
    } else if (kind == 1) {
      v = (r & 256) ? -INFINITY : INFINITY;
    } else if (kind < 8) {
      v = (r & 256) ? -0.0f : 0.0f;
    } else if (kind < 16) {
      v = ldexpf(static_cast<float>((r >> 12) % 1000), -140);  // tiny and subnormal
    } else if (kind < 64) {
      const float b[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
      v = b[(r >> 8) % 8] * scale * (1.0f + ((r >> 16) % 3 - 1.0f) * 1e-2f);
    } else {
      v = static_cast<float>(static_cast<int32_t>(r >> 40) % 100000) / 16667.0f * scale;
    }
    if ((r >> 20) & 1) v = -v;
    x[i] = Bf16Round(v);
  }
}

// The reference's 8 packed bytes as two words (byte i at bits 8 * (i % 4)).
__device__ void PackedWords(const uint8_t (&want)[kBlockSize / 2], uint32_t& lo, uint32_t& hi) {
  lo = want[0] | (want[1] << 8) | (want[2] << 16) | (uint32_t{want[3]} << 24);
  hi = want[4] | (want[5] << 8) | (want[6] << 16) | (uint32_t{want[7]} << 24);
}

// Whether y holds DecodeElement(code, factor) of every reference code, bit for bit.
__device__ bool DecodesTo(const float (&y)[kBlockSize], const uint8_t (&want)[kBlockSize / 2],
                          float factor) {
  bool ok = true;
  for (int i = 0; i < kBlockSize; ++i) {
    const uint8_t code = (want[i / 2] >> (4 * (i % 2))) & 0xF;
    ok = ok && FloatBits(y[i]) == FloatBits(DecodeElement(code, factor));
  }
  return ok;
}

// The cheap 4over6 path of one slice, for FuzzSlice: the candidate table built by the CTA's
// threads like QuantizeKernel's (every thread must construct it: it synchronizes the CTA).
template <class Traits>
struct FourOverSixPath {
  CheapSlice s;
  const Candidate* table;
  __device__ bool Codes(const float (&x)[kBlockSize], PackedBlock& got) const {
    return detail::QuantizeBlockFourOverSixCheap<Traits>(x, s, CandidateTable{table}, got);
  }
  // The fused QDQ's values of the same block (false if the path declines it).
  __device__ bool Values(const float (&x)[kBlockSize], float factor64,
                         float (&y)[kBlockSize]) const {
    detail::CheapBlock cb;
    if (!detail::FourOverSixCheapCodes<Traits>(x, s, CandidateTable{table}, cb)) return false;
    detail::DecodeCheapBlock(cb, x, factor64, y);
    return true;
  }
};

// Standard NVFP4 on the same primitives (StandardCheapValues: max.NaN.f32 for the block max).
struct StandardPath {
  CheapSlice s;
  __device__ bool Codes(const float (&x)[kBlockSize], PackedBlock& got) const {
    return detail::QuantizeBlockStandardCheap(x, s, got);
  }
  __device__ bool Values(const float (&x)[kBlockSize], float factor64,
                         float (&y)[kBlockSize]) const {
    float q[kBlockSize];
    uint32_t sf = 0;
    if (!detail::StandardCheapValues(x, s, q, sf)) return false;
    detail::DecodeStandardCheap(q, x, factor64, y);
    return true;
  }
};

// blocks_per_thread fuzzed blocks per thread of one slice (tensor scales ts, blocks of magnitude
// `scale`) through `path`: every block it takes must give the reference's packed codes and scale
// byte (QuantizeBlockPacked), and the fused QDQ's values DecodeElement of the reference codes.
template <class Traits, class Path>
__device__ void FuzzSlice(const Path& path, const TensorScales& ts, float scale, uint64_t salt,
                          int blocks_per_thread, Counts* out) {
  unsigned long long cheap = 0;
  for (int k = 0; k < blocks_per_thread; ++k) {
    const uint64_t id = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) * blocks_per_thread + k;
    float x[kBlockSize];
    FuzzBlock(id ^ salt, scale, x);
    uint8_t want[kBlockSize / 2];
    const uint8_t want_sf = QuantizeBlockPacked<Traits>(x, ts, want);
    PackedBlock got;
    if (!path.Codes(x, got)) continue;
    ++cheap;
    uint32_t lo, hi;
    PackedWords(want, lo, hi);
    const float factor = DecodeFactor<Traits>(want_sf, ts.amax);
    float y[kBlockSize];
    const bool ok = path.Values(x, FMul(factor, 0x1p6f), y) && DecodesTo(y, want, factor);
    if (!ok || got.sf != want_sf || got.lo != lo || got.hi != hi) Fail(out, id);
  }
  atomicAdd(&out->cheap, cheap);
}

// One CTA = one slice: its amax is the bf16 value scale * 6 (a tensor amax at least as large as
// every ordinary element), its candidate table built by its threads like QuantizeKernel's.
template <class Traits>
__global__ void __launch_bounds__(256)
    BlockKernel(uint64_t salt, int blocks_per_thread, Counts* out) {
  const int e = static_cast<int>(Mix(blockIdx.x ^ salt) % 64) - 40;
  const float scale = ldexpf(1.0f, e);
  const TensorScales ts = MakeTensorScales(Bf16Round(scale * 6.0f), Traits::kE4M3Max);
  const CheapSlice s = detail::MakeCheapSlice<Traits>(ts);
  __shared__ Candidate table[detail::kCandidateTableSize];
  if (threadIdx.x < detail::kCandidateTableSize) {
    table[threadIdx.x] = detail::MakeCandidate<Traits>(threadIdx.x, s);
  }
  __syncthreads();
  FuzzSlice<Traits>(FourOverSixPath<Traits>{s, table}, ts, scale, salt, blocks_per_thread, out);
}

// Standard NVFP4 through the same primitives on the device, against the shared reference.
__global__ void __launch_bounds__(256)
    StandardBlockKernel(uint64_t salt, int blocks_per_thread, Counts* out) {
  const int e = static_cast<int>(Mix(blockIdx.x ^ salt) % 64) - 40;
  const float scale = ldexpf(1.0f, e);
  // The tensor amax: the blocks' own scale times 6, or up to 2^8 times more (tiny block scales).
  const float amax = Bf16Round(scale * 6.0f * static_cast<float>(1u << (blockIdx.x % 9)));
  const TensorScales ts = MakeTensorScales(amax, StandardTraits::kE4M3Max);
  FuzzSlice<StandardTraits>(StandardPath{detail::MakeCheapSlice<StandardTraits>(ts)}, ts, scale,
                            salt, blocks_per_thread, out);
}

class FastFourOverSixDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoCudaReason();
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
    ASSERT_EQ(DeviceBuffer::Create(sizeof(Counts), &buf_), cudaSuccess);
  }
  void Reset() {
    const Counts init{0, ~0ull, 0};
    ASSERT_EQ(cudaMemcpy(buf_.data(), &init, sizeof(init), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Counts Read() {
    Counts c{};
    EXPECT_EQ(cudaMemcpy(&c, buf_.data(), sizeof(c), cudaMemcpyDeviceToHost), cudaSuccess);
    return c;
  }
  Counts* dev() { return buf_.as<Counts>(); }
  DeviceBuffer buf_;
};

TEST_F(FastFourOverSixDeviceTest, RoundingAndDivisionEqualSharedFunctionsOnTheirDomains) {
  const uint64_t round_n = 2 * uint64_t{FloatBits(detail::kSimpleLimit)};
  const uint64_t div_n =
      uint64_t{FloatBits(detail::kDivSixMax)} - FloatBits(detail::kDivSixMin) + 2;  // + zero
  const uint64_t sizes[2] = {round_n, div_n};
  const char* names[2] = {"RoundE2M1Scaled", "DivSix"};
  for (int kind = 0; kind < 2; ++kind) {
    Reset();
    ExhaustiveKernel<<<132 * 16, 256>>>(kind, sizes[kind], dev());
    WPUB_CUDA_OK(cudaGetLastError());
    WPUB_CUDA_OK(cudaDeviceSynchronize());
    const Counts c = Read();
    EXPECT_EQ(c.mismatches, 0u) << names[kind] << " differs on " << c.mismatches
                                << " inputs, first bits 0x" << ToHex(c.first);
  }
}

struct LaunchBlocks {
  Counts* out;
  uint64_t salt;
  template <class Traits>
  KernelStatus operator()() const {
    if constexpr (Traits::kFourOverSix) BlockKernel<Traits><<<132 * 8, 256>>>(salt, 16, out);
    return KernelStatus::kOk;
  }
};

TEST_F(FastFourOverSixDeviceTest, CheapBlocksEqualReferenceInAll4over6Modes) {
  constexpr uint64_t kBlocks = uint64_t{132} * 8 * 256 * 16;  // 4.3M blocks per mode
  for (int mi = 1; mi < kNumQuantModes; ++mi) {
    Reset();
    const QuantMode mode = QuantMode::FromIndex(mi);
    ASSERT_EQ(DispatchQuantMode(mode, LaunchBlocks{dev(), 0x9E3779B9ull * mi}), KernelStatus::kOk);
    WPUB_CUDA_OK(cudaGetLastError());
    WPUB_CUDA_OK(cudaDeviceSynchronize());
    const Counts c = Read();
    EXPECT_EQ(c.mismatches, 0u) << mode.Name() << ": " << c.mismatches
                                << " blocks differ, first block id " << c.first;
    // The fuzzed data is mostly ordinary: the cheap path must carry most of it.
    EXPECT_GT(c.cheap, kBlocks / 2) << mode.Name();
  }
}

TEST_F(FastFourOverSixDeviceTest, CheapStandardBlocksEqualReference) {
  constexpr uint64_t kBlocks = uint64_t{132} * 8 * 256 * 16;  // 4.3M blocks
  for (uint64_t salt : {0x51ull, 0xC0FFEEull}) {
    Reset();
    StandardBlockKernel<<<132 * 8, 256>>>(salt, 16, dev());
    WPUB_CUDA_OK(cudaGetLastError());
    WPUB_CUDA_OK(cudaDeviceSynchronize());
    const Counts c = Read();
    EXPECT_EQ(c.mismatches, 0u) << c.mismatches << " blocks differ, first block id " << c.first;
    EXPECT_GT(c.cheap, kBlocks / 2);
  }
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
