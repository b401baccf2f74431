// The bucket checksum (definition in checksum.h).
#include "core/transport/checksum.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "core/common/parallel_for.h"

namespace wpub::transport {

static_assert(std::endian::native == std::endian::little, "checksum words are little-endian");

uint64_t ChecksumPartial(const uint8_t* data, size_t n, uint64_t first_word) {
  uint64_t sum = 0;
  const size_t full = n / 8;
  uint64_t index = first_word;
  for (size_t i = 0; i < full; ++i, ++index) {
    uint64_t w;
    std::memcpy(&w, data + 8 * i, 8);
    sum += ChecksumMix(w ^ (index * kChecksumIndexMul));
  }
  if (const size_t tail = n % 8; tail != 0) {
    uint64_t w = 0;
    std::memcpy(&w, data + 8 * full, tail);
    sum += ChecksumMix(w ^ (index * kChecksumIndexMul));
  }
  return sum;
}

uint64_t Checksum(const uint8_t* data, size_t n) {
  return ChecksumFinish(ChecksumPartial(data, n, 0), n);
}

uint64_t ParallelChecksum(const uint8_t* data, uint64_t n, int threads) {
  constexpr uint64_t kSliceWords = uint64_t{1} << 21;  // 16 MiB
  const uint64_t words = (n + 7) / 8;
  const size_t slices = static_cast<size_t>((words + kSliceWords - 1) / kSliceWords);
  if (slices <= 1 || threads == 1) return Checksum(data, n);
  std::vector<uint64_t> sums(slices);
  ParallelFor(slices, threads, [&](size_t s) {
    const uint64_t first = s * kSliceWords;
    sums[s] = ChecksumPartial(data + 8 * first, std::min(8 * kSliceWords, n - 8 * first), first);
  });
  uint64_t sum = 0;
  for (uint64_t v : sums) sum += v;
  return ChecksumFinish(sum, n);
}

}  // namespace wpub::transport
