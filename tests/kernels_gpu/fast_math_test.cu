// Proves the device fast paths of kernels/cuda (fast_block.cuh, device_common.cuh) identical to
// the shared scalar functions of nvfp4_math.h: exhaustively over all 2^32 fp32 inputs for the
// unary float primitives, all 65536 fp16 patterns for widening, all E2M1 x E4M3 products for
// the FP16-error shortcut, and tens of millions of fuzzed blocks (specials included) for the
// composed block quantizers of all 9 modes. Everything runs on the device; only mismatch
// counts and the first mismatching input come back.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/fast_block.cuh"
#include "tests/kernels_gpu/gpu_test_util.h"

namespace wpub::kernels::cuda::testing {
namespace {

using detail::DivByConstant;
using detail::E2M1CodeOfValue;
using detail::E2M1Magnitude;
using detail::E2M1ValueOfProduct;
using detail::FastE4M3;
using detail::FastRcp;
using detail::Narrow;
using detail::Widen;

struct Mismatch {
  unsigned long long count;
  unsigned long long first;  // smallest mismatching input index
};

enum class Check : int {
  kE2M1Magnitude,
  kE2M1Product,  // E2M1ValueOfProduct(x, param) and its code
  kE4M3,
  kRcp,
  kDiv2688,
  kDiv1536,
  kBf16,
  kFp16,
};

__device__ bool Same(float a, float b) { return __float_as_uint(a) == __float_as_uint(b); }

// DivByConstant's documented domain: zero, or 2^-100 <= |a| <= 2^112.
__device__ bool InDivDomain(float a) {
  const float m = fabsf(a);
  return m == 0.0f || (m >= 0x1p-100f && m <= 0x1p112f);
}

__device__ bool CheckOne(Check c, uint32_t bits, float param) {
  const float x = __uint_as_float(bits);
  switch (c) {
    case Check::kE2M1Magnitude:
      return Same(E2M1Magnitude(x), FAbs(E2M1ToFloat(FloatToE2M1(x))));
    case Check::kE2M1Product: {
      const float v = E2M1ValueOfProduct(x, param);
      const uint8_t want = FloatToE2M1(FMul(x, param));
      return Same(v, E2M1ToFloat(want)) && E2M1CodeOfValue(v) == want;
    }
    case Check::kE4M3:
      return FastE4M3(x) == FloatToE4M3(x);
    case Check::kRcp:
      return Same(FastRcp(x), FDiv(1.0f, x));
    case Check::kDiv2688:
      return !InDivDomain(x) || Same(DivByConstant<2688>(x), FDiv(x, 2688.0f));
    case Check::kDiv1536:
      return !InDivDomain(x) || Same(DivByConstant<1536>(x), FDiv(x, 1536.0f));
    case Check::kBf16:
      return Narrow<ElemType::kBF16>(x) == FloatToBf16(x);
    case Check::kFp16:
      return Narrow<ElemType::kF16>(x) == FloatToFp16(x);
  }
  return false;
}

__global__ void ExhaustiveKernel(Check c, float param, uint64_t n, Mismatch* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (!CheckOne(c, static_cast<uint32_t>(i), param)) {
      atomicAdd(&out->count, 1ull);
      atomicMin(&out->first, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void WidenAndProductKernel(Mismatch* widen, Mismatch* product) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;  // 65536 threads
  if (!Same(Widen<ElemType::kF16>(i), Fp16ToFloat(static_cast<uint16_t>(i))) ||
      !Same(Widen<ElemType::kBF16>(i), Bf16ToFloat(static_cast<uint16_t>(i)))) {
    atomicAdd(&widen->count, 1ull);
    atomicMin(&widen->first, static_cast<unsigned long long>(i));
  }
  if (i < 256 && (i & 0x7F) != 0x7F) {  // every non-NaN E4M3 byte
    const uint8_t sf = static_cast<uint8_t>(i);
    if (!Same(detail::FastE4M3ToFloat(sf), E4M3ToFloat(sf)) ||
        !Same(detail::FastDecodeFactor<StandardTraits>(sf, 3.75f),
              DecodeFactor<StandardTraits>(sf, 3.75f))) {
      atomicAdd(&widen->count, 1ull);
      atomicMin(&widen->first, static_cast<unsigned long long>(0x10000 + i));
    }
  }
  if (i < 16 * 256) {
    const uint8_t code = static_cast<uint8_t>(i / 256);
    const uint8_t sf = static_cast<uint8_t>(i % 256);
    if ((sf & 0x7F) != 0x7F) {  // every scale byte but NaN
      const float qs = FMul(E2M1ToFloat(code), E4M3ToFloat(sf));
      if (!Same(RoundToFp16(qs), qs)) {
        atomicAdd(&product->count, 1ull);
        atomicMin(&product->first, static_cast<unsigned long long>(i));
      }
    }
  }
}

__device__ uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A fuzzed block: mostly normal-looking values at a random magnitude, with E2M1 boundary values,
// zeros of both signs, infinities, NaNs and raw bit patterns mixed in.
__device__ void FuzzBlock(uint64_t seed, float (&x)[kBlockSize], float& amax) {
  const uint64_t h = Mix(seed);
  const int scale_exp = static_cast<int>(h % 200) - 120;
  float m = 0.0f;
  for (int i = 0; i < kBlockSize; ++i) {
    const uint64_t r = Mix(seed * 131 + i + 1);
    const uint32_t kind = r % 64;
    float v;
    if (kind == 0) {
      v = __uint_as_float(static_cast<uint32_t>(r >> 32));  // any pattern
    } else if (kind == 1) {
      v = (r & 64) ? -0.0f : 0.0f;
    } else if (kind == 2) {
      v = (r & 64) ? -INFINITY : INFINITY;
    } else if (kind == 3) {
      v = __uint_as_float(0x7FC00000u | static_cast<uint32_t>(r >> 40));
    } else if (kind < 12) {  // E2M1 boundaries (times the block scale) +- a little
      const float b[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
      v = b[(r >> 8) % 8] * (1.0f + ((r >> 16) % 3 - 1.0f) * 1e-3f);
    } else {
      v = static_cast<float>(static_cast<int32_t>(r >> 40) % 100000) / 16667.0f;
    }
    x[i] = kind < 4 ? v : ldexpf(v, scale_exp);
    m = fmaxf(m, fabsf(x[i]));
  }
  const uint32_t akind = (h >> 20) % 16;
  if (akind == 0) {
    amax = 0.0f;
  } else if (akind == 1) {
    amax = INFINITY;
  } else if (akind == 2) {
    amax = __uint_as_float(0x7FC00000u);
  } else if (akind == 3) {
    amax = 1e-40f;  // subnormal
  } else {
    amax = m * (1.0f + static_cast<float>((h >> 32) % 1000) / 10.0f);
  }
}

template <class Traits>
__global__ void BlockFuzzKernel(uint64_t num_blocks, uint64_t salt, Mismatch* out) {
  for (uint64_t b = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; b < num_blocks;
       b += uint64_t{gridDim.x} * blockDim.x) {
    float x[kBlockSize];
    float amax;
    FuzzBlock(b ^ salt, x, amax);
    uint8_t codes[kBlockSize];
    const uint8_t sf = QuantizeBlock<Traits>(x, MakeTensorScales(amax, Traits::kE4M3Max), codes);
    detail::QuantBlock qb;
    detail::QuantizeBlockFast<Traits>(x, detail::MakeSliceScales<Traits>(amax), qb);
    bool ok = qb.sf == sf;
    for (int i = 0; i < kBlockSize; ++i) {
      ok = ok && E2M1CodeOfValue(qb.q[i]) == codes[i] && Same(qb.q[i], E2M1ToFloat(codes[i]));
    }
    if (!ok) {
      atomicAdd(&out->count, 1ull);
      atomicMin(&out->first, static_cast<unsigned long long>(b));
    }
  }
}

// Everything about one fuzzed block, for the failure message.
struct BlockDetail {
  float x[kBlockSize];
  float amax;
  uint32_t ref_sf;
  uint32_t fast_sf;
  uint32_t ref_codes[kBlockSize];
  uint32_t fast_codes[kBlockSize];
};

template <class Traits>
__global__ void BlockDetailKernel(uint64_t b, uint64_t salt, BlockDetail* d) {
  float x[kBlockSize];
  float amax;
  FuzzBlock(b ^ salt, x, amax);
  uint8_t codes[kBlockSize];
  d->ref_sf = QuantizeBlock<Traits>(x, MakeTensorScales(amax, Traits::kE4M3Max), codes);
  detail::QuantBlock qb;
  detail::QuantizeBlockFast<Traits>(x, detail::MakeSliceScales<Traits>(amax), qb);
  d->fast_sf = qb.sf;
  d->amax = amax;
  for (int i = 0; i < kBlockSize; ++i) {
    d->x[i] = x[i];
    d->ref_codes[i] = codes[i];
    d->fast_codes[i] = E2M1CodeOfValue(qb.q[i]);
  }
}

class FastMathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoCudaReason();
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
    ASSERT_EQ(DeviceBuffer::Create(2 * sizeof(Mismatch), &buf_), cudaSuccess);
  }
  void Reset() {
    const Mismatch init[2] = {{0, ~0ull}, {0, ~0ull}};
    ASSERT_EQ(cudaMemcpy(buf_.data(), init, sizeof(init), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Mismatch Read(int i) {
    Mismatch m[2];
    EXPECT_EQ(cudaMemcpy(m, buf_.data(), sizeof(m), cudaMemcpyDeviceToHost), cudaSuccess);
    return m[i];
  }
  Mismatch* dev(int i) { return buf_.as<Mismatch>() + i; }
  DeviceBuffer buf_;
};

TEST_F(FastMathTest, PrimitivesEqualSharedFunctionsOnAll2To32Inputs) {
  struct Case {
    Check check;
    float param;
    const char* name;
  };
  // The products' second factors span what EncodeInverse can return: ordinary, huge (FLT_MAX),
  // tiny and subnormal, negative (a negative caller amax) and infinite.
  const Case cases[] = {
      {Check::kE2M1Magnitude, 0.0f, "E2M1Magnitude"},
      {Check::kE2M1Product, 1.0f, "E2M1ValueOfProduct(x, 1)"},
      {Check::kE2M1Product, 0.37213f, "E2M1ValueOfProduct(x, 0.37213)"},
      {Check::kE2M1Product, 3.0517578e-05f, "E2M1ValueOfProduct(x, 2^-15)"},
      {Check::kE2M1Product, -2.5f, "E2M1ValueOfProduct(x, -2.5)"},
      {Check::kE2M1Product, 3.4028235e38f, "E2M1ValueOfProduct(x, FLT_MAX)"},
      {Check::kE2M1Product, 1e-39f, "E2M1ValueOfProduct(x, 1e-39)"},
      {Check::kE2M1Product, -INFINITY, "E2M1ValueOfProduct(x, -inf)"},
      {Check::kE4M3, 0.0f, "FastE4M3"},
      {Check::kRcp, 0.0f, "FastRcp"},
      {Check::kDiv2688, 0.0f, "DivByConstant<2688>"},
      {Check::kDiv1536, 0.0f, "DivByConstant<1536>"},
      {Check::kBf16, 0.0f, "bf16 conversion"},
      {Check::kFp16, 0.0f, "fp16 conversion"},
  };
  for (const Case& c : cases) {
    Reset();
    ExhaustiveKernel<<<132 * 16, 256>>>(c.check, c.param, uint64_t{1} << 32, dev(0));
    WPUB_CUDA_OK(cudaGetLastError());
    WPUB_CUDA_OK(cudaDeviceSynchronize());
    const Mismatch m = Read(0);
    EXPECT_EQ(m.count, 0u) << c.name << " differs on " << m.count << " inputs, first bits 0x"
                           << ToHex(m.first);
  }
}

TEST_F(FastMathTest, Fp16WideningAndFp16ErrorShortcut) {
  Reset();
  WidenAndProductKernel<<<256, 256>>>(dev(0), dev(1));
  WPUB_CUDA_OK(cudaGetLastError());
  WPUB_CUDA_OK(cudaDeviceSynchronize());
  const Mismatch w = Read(0);
  const Mismatch p = Read(1);
  EXPECT_EQ(w.count, 0u) << "widening (below 0x10000) or E4M3 decode (0x10000 + byte) differs, "
                         << "first at 0x" << ToHex(w.first);
  EXPECT_EQ(p.count, 0u) << "RoundToFp16(E2M1 x E4M3) != product, first (code*256+sf) " << p.first;
}

// DispatchQuantMode functor (the .cu files build as C++17: no templated lambdas).
struct LaunchFuzz {
  Mismatch* out;
  uint64_t blocks;
  uint64_t salt;
  template <class Traits>
  KernelStatus operator()() const {
    BlockFuzzKernel<Traits><<<132 * 8, 256>>>(blocks, salt, out);
    return KernelStatus::kOk;
  }
};

struct LaunchDetail {
  uint64_t block;
  uint64_t salt;
  BlockDetail* out;
  template <class Traits>
  KernelStatus operator()() const {
    BlockDetailKernel<Traits><<<1, 1>>>(block, salt, out);
    return KernelStatus::kOk;
  }
};

std::string Describe(const BlockDetail& d) {
  std::string s = "amax bits 0x" + ToHex(FloatBits(d.amax)) + ", sf ref 0x" + ToHex(d.ref_sf) +
                  " fast 0x" + ToHex(d.fast_sf) + "\n";
  for (int i = 0; i < kBlockSize; ++i) {
    s += "  x 0x" + ToHex(FloatBits(d.x[i])) + " (" + std::to_string(d.x[i]) + ") code ref " +
         std::to_string(d.ref_codes[i]) + " fast " + std::to_string(d.fast_codes[i]) + "\n";
  }
  return s;
}

TEST_F(FastMathTest, FuzzedBlocksQuantizeIdenticallyInAllModes) {
  constexpr uint64_t kBlocks = uint64_t{1} << 23;  // 8M blocks (134M elements) per mode
  for (int mi = 0; mi < kNumQuantModes; ++mi) {
    Reset();
    const QuantMode mode = QuantMode::FromIndex(mi);
    const KernelStatus st =
        DispatchQuantMode(mode, LaunchFuzz{dev(0), kBlocks, 0x1234567ull * (mi + 1)});
    ASSERT_EQ(st, KernelStatus::kOk);
    WPUB_CUDA_OK(cudaGetLastError());
    WPUB_CUDA_OK(cudaDeviceSynchronize());
    const Mismatch m = Read(0);
    std::string detail;
    if (m.count != 0) {
      DeviceBuffer d_detail;
      ASSERT_EQ(DeviceBuffer::Create(sizeof(BlockDetail), &d_detail), cudaSuccess);
      DispatchQuantMode(mode,
                        LaunchDetail{m.first, 0x1234567ull * (mi + 1), d_detail.as<BlockDetail>()});
      BlockDetail h;
      WPUB_CUDA_OK(cudaMemcpy(&h, d_detail.data(), sizeof(h), cudaMemcpyDeviceToHost));
      detail = Describe(h);
    }
    EXPECT_EQ(m.count, 0u) << mode.Name() << ": " << m.count << " blocks differ, first " << m.first
                           << "\n"
                           << detail;
  }
}

}  // namespace
}  // namespace wpub::kernels::cuda::testing
