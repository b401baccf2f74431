// The bucket checksum (definition in checksum.h).
#include "core/transport/checksum.h"

#include <bit>
#include <cstring>

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

}  // namespace wpub::transport
