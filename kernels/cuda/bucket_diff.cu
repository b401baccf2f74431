// Bucket diff kernels: a stream compaction of the changed words into the patch, in three
// launches of fixed shape. Compare: each CTA reads one tile of both buckets at memory bandwidth
// and keeps a bit per word (the only pass over the buckets' bytes). Scan: one CTA turns the tile
// counts into prefix sums, the totals and the header. Write: each tile with a change places its
// changed words and, at each run's end, the run's header, reading `next` only where it changed.
#include "kernels/cuda/bucket_diff.h"

#include <algorithm>

namespace wpub::kernels::cuda {
namespace {

constexpr uint64_t kHeaderBytes = 48;
constexpr uint64_t kWord = 8;
constexpr int kThreads = 256;  // compare and write kernels
// 16-byte loads per thread and bucket kept in flight by the compare kernel: 256 bytes per thread
// with both buckets, which saturates HBM at a few CTAs per SM.
constexpr int kUnroll = 8;
constexpr uint64_t kTileWords = uint64_t{2} * kThreads * kUnroll;  // a warp's load: 64 words
constexpr int kMasksPerTile = static_cast<int>(kTileWords / 64);
constexpr int kScanThreads = 1024;
constexpr int kScanItems = 8;  // consecutive tiles per scan thread and round
static_assert(kThreads % 32 == 0 && kScanThreads % 32 == 0, "whole warps");
static_assert(kMasksPerTile % 32 == 0 && kMasksPerTile <= kThreads, "a thread per mask word");
// Tile counts travel packed in a u32: changed words << 16 | run starts.
static_assert(kTileWords < (1u << 16), "per-tile counts fit 16 bits");

// Per tile, from the compare kernel.
struct TileCount {
  uint32_t changed;      // words that differ
  uint32_t starts;       // words that differ whose predecessor does not (or word 0)
  uint64_t last_start1;  // 1 + the tile's last run start, 0 when none starts in it
  uint32_t units;        // 16-bit units that differ (format 3)
};
// Per tile, from the scan kernel: over the tiles before it.
struct TilePrefix {
  uint64_t runs;         // runs started before the tile
  uint64_t changed;      // words changed before the tile
  uint64_t open_start1;  // 1 + the last run start before the tile (0: none)
  uint64_t units;        // units changed before the tile
};

// Scratch: a bit per word (bit w % 64 of mask w / 64, zero past the last word; tiles are whole
// mask words), then the per-tile counts and prefixes, each 256-byte aligned.
struct Layout {
  uint64_t words = 0, tiles = 0;
  uint64_t counts_at = 0, prefix_at = 0, bytes = 0;
};

constexpr uint64_t Align256(uint64_t b) { return (b + 255) / 256 * 256; }

Layout MakeLayout(uint64_t n) {
  Layout l;
  l.words = n / kWord + (n % kWord != 0);
  l.tiles = std::max<uint64_t>(1, (l.words + kTileWords - 1) / kTileWords);  // n == 0: one
  l.counts_at = Align256(l.tiles * kMasksPerTile * sizeof(uint64_t));
  l.prefix_at = l.counts_at + Align256(l.tiles * sizeof(TileCount));
  l.bytes = l.prefix_at + Align256(l.tiles * sizeof(TilePrefix));
  return l;
}

struct Plus {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

// Inclusive scan of one value per thread in thread order (op commutative and associative, T a
// built-in shuffle type); every thread of the block calls it. s_warp: kBlock / 32 slots.
template <int kBlock, typename T, typename Op>
__device__ T BlockInclusiveScan(T v, Op op, T* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = op(t, v);
  }
  if (lane == 31) s_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kBlock / 32;
    T w = lane < kWarps ? s_warp[lane] : T(0);
#pragma unroll
    for (int o = 1; o < kWarps; o <<= 1) {
      const T t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = op(t, w);
    }
    if (lane < kWarps) s_warp[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op(s_warp[warp - 1], v);
  __syncthreads();  // s_warp may be reused at once
  return v;
}

__device__ __forceinline__ uint64_t LoadWord(const uint8_t* p, uint64_t w) {
  return __ldg(reinterpret_cast<const unsigned long long*>(p) + w);
}

// Word w (< words) of a XOR b, the last word's bytes past n zero.
__device__ uint64_t XorWord(const uint8_t* a, const uint8_t* b, uint64_t w, uint64_t n) {
  if (kWord * w + kWord <= n) return LoadWord(a, w) ^ LoadWord(b, w);
  uint64_t x = 0;
  for (uint64_t i = kWord * w; i < n; ++i) {
    x |= static_cast<uint64_t>(a[i] ^ b[i]) << (8 * (i - kWord * w));
  }
  return x;
}

// The 16-bit lanes of x that are not zero (0..4).
__device__ __forceinline__ uint32_t LanesSet(uint64_t x) {
  uint32_t c = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) c += ((x >> (16 * k)) & 0xffff) != 0;
  return c;
}

// Whether word w (< words) differs; the last word compares only the bucket's bytes.
__device__ bool WordDiffers(const uint8_t* a, const uint8_t* b, uint64_t w, uint64_t n) {
  if (kWord * w + kWord <= n) return LoadWord(a, w) != LoadWord(b, w);
  bool d = false;
  for (uint64_t i = kWord * w; i < n; ++i) d |= a[i] != b[i];
  return d;
}

// Words 2p and 2p + 1: one 16-byte load where both buckets are 16-byte aligned, else two.
struct Pair {
  uint64_t lo, hi;
};
template <bool kVec16>
__device__ __forceinline__ Pair LoadPair(const uint8_t* p, uint64_t pair) {
  if constexpr (kVec16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + pair);
    return {static_cast<uint64_t>(v.y) << 32 | v.x, static_cast<uint64_t>(v.w) << 32 | v.z};
  } else {
    return {LoadWord(p, 2 * pair), LoadWord(p, 2 * pair + 1)};
  }
}

// Bit i of x to bit 2i.
__device__ __forceinline__ uint64_t SpreadBits(uint32_t x) {
  uint64_t v = x;
  v = (v | v << 16) & 0x0000FFFF0000FFFFull;
  v = (v | v << 8) & 0x00FF00FF00FF00FFull;
  v = (v | v << 4) & 0x0F0F0F0F0F0F0F0Full;
  v = (v | v << 2) & 0x3333333333333333ull;
  v = (v | v << 1) & 0x5555555555555555ull;
  return v;
}

// The run starts of mask word m: its changed words whose predecessor (prev_bit for bit 0) is not.
__device__ __forceinline__ uint64_t RunStarts(uint64_t m, uint64_t prev_bit) {
  return m & ~((m << 1) | prev_bit);
}

// One tile per CTA: lane l of a warp's load u compares words 2l and 2l + 1 of a 64-word mask
// word; two ballots make it. Then the tile's counts, from the masks in shared memory.
template <bool kVec16>
__global__ void __launch_bounds__(kThreads)
    CompareKernel(const uint8_t* base, const uint8_t* next, uint64_t n, uint64_t* masks,
                  TileCount* counts) {
  __shared__ uint64_t s_mask[kMasksPerTile];
  __shared__ uint32_t s_sum[kThreads / 32];
  __shared__ uint64_t s_max[kThreads / 32];
  __shared__ uint64_t s_carry;  // whether the word before the tile differs
  uint32_t units = 0;           // this thread's changed 16-bit units
  const uint64_t tile = blockIdx.x;
  const uint64_t words = n / kWord + (n % kWord != 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    s_carry = tile > 0 && WordDiffers(base, next, tile * kTileWords - 1, n);
  }
  Pair a[kUnroll], b[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint64_t pair = tile * (kTileWords / 2) + u * kThreads + threadIdx.x;
    if (16 * pair + 16 <= n) {
      a[u] = LoadPair<kVec16>(base, pair);
      b[u] = LoadPair<kVec16>(next, pair);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint64_t pair = tile * (kTileWords / 2) + u * kThreads + threadIdx.x;
    bool d0, d1;
    if (16 * pair + 16 <= n) {
      d0 = a[u].lo != b[u].lo;
      d1 = a[u].hi != b[u].hi;
      units += LanesSet(a[u].lo ^ b[u].lo) + LanesSet(a[u].hi ^ b[u].hi);
    } else {  // the bucket's end: a partial last word, or words past it
      d0 = 2 * pair < words && WordDiffers(base, next, 2 * pair, n);
      d1 = 2 * pair + 1 < words && WordDiffers(base, next, 2 * pair + 1, n);
      if (d0) units += LanesSet(XorWord(base, next, 2 * pair, n));
      if (d1) units += LanesSet(XorWord(base, next, 2 * pair + 1, n));
    }
    const uint32_t even = __ballot_sync(0xffffffffu, d0), odd = __ballot_sync(0xffffffffu, d1);
    if (lane == 0) s_mask[u * (kThreads / 32) + warp] = SpreadBits(even) | SpreadBits(odd) << 1;
  }
  __syncthreads();
  uint32_t packed = 0;
  uint64_t last_start1 = 0;
  const int k = threadIdx.x;
  if (k < kMasksPerTile) {
    const uint64_t m = s_mask[k];
    masks[tile * kMasksPerTile + k] = m;
    const uint64_t starts = RunStarts(m, k > 0 ? s_mask[k - 1] >> 63 : s_carry);
    packed = static_cast<uint32_t>(__popcll(m)) << 16 | static_cast<uint32_t>(__popcll(starts));
    if (starts != 0) last_start1 = tile * kTileWords + 64 * k + (63 - __clzll(starts)) + 1;
  }
  packed = BlockInclusiveScan<kThreads>(packed, Plus(), s_sum);
  last_start1 = BlockInclusiveScan<kThreads>(last_start1, Max(), s_max);
  units = BlockInclusiveScan<kThreads>(units, Plus(), s_sum);
  if (threadIdx.x == kThreads - 1) {
    counts[tile] = {packed >> 16, packed & 0xFFFF, last_start1, units};
  }
}

// One CTA: exclusive prefixes of the tile counts (rounds of kScanThreads * kScanItems tiles,
// each thread a run of consecutive tiles), then the totals and, when the patch fits, its header.
__global__ void __launch_bounds__(kScanThreads)
    ScanKernel(const TileCount* counts, TilePrefix* prefix, uint64_t tiles, const uint64_t* masks,
               uint64_t n, uint64_t base_checksum, uint64_t next_checksum, uint8_t* patch,
               uint64_t patch_capacity, uint32_t flags, bool indexed, BucketDiffTotals* totals) {
  __shared__ uint64_t s_runs[kScanThreads / 32], s_changed[kScanThreads / 32],
      s_open[kScanThreads / 32], s_units[kScanThreads / 32];
  // Over the rounds before, alike in every thread.
  uint64_t runs = 0, changed = 0, open1 = 0, units = 0;
  for (uint64_t round = 0; round < tiles; round += uint64_t{kScanThreads} * kScanItems) {
    const uint64_t first = round + uint64_t{threadIdx.x} * kScanItems;
    uint64_t r = 0, c = 0, o = 0, un = 0;
    for (int i = 0; i < kScanItems && first + i < tiles; ++i) {
      const TileCount t = counts[first + i];
      r += t.starts;
      c += t.changed;
      o = Max()(o, t.last_start1);
      un += t.units;
    }
    const uint64_t r_incl = BlockInclusiveScan<kScanThreads>(r, Plus(), s_runs);
    const uint64_t c_incl = BlockInclusiveScan<kScanThreads>(c, Plus(), s_changed);
    const uint64_t u_incl = BlockInclusiveScan<kScanThreads>(un, Plus(), s_units);
    const uint64_t o_incl = BlockInclusiveScan<kScanThreads>(o, Max(), s_open);
    // The max is not invertible: the exclusive value is the previous thread's inclusive one
    // (for a warp's lane 0, the warps' scan before it, which the slots still hold).
    const uint64_t o_lane_before = __shfl_up_sync(0xffffffffu, o_incl, 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t pr = runs + r_incl - r, pc = changed + c_incl - c, pu = units + u_incl - un;
    uint64_t po = Max()(open1, lane > 0 ? o_lane_before : (warp > 0 ? s_open[warp - 1] : 0));
    for (int i = 0; i < kScanItems && first + i < tiles; ++i) {
      prefix[first + i] = {pr, pc, po, pu};
      const TileCount t = counts[first + i];
      pr += t.starts;
      pc += t.changed;
      po = Max()(po, t.last_start1);
      pu += t.units;
    }
    // Every thread's round totals: the last thread's inclusive values, from the warp slots.
    runs += s_runs[kScanThreads / 32 - 1];
    changed += s_changed[kScanThreads / 32 - 1];
    open1 = Max()(open1, s_open[kScanThreads / 32 - 1]);
    units += s_units[kScanThreads / 32 - 1];
    __syncthreads();  // the slots are rewritten by the next round's scans
  }
  if (threadIdx.x != 0) return;
  const uint64_t words = n / kWord + (n % kWord != 0);
  const uint64_t tail = n % kWord;
  const bool last_changed = words > 0 && (masks[(words - 1) / 64] >> ((words - 1) % 64)) & 1;
  // Format 1: runs with their words (the partial last word only its bytes); format 3: a u32
  // index and a u16 XOR per changed unit.
  const uint64_t bytes = indexed ? kHeaderBytes + 6 * units
                                 : kHeaderBytes + kWord * (runs + changed) -
                                       (tail != 0 && last_changed ? kWord - tail : 0);
  const bool fits =
      bytes <= patch_capacity && (indexed ? (n + 1) / 2 <= uint64_t{UINT32_MAX} + 1
                                          : words <= UINT32_MAX && runs <= UINT32_MAX);
  totals->runs = runs;
  totals->changed_words = changed;
  totals->patch_bytes = bytes;
  totals->written = fits ? 1 : 0;
  totals->changed_units = units;
  if (!fits) return;
  // "WPBP", format 1 or 3, n, checksums, runs, flags, changed words (little-endian).
  auto* h = reinterpret_cast<unsigned long long*>(patch);
  h[0] = 0x50425057ull | uint64_t{indexed ? 3u : 1u} << 32;
  h[1] = n;
  h[2] = base_checksum;
  h[3] = next_checksum;
  if (indexed) {  // changed units, a reserved zero
    h[4] = units;
    h[5] = 0;
    return;
  }
  h[4] = runs | uint64_t{flags} << 32;
  h[5] = changed;
}

// One tile per CTA, tiles with a change only: changed word w of mask word k, bit b, with r runs
// started at or before it and c words changed before it, goes to 48 + 8 r + 8 c (next's word,
// or with xor_runs next's XOR base's); the word that ends a run also writes the run's header
// {first, words} 8 bytes before the run's first word.
__global__ void __launch_bounds__(kThreads)
    WriteKernel(const uint8_t* base, const uint8_t* next, bool xor_runs, uint64_t n,
                const uint64_t* masks, const TileCount* counts, const TilePrefix* prefix,
                uint64_t tiles, uint8_t* patch, const BucketDiffTotals* totals) {
  if (totals->written == 0) return;
  const uint64_t tile = blockIdx.x;
  if (counts[tile].changed == 0) return;
  __shared__ uint64_t s_mask[kMasksPerTile], s_starts[kMasksPerTile], s_open[kMasksPerTile];
  __shared__ uint32_t s_pre[kMasksPerTile];  // packed, over the tile's mask words before
  __shared__ uint32_t s_sum[kThreads / 32];
  __shared__ uint64_t s_max[kThreads / 32];
  __shared__ uint64_t s_next_bit;  // whether the word after the tile differs
  const TilePrefix pre = prefix[tile];
  const uint64_t tile_word = tile * kTileWords;
  const uint64_t* tile_masks = masks + tile * kMasksPerTile;
  const int k = threadIdx.x;
  uint64_t m = 0, starts = 0, open1 = 0;
  uint32_t packed = 0;
  if (k < kMasksPerTile) {
    m = tile_masks[k];
    const uint64_t prev = k > 0 ? tile_masks[k - 1] : (tile > 0 ? tile_masks[-1] : 0);
    starts = RunStarts(m, prev >> 63);
    packed = static_cast<uint32_t>(__popcll(m)) << 16 | static_cast<uint32_t>(__popcll(starts));
    if (starts != 0) open1 = tile_word + 64 * k + (63 - __clzll(starts)) + 1;
  }
  if (threadIdx.x == 0) s_next_bit = tile + 1 < tiles ? tile_masks[kMasksPerTile] & 1 : 0;
  const uint32_t packed_incl = BlockInclusiveScan<kThreads>(packed, Plus(), s_sum);
  const uint64_t open_incl = BlockInclusiveScan<kThreads>(open1, Max(), s_max);
  if (k < kMasksPerTile) {
    s_mask[k] = m;
    s_starts[k] = starts;
    s_pre[k] = packed_incl - packed;
    s_open[k] = Max()(open_incl, pre.open_start1);  // 1 + last run start up to mask word k's end
  }
  __syncthreads();
  for (int i = threadIdx.x; i < static_cast<int>(kTileWords); i += kThreads) {
    const int mk = i / 64, b = i % 64;
    const uint64_t mw = s_mask[mk];
    if ((mw >> b & 1) == 0) continue;
    const uint64_t w = tile_word + i;
    const uint64_t upto = ~uint64_t{0} >> (63 - b);  // bits 0..b
    const uint64_t st = s_starts[mk];
    const uint64_t r = pre.runs + (s_pre[mk] & 0xFFFF) + __popcll(st & upto);
    const uint64_t c = pre.changed + (s_pre[mk] >> 16) + __popcll(mw & (upto >> 1));
    const uint64_t at = kHeaderBytes + kWord * (r + c);
    if (kWord * w + kWord <= n) {
      *reinterpret_cast<unsigned long long*>(patch + at) =
          LoadWord(next, w) ^ (xor_runs ? LoadWord(base, w) : 0);
    } else {  // the bucket's partial last word: its bytes only, the patch's last
      for (uint64_t j = 0; kWord * w + j < n; ++j) {
        patch[at + j] = next[kWord * w + j] ^ (xor_runs ? base[kWord * w + j] : 0);
      }
    }
    const uint64_t next_bit =
        b < 63 ? mw >> (b + 1) & 1 : (mk + 1 < kMasksPerTile ? s_mask[mk + 1] & 1 : s_next_bit);
    if (next_bit != 0) continue;
    // The run's first word: its start in this mask word, else the last start before it.
    const uint64_t first = (st & upto) != 0 ? tile_word + 64 * mk + (63 - __clzll(st & upto))
                                            : (mk > 0 ? s_open[mk - 1] : pre.open_start1) - 1;
    const uint64_t run_words = w - first + 1;
    const uint64_t header = first | run_words << 32;  // u32 first, u32 words
    *reinterpret_cast<unsigned long long*>(patch + at - kWord * run_words) = header;
  }
}

// Format 3, one tile per CTA, tiles with a change only: thread t takes the tile's words
// [16 t, 16 t + 16) in order, counts their changed units, and after a block scan writes each
// one's u32 index at 48 + 4 p and its u16 XOR at 48 + 4 c + 2 p, p its place among the bucket's
// c changed units.
constexpr int kWordsPerThread = static_cast<int>(kTileWords / kThreads);
static_assert(kWordsPerThread == 16, "a quarter of a mask word per thread");
__global__ void __launch_bounds__(kThreads)
    WriteUnitsKernel(const uint8_t* base, const uint8_t* next, uint64_t n, const uint64_t* masks,
                     const TileCount* counts, const TilePrefix* prefix, uint8_t* patch,
                     BucketDiffTotals* totals) {
  if (totals->written == 0) return;
  const uint64_t tile = blockIdx.x;
  if (counts[tile].changed == 0) return;
  __shared__ uint32_t s_sum[kThreads / 32];
  const uint64_t first_word = tile * kTileWords + uint64_t{threadIdx.x} * kWordsPerThread;
  const uint64_t bits =
      masks[tile * kMasksPerTile + threadIdx.x / 4] >> (16 * (threadIdx.x % 4)) & 0xffff;
  uint64_t x[kWordsPerThread];
  uint32_t mine = 0;
#pragma unroll
  for (int i = 0; i < kWordsPerThread; ++i) {
    x[i] = (bits >> i & 1) != 0 ? XorWord(base, next, first_word + i, n) : 0;
    mine += LanesSet(x[i]);
  }
  const uint32_t incl = BlockInclusiveScan<kThreads>(mine, Plus(), s_sum);
  uint64_t p = prefix[tile].units + (incl - mine);
  const uint64_t total = totals->changed_units;
  auto* index = reinterpret_cast<uint32_t*>(patch + kHeaderBytes);
  auto* xors = reinterpret_cast<uint16_t*>(patch + kHeaderBytes + 4 * total);
#pragma unroll
  for (int i = 0; i < kWordsPerThread; ++i) {
    for (int k = 0; k < 4; ++k) {
      const uint16_t lane = static_cast<uint16_t>(x[i] >> (16 * k));
      if (lane == 0) continue;
      if (p >= total) {  // the bytes changed since they were counted: no patch
        totals->written = 0;
        return;
      }
      index[p] = static_cast<uint32_t>(4 * (first_word + i) + k);
      xors[p] = lane;
      ++p;
    }
  }
}

}  // namespace

uint64_t BucketDiffScratchBytes(uint64_t n, uint64_t /*patch_capacity*/) {
  return MakeLayout(n).bytes;
}

namespace {

cudaError_t LaunchDiff(const uint8_t* base, const uint8_t* next, uint64_t n, uint64_t base_checksum,
                       uint64_t next_checksum, uint8_t* patch, uint64_t patch_capacity,
                       void* scratch, uint64_t scratch_bytes, BucketDiffTotals* totals,
                       cudaStream_t stream, bool xor_runs, bool indexed) {
  const auto addr = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  // Launch errors are read back with cudaGetLastError: one an earlier call on this thread left
  // unread (not sticky) is not this launch's.
  (void)cudaGetLastError();
  const Layout l = MakeLayout(n);
  if ((n > 0 && (base == nullptr || next == nullptr)) || (patch_capacity > 0 && patch == nullptr) ||
      scratch == nullptr || totals == nullptr ||
      (addr(base) | addr(next) | addr(patch)) % kWord != 0 || addr(scratch) % 256 != 0 ||
      scratch_bytes < l.bytes || l.tiles > static_cast<uint64_t>(INT32_MAX)) {
    return cudaErrorInvalidValue;
  }
  auto* masks = static_cast<uint64_t*>(scratch);
  auto* counts = reinterpret_cast<TileCount*>(static_cast<uint8_t*>(scratch) + l.counts_at);
  auto* prefix = reinterpret_cast<TilePrefix*>(static_cast<uint8_t*>(scratch) + l.prefix_at);
  const unsigned grid = static_cast<unsigned>(l.tiles);
  if ((addr(base) | addr(next)) % 16 == 0) {
    CompareKernel<true><<<grid, kThreads, 0, stream>>>(base, next, n, masks, counts);
  } else {
    CompareKernel<false><<<grid, kThreads, 0, stream>>>(base, next, n, masks, counts);
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ScanKernel<<<1, kScanThreads, 0, stream>>>(counts, prefix, l.tiles, masks, n, base_checksum,
                                             next_checksum, patch, patch_capacity,
                                             xor_runs && !indexed ? 1u : 0u, indexed, totals);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (indexed) {
    WriteUnitsKernel<<<grid, kThreads, 0, stream>>>(base, next, n, masks, counts, prefix, patch,
                                                    totals);
  } else {
    WriteKernel<<<grid, kThreads, 0, stream>>>(base, next, xor_runs, n, masks, counts, prefix,
                                               l.tiles, patch, totals);
  }
  return cudaGetLastError();
}

// Format 3 (core/delta/bucket_patch.h) read from device memory. Every thread reads the header
// itself and does nothing with one that is not valid: no read past the patch's bytes.
struct Indexed {
  bool valid = false;
  uint64_t count = 0;               // changed units
  const uint32_t* index = nullptr;  // count x unit index, ascending
  const uint16_t* xors = nullptr;   // count x XOR
};

__device__ Indexed ReadIndexed(const uint8_t* patch, uint64_t patch_bytes, uint64_t n) {
  Indexed x;
  if (patch_bytes < kHeaderBytes) return x;
  const auto* h = reinterpret_cast<const unsigned long long*>(patch);
  const uint64_t units = (n + 1) / 2, count = h[4];
  if (h[0] != (0x50425057ull | uint64_t{3} << 32) || h[1] != n || h[5] != 0 || count > units ||
      patch_bytes != kHeaderBytes + 6 * count) {
    return x;
  }
  x.valid = true;
  x.count = count;
  x.index = reinterpret_cast<const uint32_t*>(patch + kHeaderBytes);
  x.xors = reinterpret_cast<const uint16_t*>(patch + kHeaderBytes + 4 * count);
  return x;
}

// Every check of delta::ApplyBucketPatch's format 3 parse, in parallel: the header, each
// entry's unit in range and after the one before, its XOR not zero (under 2^8 for an odd n's
// lone last byte). Any failure sets bit 0 of *error (zeroed before the launch).
__global__ void __launch_bounds__(kThreads)
    ValidateIndexedKernel(const uint8_t* patch, uint64_t patch_bytes, uint64_t n,
                          unsigned int* error) {
  const Indexed x = ReadIndexed(patch, patch_bytes, n);
  const uint64_t tid = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  if (!x.valid) {
    if (tid == 0) atomicOr(error, 1u);
    return;
  }
  const uint64_t units = (n + 1) / 2;
  bool bad = false;
  for (uint64_t i = tid; i < x.count; i += stride) {
    const uint64_t u = x.index[i];
    const uint32_t v = x.xors[i];
    bad |= u >= units || (i > 0 && u <= x.index[i - 1]) || v == 0 ||
           (n % 2 == 1 && u == units - 1 && v > 0xff);
  }
  if (bad) atomicOr(error, 1u);
}

// Entry i's XOR into its unit (a 16-bit store; the lone last byte of an odd n a byte).
__global__ void __launch_bounds__(kThreads)
    ApplyIndexedKernel(const uint8_t* patch, uint64_t patch_bytes, uint8_t* bucket, uint64_t n,
                       const unsigned int* error) {
  if (*error != 0) return;
  const Indexed x = ReadIndexed(patch, patch_bytes, n);
  if (!x.valid) return;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < x.count; i += stride) {
    const uint64_t u = x.index[i];
    if (2 * u + 1 < n) {
      reinterpret_cast<uint16_t*>(bucket)[u] ^= x.xors[i];
    } else {
      bucket[2 * u] ^= static_cast<uint8_t>(x.xors[i]);
    }
  }
}

}  // namespace

cudaError_t LaunchBucketDiff(const uint8_t* base, const uint8_t* next, uint64_t n,
                             uint64_t base_checksum, uint64_t next_checksum, uint8_t* patch,
                             uint64_t patch_capacity, void* scratch, uint64_t scratch_bytes,
                             BucketDiffTotals* totals, cudaStream_t stream, bool xor_runs) {
  return LaunchDiff(base, next, n, base_checksum, next_checksum, patch, patch_capacity, scratch,
                    scratch_bytes, totals, stream, xor_runs, /*indexed=*/false);
}

cudaError_t LaunchBucketDiffIndexed(const uint8_t* base, const uint8_t* next, uint64_t n,
                                    uint64_t base_checksum, uint64_t next_checksum, uint8_t* patch,
                                    uint64_t patch_capacity, void* scratch, uint64_t scratch_bytes,
                                    BucketDiffTotals* totals, cudaStream_t stream) {
  return LaunchDiff(base, next, n, base_checksum, next_checksum, patch, patch_capacity, scratch,
                    scratch_bytes, totals, stream, /*xor_runs=*/true, /*indexed=*/true);
}

cudaError_t LaunchBucketPatchApply(const uint8_t* patch, uint64_t patch_bytes, uint8_t* bucket,
                                   uint64_t n, unsigned int* error, cudaStream_t stream) {
  const auto addr = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  if (patch == nullptr || error == nullptr || (n > 0 && bucket == nullptr) ||
      (addr(patch) | addr(bucket)) % kWord != 0 || addr(error) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  (void)cudaGetLastError();  // as LaunchDiff: an earlier call's unread error is not ours
  if (const cudaError_t e = cudaMemsetAsync(error, 0, sizeof(unsigned int), stream);
      e != cudaSuccess) {
    return e;
  }
  // A thread per entry (under patch_bytes / 6), grid-strided.
  const uint64_t items = std::max<uint64_t>(1, patch_bytes / 6);
  const unsigned grid =
      static_cast<unsigned>(std::min<uint64_t>((items + kThreads - 1) / kThreads, 8192));
  ValidateIndexedKernel<<<grid, kThreads, 0, stream>>>(patch, patch_bytes, n, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ApplyIndexedKernel<<<grid, kThreads, 0, stream>>>(patch, patch_bytes, bucket, n, error);
  return cudaGetLastError();
}

}  // namespace wpub::kernels::cuda
