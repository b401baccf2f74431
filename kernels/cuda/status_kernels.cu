// Checksum and non-finite-count kernels: grid-stride loops, one 64-bit atomic per block.
#include "kernels/cuda/status_kernels.h"

#include <algorithm>

namespace wpub::kernels::cuda {
namespace {

constexpr int kThreads = 256;
static_assert(kThreads % 32 == 0, "whole warps");

__device__ __forceinline__ uint64_t Mix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ void BlockAtomicAdd(T v, unsigned long long* out) {
  __shared__ T partial[kThreads / 32];
  v = WarpSum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    T w = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : T(0);
    w = WarpSum(w);
    if (threadIdx.x == 0 && w != T(0)) atomicAdd(out, static_cast<unsigned long long>(w));
  }
}

// The words of the checksum, loaded as the widest vector the start of `data` allows: a bucket
// inside its staging buffer is only guaranteed 4-byte alignment (the backend shifts it to align
// the packed codes). WordVec<uint4> and WordVec<uint2> hold whole words; HalfWords is one word
// read as two 32-bit halves.
template <typename T>
struct WordVec {
  static constexpr int kWords = sizeof(T) / 8;
  T v;
  __device__ void Load(const uint8_t* data, uint64_t unit) {
    v = reinterpret_cast<const T*>(data)[unit];
  }
  __device__ uint64_t Word(int k) const {
    const uint2 w = reinterpret_cast<const uint2*>(&v)[k];
    return static_cast<uint64_t>(w.y) << 32 | w.x;  // little-endian
  }
};
struct HalfWords {
  static constexpr int kWords = 1;
  uint32_t lo, hi;
  __device__ void Load(const uint8_t* data, uint64_t unit) {
    const auto* halves = reinterpret_cast<const uint32_t*>(data);
    lo = halves[2 * unit];
    hi = halves[2 * unit + 1];
  }
  __device__ uint64_t Word(int) const { return static_cast<uint64_t>(hi) << 32 | lo; }
};

// Each thread keeps kChecksumBytesInFlight bytes of loads in flight before mixing them: the sum
// is cheap, so the kernel is paced by how many bytes are outstanding per SM (with 8 bytes per
// thread it read a 1 GiB bucket at ~2.2 TB/s beside a broadcast).
constexpr int kChecksumBytesInFlight = 64;
constexpr int kChecksumCtasPerSm = 4;

template <typename V>
__global__ void ChecksumKernel(const uint8_t* data, uint64_t n, uint64_t first_word,
                               unsigned long long* sum) {
  constexpr int kUnroll = kChecksumBytesInFlight / (8 * V::kWords);
  const uint64_t full_words = n / 8;
  const uint64_t units = full_words / V::kWords;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x * kUnroll;
  uint64_t acc = 0;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
       base < units; base += step) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t unit = base + static_cast<uint64_t>(u) * blockDim.x;
      if (unit < units) v[u].Load(data, unit);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t unit = base + static_cast<uint64_t>(u) * blockDim.x;
      if (unit >= units) break;
#pragma unroll
      for (int k = 0; k < V::kWords; ++k) {
        const uint64_t i = unit * V::kWords + k;
        acc += Mix(v[u].Word(k) ^ ((first_word + i) * 0x9E3779B97F4A7C15ull));
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // The words after the last whole vector, the last one zero-padded (little-endian).
    for (uint64_t i = units * V::kWords; i < (n + 7) / 8; ++i) {
      uint64_t w = 0;
      for (uint64_t b = 8 * i; b < n && b < 8 * i + 8; ++b) {
        w |= static_cast<uint64_t>(data[b]) << (8 * (b % 8));
      }
      acc += Mix(w ^ ((first_word + i) * 0x9E3779B97F4A7C15ull));
    }
  }
  BlockAtomicAdd<uint64_t>(acc, sum);
}

constexpr int kCountItemsPerLaunch = 256;
constexpr int kCountBlocksPerItem = 32;

struct CountParams {
  CountItem items[kCountItemsPerLaunch];
};
static_assert(sizeof(CountParams) < 32764, "kernel parameters are limited to 32764 bytes");

