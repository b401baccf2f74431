// Deterministic NVFP4 test vectors: a splitmix64 stream and Box-Muller normals, so the data is
// identical on every platform and in every test binary that asks for it.
#include "kernels/testing/test_data.h"

#include <cmath>
#include <cstring>

namespace wpub::kernels::testing {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1].
double Uniform(uint64_t& state) {
  return (static_cast<double>(SplitMix64(state) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) : state_(seed * 0xD1B54A32D192ED03ull + 1) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(Uniform(state_)));
    const double t = 6.283185307179586 * Uniform(state_);
    spare_ = r * std::sin(t);
    has_spare_ = true;
    return r * std::cos(t);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

void StoreBits16(void* data, int64_t i, uint16_t bits) {
  std::memcpy(static_cast<uint8_t*>(data) + 2 * i, &bits, 2);
}

// finfo(type).max with the given sign, stored at element i.
void StoreMax(void* data, int64_t i, ElemType type, bool negative) {
  switch (type) {
    case ElemType::kBF16:
      StoreBits16(data, i, negative ? 0xFF7F : 0x7F7F);
      break;
    case ElemType::kF16:
      StoreBits16(data, i, negative ? 0xFBFF : 0x7BFF);
      break;
    case ElemType::kF32: {
      const float f = BitsFloat(kFltMaxBits | (negative ? 0x80000000u : 0u));
      std::memcpy(static_cast<uint8_t*>(data) + 4 * i, &f, 4);
      break;
    }
  }
}

void FillSlice(DataFamily family, void* data, int64_t offset, int64_t rows, int64_t cols,
               ElemType type, uint64_t seed, double sigma, bool zero_first_row) {
  const int64_t n = rows * cols;
  switch (family) {
    case DataFamily::kRandom: {
      NormalStream normal(seed);
      for (int64_t i = 0; i < n; ++i) {
        const double v = (zero_first_row && i < cols) ? 0.0 : sigma * normal.Next();
        StoreFromDouble(data, offset + i, type, v);
      }
      break;
    }
    case DataFamily::kBoundary: {
      // base_j = linspace(-12, 12, n/2)[j]; element 2j = base_j - 1e-3, 2j+1 = base_j + 1e-3.
      const int64_t half = n / 2;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = i / 2;
        const double base =
            half > 1 ? -12.0 + 24.0 * static_cast<double>(j) / static_cast<double>(half - 1)
                     : -12.0;
        StoreFromDouble(data, offset + i, type, (i % 2 == 0) ? base - 1e-3 : base + 1e-3);
      }
      break;
    }
    case DataFamily::kZeros:
      for (int64_t i = 0; i < n; ++i) StoreFromDouble(data, offset + i, type, i % 2 ? -0.0 : 0.0);
      break;
    case DataFamily::kMaxes:
      for (int64_t i = 0; i < n; ++i) StoreMax(data, offset + i, type, i % 2 == 1);
      break;
  }
}

TestTensor Allocate(ElemType type, int64_t slices, int64_t rows, int64_t cols) {
  TestTensor t;
  t.type = type;
  t.slices = slices;
  t.rows = rows;
  t.cols = cols;
  t.bytes.assign(static_cast<size_t>(t.numel()) * ElemSize(type), 0);
  return t;
}

}  // namespace

const char* DataFamilyName(DataFamily f) {
  switch (f) {
    case DataFamily::kRandom:
      return "random";
    case DataFamily::kBoundary:
      return "boundary";
    case DataFamily::kZeros:
      return "zeros";
    case DataFamily::kMaxes:
      return "maxes";
  }
  return "unknown";
}

void StoreFromDouble(void* data, int64_t i, ElemType type, double v) {
  const float f = static_cast<float>(v);
  switch (type) {
    case ElemType::kBF16:
      StoreBits16(data, i, FloatToBf16(f));
      break;
    case ElemType::kF16:
      StoreBits16(data, i, FloatToFp16(f));
      break;
    case ElemType::kF32:
      std::memcpy(static_cast<uint8_t*>(data) + 4 * i, &f, 4);
      break;
  }
}

TestTensor MakeTestTensor(DataFamily family, ElemType type, int64_t rows, int64_t cols,
                          uint64_t seed, int64_t slices) {
  TestTensor t = Allocate(type, slices, rows, cols);
  for (int64_t s = 0; s < slices; ++s) {
    FillSlice(family, t.data(), s * rows * cols, rows, cols, type,
              seed * 1000003ull + static_cast<uint64_t>(s), 1.0, /*zero_first_row=*/true);
  }
  return t;
}

TestTensor MakeRandomTensor(ElemType type, int64_t rows, int64_t cols, uint64_t seed, double sigma,
                            int64_t slices) {
  TestTensor t = Allocate(type, slices, rows, cols);
  for (int64_t s = 0; s < slices; ++s) {
    FillSlice(DataFamily::kRandom, t.data(), s * rows * cols, rows, cols, type,
              seed * 1000003ull + static_cast<uint64_t>(s), sigma, /*zero_first_row=*/false);
  }
  return t;
}

}  // namespace wpub::kernels::testing
