// The GPU path's status kernels against host arithmetic (label gpu; skips without a device):
// the non-finite count for every element type, views starting at every element offset within
// a 16-byte line (the kernel reads the aligned middle with vector loads, the head and tail
// element by element), items longer than its 8 MiB chunks, and several items sharing a slot;
// the device checksum against core/transport/checksum.h at word offsets and odd lengths; the gather
// copy at every source and destination offset within a 16-byte line, lengths around the word
// sizes, items longer than its chunks, and many items per launch.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/transport/checksum.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::kernels::cuda {
namespace {

class StatusKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

struct Kind {
  FloatKind kind;
  int size;
  uint64_t inf_bits;  // an infinity (exponent all ones, mantissa 0)
};

void Put(std::vector<uint8_t>& b, uint64_t elem, const Kind& k, uint64_t bits) {
  std::memcpy(b.data() + elem * k.size, &bits, k.size);  // little-endian
}

TEST_F(StatusKernelsTest, NonFiniteCountMatchesHostAtEveryOffsetAndAcrossChunks) {
  const Kind kinds[] = {{FloatKind::kBF16, 2, 0x7F80},
                        {FloatKind::kF16, 2, 0x7C00},
                        {FloatKind::kF32, 4, 0x7F800000u},
                        {FloatKind::kF64, 8, 0x7FF0000000000000ull}};
  std::mt19937_64 rng(7);
  for (const Kind& k : kinds) {
    // 9 MiB + a few elements: more than one chunk, with a tail.
    const uint64_t elems = ((uint64_t{9} << 20) / k.size) + 37;
    std::vector<uint8_t> host(elems * k.size + 16, 0);
    // Finite filler (exponent never all ones), then non-finite values at chosen places: the
    // first 24 elements (heads at any offset), around the chunk boundary, the last 24.
    for (uint64_t e = 0; e < elems; ++e) Put(host, e, k, rng() & (k.inf_bits >> 1));
    std::vector<uint64_t> marks;
    for (uint64_t e = 0; e < 24; ++e) marks.push_back(e);
    const uint64_t boundary = (uint64_t{8} << 20) / k.size;
    for (uint64_t e = boundary - 5; e < boundary + 5; ++e) marks.push_back(e);
    for (uint64_t e = elems - 24; e < elems; ++e) marks.push_back(e);
    for (int i = 0; i < 1000; ++i) marks.push_back(rng() % elems);
    for (uint64_t e : marks) Put(host, e, k, k.inf_bits | (rng() & 1));  // inf or NaN
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, host.size()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    unsigned long long* counts = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&counts), 16 * sizeof(*counts)), cudaSuccess);
    // Views starting at every element offset of a 16-byte line, with lengths that end anywhere.
    std::vector<CountItem> items;
    std::vector<uint64_t> want(16, 0);
    for (int first = 0; first < 16 / k.size; ++first) {
      const uint64_t len = elems - first - (rng() % 9);
      CountItem it;
      it.data = static_cast<const uint8_t*>(dev) + first * k.size;
      it.bytes = len * k.size;
      it.kind = k.kind;
      it.slot = static_cast<uint32_t>(first % 3);  // slots shared by several items
      items.push_back(it);
      for (uint64_t e = first; e < first + len; ++e) {
        uint64_t bits = 0;
        std::memcpy(&bits, host.data() + e * k.size, k.size);
        want[it.slot] += (bits & k.inf_bits) == k.inf_bits;
      }
    }
    ASSERT_EQ(cudaMemset(counts, 0, 16 * sizeof(*counts)), cudaSuccess);
    ASSERT_EQ(LaunchCountNonFinite(items.data(), static_cast<int>(items.size()), counts, nullptr),
              cudaSuccess);
    std::vector<unsigned long long> got(16);
    ASSERT_EQ(cudaMemcpy(got.data(), counts, 16 * sizeof(*counts), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int s = 0; s < 16; ++s)
      EXPECT_EQ(got[s], want[s]) << "element size " << k.size << " slot " << s;
    cudaFree(counts);
    cudaFree(dev);
  }
}