// Counts elements of `count` U values whose exponent bits (kMask) are all ones. The 16-byte
// aligned middle is read with vector loads (a passed-through view may start at any element
// boundary); the head and tail element by element.
template <typename U, U kMask>
__device__ uint64_t CountRange(const U* data, uint64_t count, uint64_t first, uint64_t stride) {
  constexpr int kPerVec = 16 / sizeof(U);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  uint64_t head = ((16 - addr % 16) % 16) / sizeof(U);      // elements before the aligned middle
  if (addr % sizeof(U) != 0 || head > count) head = count;  // unaligned elements: scalar only
  const uint64_t vecs = (count - head) / kPerVec;
  uint64_t c = 0;
  const auto* v = reinterpret_cast<const uint4*>(data + head);
  for (uint64_t i = first; i < vecs; i += stride) {
    union {
      uint4 q;
      U e[kPerVec];
    } u;
    u.q = __ldg(v + i);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) c += (u.e[k] & kMask) == kMask;
  }
  // Head and tail: at most 2 * kPerVec - 2 elements, taken by the first threads.
  const uint64_t tail_begin = head + vecs * kPerVec;
  for (uint64_t i = first; i < head; i += stride) c += (data[i] & kMask) == kMask;
  for (uint64_t i = tail_begin + first; i < count; i += stride) c += (data[i] & kMask) == kMask;
  return c;
}

// grid = (kCountBlocksPerItem, items): blockIdx.y picks the item, x strides inside it.
__global__ void CountNonFiniteKernel(const __grid_constant__ CountParams p,
                                     unsigned long long* counts) {
  const CountItem& it = p.items[blockIdx.y];
  const uint64_t first = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t c = 0;
  switch (it.kind) {
    case FloatKind::kBF16:
      c = CountRange<uint16_t, 0x7F80>(static_cast<const uint16_t*>(it.data), it.bytes / 2, first,
                                       stride);
      break;
    case FloatKind::kF16:
      c = CountRange<uint16_t, 0x7C00>(static_cast<const uint16_t*>(it.data), it.bytes / 2, first,
                                       stride);
      break;
    case FloatKind::kF32:
      c = CountRange<uint32_t, 0x7F800000u>(static_cast<const uint32_t*>(it.data), it.bytes / 4,
                                            first, stride);
      break;
    case FloatKind::kF64:
      c = CountRange<unsigned long long, 0x7FF0000000000000ull>(
          static_cast<const unsigned long long*>(it.data), it.bytes / 8, first, stride);
      break;
  }
  BlockAtomicAdd<uint64_t>(c, counts + it.slot);
}

// Items travel in kernel parameters, a Params' worth per launch: launch(params, count) launches
// one batch. Each item is cut into chunks of at most chunk_bytes (a multiple of 16: every chunk
// keeps its item's alignment), so that a launch, which gives every chunk the same blocks,
// spreads its work evenly; cut(item, offset, bytes) makes a chunk.
template <typename Params, typename Item, typename Cut, typename Launch>
cudaError_t LaunchChunked(const Item* items, int num_items, uint64_t chunk_bytes, Cut cut,
                          Launch launch) {
  constexpr int kPerLaunch = sizeof(Params::items) / sizeof(Params::items[0]);
  Params p{};
  int n = 0;
  auto flush = [&]() -> cudaError_t {
    if (n == 0) return cudaSuccess;
    launch(p, n);
    n = 0;
    return cudaGetLastError();
  };
  for (int i = 0; i < num_items; ++i) {
    for (uint64_t off = 0; off < items[i].bytes; off += chunk_bytes) {
      p.items[n++] = cut(items[i], off, std::min(chunk_bytes, items[i].bytes - off));
      if (n == kPerLaunch) {
        if (const cudaError_t e = flush(); e != cudaSuccess) return e;
      }
    }
  }
  return flush();
}

constexpr int kCopyItemsPerLaunch = 1024;
constexpr int kCopyBlocksPerItem = 16;

struct CopyParams {
  CopyItem items[kCopyItemsPerLaunch];
};
static_assert(sizeof(CopyParams) < 32764, "kernel parameters are limited to 32764 bytes");

