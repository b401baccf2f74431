// The bucket checksum: a 64-bit, order-aware sum that a GPU computes in parallel (any split of
// the words into chunks, partial sums added in any order) and receivers recompute on the bytes
// they got.
//
// Definition, for a buffer b of n bytes:
//   W   = ceil(n / 8) words; word w_i = bytes b[8i .. 8i+8) read little-endian, the last word
//         zero-padded when n % 8 != 0;
//   mix = the splitmix64 finalizer:
//           z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
//           z ^= z >> 31;
//   S   = sum over i in [0, W) of mix(w_i ^ (i * 0x9E3779B97F4A7C15))   (mod 2^64)
//   checksum(b) = mix(S + n)                                           (mod 2^64)
// The word index (times the odd golden-ratio constant) makes swapped words change the sum;
// adding n distinguishes buffers that differ only by trailing zero bytes. Known vectors are in
// tests/transport/checksum_test.cc and core/transport/README.md.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wpub::transport {

inline constexpr uint64_t kChecksumIndexMul = 0x9E3779B97F4A7C15ull;

constexpr uint64_t ChecksumMix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

// S restricted to the words [first_word, first_word + ceil(n / 8)) where `data` holds the bytes
// starting at byte 8 * first_word (zero-padded at its end). Partial sums of disjoint word
// ranges add up (mod 2^64) to S. Thread-safe (pure).
uint64_t ChecksumPartial(const uint8_t* data, size_t n, uint64_t first_word);

// Finishes a sum over every word of an n-byte buffer.
constexpr uint64_t ChecksumFinish(uint64_t sum, uint64_t n) { return ChecksumMix(sum + n); }

// Checksum(data, n) with its words summed in 16 MiB slices on `threads` threads (<= 0: the
// hardware's; 1, or a buffer of one slice: the caller's thread alone). Thread-safe (pure).
uint64_t ParallelChecksum(const uint8_t* data, uint64_t n, int threads);

// checksum(b) of the n bytes at `data`.
uint64_t Checksum(const uint8_t* data, size_t n);

}  // namespace wpub::transport