TEST_F(StatusKernelsTest, DeviceChecksumEqualsTheHostDefinition) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> host((uint64_t{40} << 20) + 64);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, host.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  unsigned long long* sum = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof(*sum)), cudaSuccess);
  const auto device_sum = [&](uint64_t start, uint64_t n, uint64_t first_word) {
    EXPECT_EQ(cudaMemset(sum, 0, sizeof(*sum)), cudaSuccess);
    EXPECT_EQ(
        LaunchChecksumAdd(static_cast<const uint8_t*>(dev) + start, n, first_word, sum, nullptr),
        cudaSuccess);
    unsigned long long s = 0;
    EXPECT_EQ(cudaMemcpy(&s, sum, sizeof(s), cudaMemcpyDeviceToHost), cudaSuccess);
    return static_cast<uint64_t>(s);
  };
  // 4-byte aligned starts (the contract: each picks its own load width), lengths ending
  // anywhere, from one byte to several grid strides of the kernel (a 1 GiB bucket is ~120).
  const uint64_t lengths[] = {
      1, 7, 8, 15, 16, 24, 4097, 8191, 8200, 65543, uint64_t{3} << 20, (uint64_t{40} << 20) - 13};
  for (uint64_t start : {0, 4, 8, 12, 36}) {
    for (uint64_t n : lengths) {
      EXPECT_EQ(transport::ChecksumFinish(device_sum(start, n, 0), n),
                transport::Checksum(host.data() + start, n))
          << "start " << start << " n " << n;
    }
  }
  // Partial sums of word ranges (first_word > 0) add up to the whole buffer's; the second
  // range starts at every load width (16-, 8- and 4-byte aligned).
  for (uint64_t start : {0, 4}) {
    for (uint64_t split_word : {(uint64_t{5} << 17) + 3, (uint64_t{5} << 17) + 4}) {
      const uint64_t n = (uint64_t{9} << 20) + 5;
      const uint64_t parts = device_sum(start, 8 * split_word, 0) +
                             device_sum(start + 8 * split_word, n - 8 * split_word, split_word);
      EXPECT_EQ(transport::ChecksumFinish(parts, n), transport::Checksum(host.data() + start, n))
          << "start " << start << " split at word " << split_word;
    }
  }
  cudaFree(sum);
  cudaFree(dev);
}

TEST_F(StatusKernelsTest, GatherCopyEqualsMemcpyAtEveryAlignment) {
  const uint64_t lengths[] = {0, 1, 2, 3, 15, 16, 17, 31, 33, 4095, 4097, (uint64_t{9} << 20) + 7};
  std::vector<CopyItem> items;
  std::vector<std::pair<uint64_t, uint64_t>> where;  // (dst offset, src offset) per item
  uint64_t src_bytes = 0, dst_bytes = 0;
  for (int so = 0; so < 16; ++so) {
    for (int d = 0; d < 16; ++d) {
      for (const uint64_t n : lengths) {
        if (n > 4097 && (so + d) % 5 != 0) continue;  // the long one at some offsets only
        src_bytes = (src_bytes + 15) / 16 * 16 + so;
        dst_bytes = (dst_bytes + 15) / 16 * 16 + d;
        where.push_back({dst_bytes, src_bytes});
        items.push_back(CopyItem{nullptr, nullptr, n});
        src_bytes += n;
        dst_bytes += n + 3;  // a gap the copy must leave untouched
      }
    }
  }
  ASSERT_GT(items.size(), 1024u);  // more than one launch
  std::vector<uint8_t> src(src_bytes), want(dst_bytes, 0xA5);
  std::mt19937_64 rng(7);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  uint8_t *d_src = nullptr, *d_dst = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_src), src_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_dst), dst_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, src.data(), src_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dst, want.data(), dst_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  for (size_t i = 0; i < items.size(); ++i) {
    items[i].dst = d_dst + where[i].first;
    items[i].src = d_src + where[i].second;
    std::memcpy(want.data() + where[i].first, src.data() + where[i].second, items[i].bytes);
  }
  ASSERT_EQ(LaunchGatherCopy(items.data(), static_cast<int>(items.size()), nullptr), cudaSuccess);
  std::vector<uint8_t> got(dst_bytes);
  ASSERT_EQ(cudaMemcpy(got.data(), d_dst, dst_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << "first difference at destination byte " << i;
      break;
    }
  }
  EXPECT_EQ(LaunchGatherCopy(nullptr, 0, nullptr), cudaSuccess);
  cudaFree(d_src);
  cudaFree(d_dst);
}

}  // namespace
}  // namespace wpub::kernels::cuda