// Copies n bytes with T-sized words where dst and src share their offset modulo sizeof(T): the
// bytes before dst's first aligned word and after its last one byte by byte.
template <typename T>
__device__ void CopyRange(uint8_t* dst, const uint8_t* src, uint64_t n, uint64_t first,
                          uint64_t stride) {
  const uint64_t misalign = reinterpret_cast<uintptr_t>(dst) % sizeof(T);
  const uint64_t to_aligned = (sizeof(T) - misalign) % sizeof(T);
  const uint64_t head = to_aligned < n ? to_aligned : n;
  const uint64_t words = (n - head) / sizeof(T);
  auto* d = reinterpret_cast<T*>(dst + head);
  const auto* s = reinterpret_cast<const T*>(src + head);
  for (uint64_t i = first; i < words; i += stride) d[i] = s[i];
  for (uint64_t i = first; i < head; i += stride) dst[i] = src[i];
  for (uint64_t i = head + words * sizeof(T) + first; i < n; i += stride) dst[i] = src[i];
}

// grid = (kCopyBlocksPerItem, items): blockIdx.y picks the item, x strides inside it.
__global__ void GatherCopyKernel(const __grid_constant__ CopyParams p) {
  const CopyItem& it = p.items[blockIdx.y];
  const uint64_t first = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  auto* dst = static_cast<uint8_t*>(it.dst);
  const auto* src = static_cast<const uint8_t*>(it.src);
  const uintptr_t shared = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if (shared % 16 == 0) {
    CopyRange<uint4>(dst, src, it.bytes, first, stride);
  } else if (shared % 4 == 0) {
    CopyRange<uint32_t>(dst, src, it.bytes, first, stride);
  } else if (shared % 2 == 0) {
    CopyRange<uint16_t>(dst, src, it.bytes, first, stride);
  } else {
    CopyRange<uint8_t>(dst, src, it.bytes, first, stride);
  }
}

}  // namespace

cudaError_t LaunchGatherCopy(const CopyItem* items, int num_items, cudaStream_t stream) {
  return LaunchChunked<CopyParams>(
      items, num_items, uint64_t{4} << 20,
      [](const CopyItem& it, uint64_t off, uint64_t bytes) {
        return CopyItem{static_cast<uint8_t*>(it.dst) + off,
                        static_cast<const uint8_t*>(it.src) + off, bytes};
      },
      [stream](const CopyParams& p, int n) {
        GatherCopyKernel<<<dim3(kCopyBlocksPerItem, n), kThreads, 0, stream>>>(p);
      });
}

cudaError_t LaunchChecksumAdd(const uint8_t* data, uint64_t n, uint64_t first_word,
                              unsigned long long* sum, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // A few CTAs per SM hold enough bytes in flight (kChecksumBytesInFlight per thread) and
  // leave the rest of each SM to what runs beside (a broadcast's kernels).
  int device = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess) {
    return e;
  }
  const uint64_t per_cta = uint64_t{kThreads} * kChecksumBytesInFlight;
  const int blocks = static_cast<int>(
      std::clamp<uint64_t>((n + per_cta - 1) / per_cta, 1, uint64_t(kChecksumCtasPerSm) * sms));
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  if (addr % 16 == 0) {
    ChecksumKernel<WordVec<uint4>><<<blocks, kThreads, 0, stream>>>(data, n, first_word, sum);
  } else if (addr % 8 == 0) {
    ChecksumKernel<WordVec<uint2>><<<blocks, kThreads, 0, stream>>>(data, n, first_word, sum);
  } else {
    ChecksumKernel<HalfWords><<<blocks, kThreads, 0, stream>>>(data, n, first_word, sum);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCountNonFinite(const CountItem* items, int num_items, unsigned long long* counts,
                                 cudaStream_t stream) {
  return LaunchChunked<CountParams>(
      items, num_items, uint64_t{8} << 20,
      [](const CountItem& it, uint64_t off, uint64_t bytes) {
        CountItem chunk = it;
        chunk.data = static_cast<const uint8_t*>(it.data) + off;
        chunk.bytes = bytes;
        return chunk;
      },
      [counts, stream](const CountParams& p, int n) {
        CountNonFiniteKernel<<<dim3(kCountBlocksPerItem, n), kThreads, 0, stream>>>(p, counts);
      });
}

}  // namespace wpub::kernels::cuda
