// Deterministic NVFP4 test vectors shared by the CPU and GPU kernel tests: the spec's four data
// families (random, boundary, zeros, maxes) and its twelve strict-matrix shapes.
// Pure functions of their arguments; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/nvfp4.h"

namespace wpub::kernels::testing {

enum class DataFamily : int {
  kRandom = 0,    // standard normal, first row zeroed
  kBoundary = 1,  // linspace(-12, 12, n/2) -1e-3 / +1e-3 interleaved
  kZeros = 2,     // +0.0, -0.0 alternating
  kMaxes = 3,     // finfo(dtype).max with alternating sign
};

inline constexpr std::array<DataFamily, 4> kAllDataFamilies = {
    DataFamily::kRandom, DataFamily::kBoundary, DataFamily::kZeros, DataFamily::kMaxes};

const char* DataFamilyName(DataFamily f);

struct TestShape {
  int64_t rows;
  int64_t cols;
};

// The spec's 12 shapes of the strict matrix, in spec order.
inline constexpr std::array<TestShape, 12> kSpecShapes = {{{1, 16},
                                                           {1, 32},
                                                           {3, 48},
                                                           {1, 64},
                                                           {3, 128},
                                                           {16, 64},
                                                           {31, 128},
                                                           {32, 128},
                                                           {128, 64},
                                                           {128, 1024},
                                                           {256, 256},
                                                           {1024, 2048}}};

// A host tensor [slices, rows, cols] of one element type, owning its bytes.
struct TestTensor {
  ElemType type = ElemType::kBF16;
  int64_t slices = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> bytes;

  int64_t numel() const { return slices * rows * cols; }
  const void* data() const { return bytes.data(); }
  void* data() { return bytes.data(); }
  // Element i widened to fp32.
  float at(int64_t i) const { return LoadAsFloat(bytes.data(), i, type); }
  // Descriptor of the whole tensor (rank-2 when slices == 1, else a rank-3 stack).
  WeightDesc desc() const { return WeightDesc::Stack(bytes.data(), slices, rows, cols, type); }
};

// Generates a [slices, rows, cols] tensor of `family` in `type`; deterministic in all arguments
// (`seed` only affects kRandom). For stacks, every slice follows the family on its own (the
// random family zeroes the first row of each slice) with a different random stream per slice.
TestTensor MakeTestTensor(DataFamily family, ElemType type, int64_t rows, int64_t cols,
                          uint64_t seed = 0, int64_t slices = 1);

// Normal N(0, sigma^2) values rounded to `type`, no zeroed row (for searches and fuzzing).
TestTensor MakeRandomTensor(ElemType type, int64_t rows, int64_t cols, uint64_t seed,
                            double sigma = 1.0, int64_t slices = 1);

// Rounds a double to `type` (RNE, through fp32 for the 16-bit types as torch does) and stores it
// at element i of data.
void StoreFromDouble(void* data, int64_t i, ElemType type, double v);

}  // namespace wpub::kernels::testing
