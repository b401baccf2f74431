// Bucket checksum: known vectors (from an independent Python implementation of the definition
// in core/transport/checksum.h) and the partial-sum property the GPU relies on.
#include "core/transport/checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace wpub::transport {
namespace {

uint64_t Of(const std::string& s) {
  return Checksum(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::vector<uint8_t> Iota(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i);
  return v;
}

TEST(ChecksumTest, KnownVectors) {
  EXPECT_EQ(Of(""), 0x0ull);
  EXPECT_EQ(Of("a"), 0x59aeeb70a4f49713ull);
  EXPECT_EQ(Of("abc"), 0x8fa6d51b0bb13ec0ull);
  EXPECT_EQ(Of("wpub flattened bucket"), 0x8fa03d4eda5d398bull);
  auto v16 = Iota(16);
  EXPECT_EQ(Checksum(v16.data(), v16.size()), 0xb0c0b3192f34f904ull);
  auto v256 = Iota(256);
  EXPECT_EQ(Checksum(v256.data(), v256.size()), 0xe85687d6fe6ee554ull);
  std::vector<uint8_t> z7(7, 0), z8(8, 0);
  EXPECT_EQ(Checksum(z7.data(), 7), 0x12ae30237b17df14ull);
  EXPECT_EQ(Checksum(z8.data(), 8), 0xd56b1fbb9ceba9e8ull);
}

TEST(ChecksumTest, TrailingZerosAndSwappedWordsChangeIt) {
  std::vector<uint8_t> z7(7, 0), z8(8, 0);
  EXPECT_NE(Checksum(z7.data(), 7), Checksum(z8.data(), 8));
  auto v = Iota(64);
  const uint64_t before = Checksum(v.data(), v.size());
  std::swap_ranges(v.begin(), v.begin() + 8, v.begin() + 8);
  EXPECT_NE(Checksum(v.data(), v.size()), before);
}

TEST(ChecksumTest, PartialSumsOverAnySplitAddUp) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> data(10007);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  const uint64_t whole = Checksum(data.data(), data.size());
  for (int trial = 0; trial < 50; ++trial) {
    // Split at random word boundaries, sum the partials in reverse order.
    std::vector<size_t> cuts{0};
    while (cuts.back() < data.size()) {
      cuts.push_back(std::min(data.size(), cuts.back() + 8 * (1 + rng() % 200)));
    }
    uint64_t sum = 0;
    for (size_t k = cuts.size() - 1; k > 0; --k) {
      sum += ChecksumPartial(data.data() + cuts[k - 1], cuts[k] - cuts[k - 1], cuts[k - 1] / 8);
    }
    EXPECT_EQ(ChecksumFinish(sum, data.size()), whole);
  }
}

// Summed in 16 MiB slices on several threads: the same checksum, for one slice, several, and a
// partial last word.
TEST(ChecksumTest, ParallelChecksumEqualsTheSerialOne) {
  std::mt19937_64 rng(5);
  std::vector<uint8_t> data((uint64_t{40} << 20) + 3);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (uint64_t n : {uint64_t{0}, uint64_t{13}, uint64_t{16} << 20, (uint64_t{16} << 20) + 1,
                     static_cast<uint64_t>(data.size())}) {
    const uint64_t want = Checksum(data.data(), n);
    for (int threads : {1, 3, 0}) {
      EXPECT_EQ(ParallelChecksum(data.data(), n, threads), want) << n << " bytes, " << threads;
    }
  }
}

TEST(ChecksumTest, DetectsEverySingleBitFlipInASmallBuffer) {
  auto v = Iota(40);
  const uint64_t base = Checksum(v.data(), v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      v[i] ^= static_cast<uint8_t>(1 << bit);
      EXPECT_NE(Checksum(v.data(), v.size()), base) << i << ":" << bit;
      v[i] ^= static_cast<uint8_t>(1 << bit);
    }
  }
}

}  // namespace
}  // namespace wpub::transport
