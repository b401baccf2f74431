// Bucket patches: the changed 16-bit units (format 2) or 8-byte word runs (format 1) of a
// bucket, and their exact application.
#include "core/delta/bucket_patch.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/common/parallel_for.h"
#include "core/common/status.h"
#include "core/transport/checksum.h"

namespace wpub::delta {
namespace {

constexpr char kMagic[4] = {'W', 'P', 'B', 'P'};
constexpr uint64_t kWord = 8;
constexpr size_t kRunHeaderBytes = 8;
constexpr uint32_t kXorRunsFlag = 1;
// The comparison's slices (in words: a whole number of units) and the application's (bytes:
// one pass copies, patches and checksums a slice while it is in cache).
constexpr uint64_t kDiffSliceWords = uint64_t{1} << 18;
constexpr uint64_t kApplySliceBytes = uint64_t{1} << 20;

template <typename T>
void Put(std::vector<uint8_t>* out, size_t at, T v) {
  std::memcpy(out->data() + at, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Bytes of word w of an n-byte buffer (8, or fewer for the last word).
uint64_t WordBytes(uint64_t w, uint64_t n) { return std::min(kWord, n - w * kWord); }

// Word w of an n-byte buffer, little-endian, zero-padded past n.
uint64_t LoadWord(const uint8_t* p, uint64_t w, uint64_t n) {
  uint64_t v = 0;
  std::memcpy(&v, p + w * kWord, WordBytes(w, n));
  return v;
}

bool WordDiffers(const uint8_t* a, const uint8_t* b, uint64_t w, uint64_t n) {
  return std::memcmp(a + w * kWord, b + w * kWord, WordBytes(w, n)) != 0;
}

struct Run {
  uint64_t first = 0, words = 0;
};

// LEB128.
size_t VarintBytes(uint64_t v) {
  size_t k = 1;
  while (v >= 0x80) v >>= 7, ++k;
  return k;
}
uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}
// The varint at p[*at..end), minimal (no trailing zero group) and at most 64 bits; false
// otherwise.
bool GetVarint(const uint8_t* p, size_t end, size_t* at, uint64_t* v) {
  uint64_t out = 0;
  for (int shift = 0; shift < 64 && *at < end; shift += 7) {
    const uint8_t b = p[(*at)++];
    if (shift == 63 && b > 1) return false;
    out |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      if (b == 0 && shift > 0) return false;  // not minimal
      *v = out;
      return true;
    }
  }
  return false;
}

// The header both formats share.
void PutHeader(std::vector<uint8_t>* patch, PatchFormat format, uint64_t n, uint64_t base_checksum,
               uint64_t next_checksum) {
  std::memcpy(patch->data(), kMagic, 4);
  Put<uint32_t>(patch, 4, static_cast<uint32_t>(format));
  Put<uint64_t>(patch, 8, n);
  Put<uint64_t>(patch, 16, base_checksum);
  Put<uint64_t>(patch, 24, next_checksum);
}

// The plan when the bytes compared changed between an encoder's passes (a caller's contract
// broken): no patch.
BucketPatchPlan ChangedWhileCompared() {
  BucketPatchPlan plan;
  plan.full = true;
  plan.why = "the bytes changed while they were compared";
  return plan;
}

bool OverLimit(uint64_t size, double fraction, uint64_t n) {
  return static_cast<double>(size) > fraction * static_cast<double>(n);
}

std::string OverLimitWhy(uint64_t size, double fraction, uint64_t n) {
  return absl::StrCat("a patch would be ", size, " bytes, over ", fraction, " of the bucket's ", n);
}

// Calls fn(unit, xor) for each changed unit of the XOR word x (word w), ascending.
template <typename Fn>
void ForUnits(uint64_t x, uint64_t w, Fn&& fn) {
  for (int k = 0; k < 4 && x != 0; ++k, x >>= 16) {
    if ((x & 0xffff) != 0) fn(w * 4 + k, static_cast<uint32_t>(x & 0xffff));
  }
}

// Format 1 (word runs), optionally with the run bytes as XORs.
BucketPatchPlan DiffWordRuns(absl::Span<const uint8_t> base, uint64_t base_checksum,
                             absl::Span<const uint8_t> next, uint64_t next_checksum,
                             const BucketPatchOptions& options) {
  BucketPatchPlan plan;
  const uint64_t n = next.size();
  const uint64_t words = (n + kWord - 1) / kWord;
  // Runs per slice of the words, found in parallel, joined in order (a run may span slices).
  constexpr uint64_t kSlice = uint64_t{1} << 20;  // words
  const size_t slices = static_cast<size_t>((words + kSlice - 1) / kSlice);
  std::vector<std::vector<Run>> found(slices);
  ParallelFor(slices, options.threads, [&](size_t s) {
    const uint64_t lo = s * kSlice, hi = std::min(words, lo + kSlice);
    std::vector<Run>& runs = found[s];
    for (uint64_t w = lo; w < hi; ++w) {
      if (!WordDiffers(base.data(), next.data(), w, n)) continue;
      if (!runs.empty() && runs.back().first + runs.back().words == w) {
        ++runs.back().words;
      } else {
        runs.push_back({w, 1});
      }
    }
  });
  std::vector<Run> runs;
  for (const std::vector<Run>& f : found) {
    for (const Run& r : f) {
      if (!runs.empty() && runs.back().first + runs.back().words == r.first) {
        runs.back().words += r.words;
      } else {
        runs.push_back(r);
      }
    }
  }
  uint64_t size = kBucketPatchHeaderBytes;
  for (const Run& r : runs) {
    plan.changed_words += r.words;
    size += kRunHeaderBytes + std::min(r.words * kWord, n - r.first * kWord);
  }
  if (runs.size() > UINT32_MAX || words > UINT32_MAX) {
    plan.full = true;
    plan.why = "too many words or runs for a patch";
    return plan;
  }
  if (OverLimit(size, options.max_patch_fraction, n)) {
    plan.full = true;
    plan.why = OverLimitWhy(size, options.max_patch_fraction, n);
    return plan;
  }
  plan.runs = static_cast<uint32_t>(runs.size());
  plan.patch.assign(size, 0);
  PutHeader(&plan.patch, PatchFormat::kWordRuns, n, base_checksum, next_checksum);
  Put<uint32_t>(&plan.patch, 32, plan.runs);
  Put<uint32_t>(&plan.patch, 36, options.xor_runs ? kXorRunsFlag : 0);
  Put<uint64_t>(&plan.patch, 40, plan.changed_words);
  size_t at = kBucketPatchHeaderBytes;
  for (const Run& r : runs) {
    Put<uint32_t>(&plan.patch, at, static_cast<uint32_t>(r.first));
    Put<uint32_t>(&plan.patch, at + 4, static_cast<uint32_t>(r.words));
    at += kRunHeaderBytes;
    const uint64_t bytes = std::min(r.words * kWord, n - r.first * kWord);
    std::memcpy(plan.patch.data() + at, next.data() + r.first * kWord, bytes);
    if (options.xor_runs) {
      for (uint64_t i = 0; i < bytes; ++i) plan.patch[at + i] ^= base[r.first * kWord + i];
    }
    at += bytes;
  }
  return plan;
}

// Format 2 (units) from the changed units of `slices` slices, each in ascending order and
// every slice's after the one before's: each_changed(s, fn) calls fn(unit, xor) for slice s's.
// Two passes -- sizes, then the entries written in place -- so that the decision comes before
// any patch memory, and the patch does not depend on the threads.
template <typename EachChanged>
BucketPatchPlan EncodeUnits(size_t slices, int threads, uint64_t n, uint64_t base_checksum,
                            uint64_t next_checksum, double max_patch_fraction,
                            EachChanged&& each_changed) {
  BucketPatchPlan plan;
  struct Slice {
    uint64_t count = 0, first = 0, last = 0;
    uint64_t bytes = 0;  // every entry's, but for the first's gap (which depends on slices before)
    uint64_t at = 0, next_unit = 0;  // where its entries go; `next` before its first
  };
  std::vector<Slice> sl(slices);
  ParallelFor(slices, threads, [&](size_t s) {
    Slice& c = sl[s];
    each_changed(s, [&](uint64_t u, uint32_t x) {
      if (c.count != 0) c.bytes += VarintBytes(u - c.last - 1);
      if (c.count == 0) c.first = u;
      c.bytes += VarintBytes(x);
      c.last = u;
      ++c.count;
    });
  });
  uint64_t entry_bytes = 0, next_unit = 0;
  for (Slice& c : sl) {
    if (c.count == 0) continue;
    c.at = kBucketPatchHeaderBytes + entry_bytes;
    c.next_unit = next_unit;
    entry_bytes += VarintBytes(c.first - next_unit) + c.bytes;
    next_unit = c.last + 1;
    plan.changed_units += c.count;
  }
  const uint64_t size = kBucketPatchHeaderBytes + entry_bytes;
  if (OverLimit(size, max_patch_fraction, n)) {
    plan.full = true;
    plan.why = OverLimitWhy(size, max_patch_fraction, n);
    return plan;
  }
  plan.patch.assign(size, 0);
  PutHeader(&plan.patch, PatchFormat::kUnits, n, base_checksum, next_checksum);
  Put<uint64_t>(&plan.patch, 32, plan.changed_units);
  Put<uint64_t>(&plan.patch, 40, entry_bytes);
  // Each slice writes exactly what it counted; should the bytes compared have changed between
  // the passes (a caller's contract broken), no write leaves the slice's share and the patch is
  // refused.
  std::atomic<bool> moved{false};
  ParallelFor(slices, threads, [&](size_t s) {
    if (sl[s].count == 0) return;
    uint8_t* p = plan.patch.data() + sl[s].at;
    uint8_t* const end = p + VarintBytes(sl[s].first - sl[s].next_unit) + sl[s].bytes;
    uint64_t next_u = sl[s].next_unit;
    each_changed(s, [&](uint64_t u, uint32_t x) {
      if (u < next_u || p + VarintBytes(u - next_u) + VarintBytes(x) > end) {
        moved = true;
        return;
      }
      p = PutVarint(p, u - next_u);
      p = PutVarint(p, x);
      next_u = u + 1;
    });
    if (p != end) moved = true;
  });
  if (moved) plan = ChangedWhileCompared();
  return plan;
}

// Format 2 from the two buckets: slices of the words.
BucketPatchPlan DiffUnits(absl::Span<const uint8_t> base, uint64_t base_checksum,
                          absl::Span<const uint8_t> next, uint64_t next_checksum,
                          const BucketPatchOptions& options) {
  const uint64_t n = next.size();
  const uint64_t words = (n + kWord - 1) / kWord;
  const size_t slices = static_cast<size_t>((words + kDiffSliceWords - 1) / kDiffSliceWords);
  return EncodeUnits(slices, options.threads, n, base_checksum, next_checksum,
                     options.max_patch_fraction, [&](size_t s, auto&& fn) {
                       const uint64_t lo = s * kDiffSliceWords;
                       const uint64_t hi = std::min(words, lo + kDiffSliceWords);
                       for (uint64_t w = lo; w < hi; ++w) {
                         const uint64_t x =
                             LoadWord(base.data(), w, n) ^ LoadWord(next.data(), w, n);
                         if (x != 0) ForUnits(x, w, fn);
                       }
                     });
}

// Format 3 from the two buckets: per slice of the words its changed units counted, then written
// at their places (the index array, then the XOR array).
BucketPatchPlan DiffIndexedUnits(absl::Span<const uint8_t> base, uint64_t base_checksum,
                                 absl::Span<const uint8_t> next, uint64_t next_checksum,
                                 const BucketPatchOptions& options) {
  BucketPatchPlan plan;
  const uint64_t n = next.size();
  const uint64_t words = (n + kWord - 1) / kWord;
  if ((n + 1) / 2 > uint64_t{UINT32_MAX} + 1) {
    plan.full = true;
    plan.why = "too many units for format 3's 32-bit indices";
    return plan;
  }
  const size_t slices = static_cast<size_t>((words + kDiffSliceWords - 1) / kDiffSliceWords);
  std::vector<uint64_t> count(slices, 0), changed_words(slices, 0);
  auto each = [&](size_t s, auto&& fn) {
    const uint64_t lo = s * kDiffSliceWords, hi = std::min(words, lo + kDiffSliceWords);
    for (uint64_t w = lo; w < hi; ++w) {
      const uint64_t x = LoadWord(base.data(), w, n) ^ LoadWord(next.data(), w, n);
      if (x != 0) fn(w, x);
    }
  };
  ParallelFor(slices, options.threads, [&](size_t s) {
    each(s, [&](uint64_t w, uint64_t x) {
      ++changed_words[s];
      ForUnits(x, w, [&](uint64_t, uint32_t) { ++count[s]; });
    });
  });
  std::vector<uint64_t> at(slices, 0);
  for (size_t s = 0; s < slices; ++s) {
    at[s] = plan.changed_units;
    plan.changed_units += count[s];
    plan.changed_words += changed_words[s];
  }
  const uint64_t size = kBucketPatchHeaderBytes + 6 * plan.changed_units;
  if (OverLimit(size, options.max_patch_fraction, n)) {
    plan.full = true;
    plan.why = OverLimitWhy(size, options.max_patch_fraction, n);
    return plan;
  }
  plan.patch.assign(size, 0);
  PutHeader(&plan.patch, PatchFormat::kIndexedUnits, n, base_checksum, next_checksum);
  Put<uint64_t>(&plan.patch, 32, plan.changed_units);
  const size_t xors = kBucketPatchHeaderBytes + 4 * plan.changed_units;
  std::atomic<bool> moved{false};
  ParallelFor(slices, options.threads, [&](size_t s) {
    uint64_t i = at[s];
    const uint64_t end = at[s] + count[s];
    each(s, [&](uint64_t w, uint64_t x) {
      ForUnits(x, w, [&](uint64_t u, uint32_t v) {
        if (i >= end) {  // the bytes changed between the passes (a caller's contract broken)
          moved = true;
          return;
        }
        Put<uint32_t>(&plan.patch, kBucketPatchHeaderBytes + 4 * i, static_cast<uint32_t>(u));
        Put<uint16_t>(&plan.patch, xors + 2 * i, static_cast<uint16_t>(v));
        ++i;
      });
    });
    if (i != end) moved = true;
  });
  if (moved) plan = ChangedWhileCompared();
  return plan;
}

// A parsed patch, ready to apply slice by slice.
struct Edits {
  PatchFormat format = PatchFormat::kUnits;
  uint64_t n = 0, base_checksum = 0, target_checksum = 0;
  size_t patch_size = 0;
  // Format 1: runs, with where their bytes are in the patch.
  std::vector<Run> runs;
  std::vector<size_t> run_at;
  // Format 2, per application slice: where in the patch its first entry is (the first whose
  // unit lies at or after the slice's start; the patch's end when none) and the `next` unit
  // before it -- the slice decodes its own entries (the whole patch was validated first).
  std::vector<size_t> slice_at;
  std::vector<uint64_t> slice_next;
  // Format 3: the changed units.
  uint64_t count = 0;
};

// Format 3 after the shared header (e holds it): the units ascending and in range, each XOR
// not zero (under 2^8 for an odd n's lone last byte) -- the GPU's validation makes the same
// checks (kernels/cuda/bucket_diff.h, LaunchBucketPatchApply).
absl::StatusOr<Edits> ParseIndexed(absl::Span<const uint8_t> patch, Edits& e) {
  const uint8_t* p = patch.data();
  const uint64_t n = e.n, units = (n + 1) / 2;
  const uint64_t count = Get<uint64_t>(p + 32);
  if (Get<uint64_t>(p + 40) != 0) {
    return absl::InvalidArgumentError("bucket patch: format 3 with a reserved field set");
  }
  // The size first (6 * count could wrap for a count the header makes up).
  if ((patch.size() - kBucketPatchHeaderBytes) % 6 != 0 ||
      count != (patch.size() - kBucketPatchHeaderBytes) / 6 || count > units) {
    return absl::InvalidArgumentError(absl::StrCat("bucket patch: ", count, " changed units in ",
                                                   patch.size(), " bytes, for a bucket of ", units,
                                                   " units"));
  }
  e.format = PatchFormat::kIndexedUnits;
  e.count = count;
  const uint8_t* xors = p + kBucketPatchHeaderBytes + 4 * count;
  uint64_t next_u = 0;  // the first unit an entry may name
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t u = Get<uint32_t>(p + kBucketPatchHeaderBytes + 4 * i);
    const uint32_t x = Get<uint16_t>(xors + 2 * i);
    if (u < next_u || u >= units) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: entry ", i, " (unit ", u, ") is out of order or range"));
    }
    if (x == 0 || (n % 2 == 1 && u == units - 1 && x > 0xff)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: entry ", i, " (unit ", u, ") has XOR ", x));
    }
    next_u = u + 1;
  }
  return std::move(e);
}

// `xor_runs`: format 1 with the xor-runs flag is what is expected (UnitsFromXorRuns).
absl::StatusOr<Edits> Parse(absl::Span<const uint8_t> patch, bool xor_runs = false) {
  if (patch.size() < kBucketPatchHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: ", patch.size(), " bytes, shorter than its header"));
  }
  const uint8_t* p = patch.data();
  if (std::memcmp(p, kMagic, 4) != 0) {
    return absl::InvalidArgumentError("bucket patch: not a patch (magic)");
  }
  Edits e;
  e.patch_size = patch.size();
  const uint32_t format = Get<uint32_t>(p + 4);
  e.n = Get<uint64_t>(p + 8);
  e.base_checksum = Get<uint64_t>(p + 16);
  e.target_checksum = Get<uint64_t>(p + 24);
  const uint64_t n = e.n;
  if (format == static_cast<uint32_t>(PatchFormat::kWordRuns)) {
    e.format = PatchFormat::kWordRuns;
    if (Get<uint32_t>(p + 36) != (xor_runs ? kXorRunsFlag : 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: format 1 with flags ", Get<uint32_t>(p + 36),
                       " (xor runs are an intermediate of the GPU diff, not a patch to apply)"));
    }
    const uint32_t runs = Get<uint32_t>(p + 32);
    const uint64_t words = (n + kWord - 1) / kWord;
    size_t at = kBucketPatchHeaderBytes;
    uint64_t next_free = 0;  // the first word a run may start at
    e.runs.reserve(std::min<size_t>(runs, patch.size() / kRunHeaderBytes));
    for (uint32_t i = 0; i < runs; ++i) {
      if (patch.size() - at < kRunHeaderBytes) {
        return absl::InvalidArgumentError(absl::StrCat("bucket patch: run ", i, " is truncated"));
      }
      const uint64_t first = Get<uint32_t>(p + at), count = Get<uint32_t>(p + at + 4);
      at += kRunHeaderBytes;
      if (count == 0 || first < next_free || first >= words || count > words - first) {
        return absl::InvalidArgumentError(absl::StrCat("bucket patch: run ", i, " (words ", first,
                                                       " + ", count, ") is out of order or range"));
      }
      const uint64_t bytes = std::min(count * kWord, n - first * kWord);
      if (patch.size() - at < bytes) {
        return absl::InvalidArgumentError(absl::StrCat("bucket patch: run ", i, " is truncated"));
      }
      e.runs.push_back({first, count});
      e.run_at.push_back(at);
      at += bytes;
      next_free = first + count + 1;  // runs never touch: adjacent ones would be one
    }
    if (at != patch.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: ", patch.size() - at, " bytes after its last run"));
    }
    return e;
  }
  if (format == static_cast<uint32_t>(PatchFormat::kIndexedUnits)) return ParseIndexed(patch, e);
  if (format != static_cast<uint32_t>(PatchFormat::kUnits)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: format ", format, ", not 1, 2 or 3"));
  }
  const uint64_t count = Get<uint64_t>(p + 32);
  const uint64_t entry_bytes = Get<uint64_t>(p + 40);
  if (entry_bytes != patch.size() - kBucketPatchHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("bucket patch: entry bytes ", entry_bytes,
                                                   ", the patch holds ",
                                                   patch.size() - kBucketPatchHeaderBytes));
  }
  const uint64_t units = (n + 1) / 2;
  if (count > units || count > entry_bytes / 2) {
    return absl::InvalidArgumentError(absl::StrCat("bucket patch: ", count,
                                                   " changed units do not fit the bucket's ", units,
                                                   " or the patch's entries"));
  }
  const size_t slices = static_cast<size_t>((n + kApplySliceBytes - 1) / kApplySliceBytes);
  e.slice_at.reserve(slices);
  e.slice_next.reserve(slices);
  size_t at = kBucketPatchHeaderBytes;
  uint64_t next_u = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t entry_at = at;
    uint64_t gap = 0, x = 0;
    if (!GetVarint(p, patch.size(), &at, &gap) || !GetVarint(p, patch.size(), &at, &x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: entry ", i, " is truncated or not a minimal varint"));
    }
    if (gap >= units - next_u) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: entry ", i, " is beyond the bucket's ", units, " units"));
    }
    const uint64_t u = next_u + gap;
    const bool lone_byte = n % 2 == 1 && u == units - 1;
    if (x == 0 || x > (lone_byte ? 0xffu : 0xffffu)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket patch: entry ", i, " (unit ", u, ") has XOR ", x));
    }
    // The slices that start at or before this unit and have no first entry yet: this is it.
    while (e.slice_at.size() < slices && e.slice_at.size() * kApplySliceBytes <= 2 * u) {
      e.slice_at.push_back(entry_at);
      e.slice_next.push_back(next_u);
    }
    next_u = u + 1;
  }
  if (at != patch.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: ", patch.size() - at, " bytes after its last entry"));
  }
  e.slice_at.resize(slices, patch.size());
  e.slice_next.resize(slices, next_u);
  return e;
}

// Applies the edits that fall in bytes [lo, hi) of `out` (a copy of the base there).
void ApplySlice(const Edits& e, const uint8_t* patch, uint64_t lo, uint64_t hi, uint8_t* out) {
  if (e.format == PatchFormat::kIndexedUnits) {
    // The first entry whose unit starts at or after lo (units never straddle a slice).
    const uint8_t* index = patch + kBucketPatchHeaderBytes;
    const uint8_t* xors = index + 4 * e.count;
    uint64_t a = 0, b = e.count;
    while (a < b) {
      const uint64_t mid = a + (b - a) / 2;
      if (2 * uint64_t{Get<uint32_t>(index + 4 * mid)} < lo) {
        a = mid + 1;
      } else {
        b = mid;
      }
    }
    for (uint64_t i = a; i < e.count; ++i) {
      const uint64_t at = 2 * uint64_t{Get<uint32_t>(index + 4 * i)};
      if (at >= hi) break;
      const uint16_t x = Get<uint16_t>(xors + 2 * i);
      out[at] ^= static_cast<uint8_t>(x);
      if (at + 1 < e.n) out[at + 1] ^= static_cast<uint8_t>(x >> 8);
    }
    return;
  }
  if (e.format == PatchFormat::kWordRuns) {
    // The first run that ends after lo.
    auto it = std::upper_bound(e.runs.begin(), e.runs.end(), lo, [](uint64_t b, const Run& r) {
      return b < (r.first + r.words) * kWord;
    });
    for (; it != e.runs.end() && it->first * kWord < hi; ++it) {
      const uint64_t start = it->first * kWord;
      const uint64_t end = std::min({(it->first + it->words) * kWord, e.n, hi});
      const uint64_t from = std::max(start, lo);
      const size_t r = static_cast<size_t>(it - e.runs.begin());
      std::memcpy(out + from, patch + e.run_at[r] + (from - start), end - from);
    }
    return;
  }
  const size_t s = static_cast<size_t>(lo / kApplySliceBytes);
  size_t at = e.slice_at[s];
  uint64_t next_u = e.slice_next[s];
  while (at < e.patch_size) {
    uint64_t gap = 0, x = 0;
    GetVarint(patch, e.patch_size, &at, &gap);  // validated by Parse
    GetVarint(patch, e.patch_size, &at, &x);
    const uint64_t b = 2 * (next_u + gap);
    if (b >= hi) break;
    out[b] ^= static_cast<uint8_t>(x);
    if (b + 1 < e.n) out[b + 1] ^= static_cast<uint8_t>(x >> 8);
    next_u += gap + 1;
  }
}

}  // namespace

uint64_t XorRunsCapacity(uint64_t n, uint64_t limit) {
  const uint64_t most = n > std::numeric_limits<uint64_t>::max() - 64 ? n : n + 64;
  if (limit <= kBucketPatchHeaderBytes) return kBucketPatchHeaderBytes;
  const uint64_t entries = limit - kBucketPatchHeaderBytes;
  if (entries > (most - kBucketPatchHeaderBytes) / 8) return most;
  return std::min(most, kBucketPatchHeaderBytes + 8 * entries);
}

BucketPatchPlan DiffBucket(absl::Span<const uint8_t> base, uint64_t base_checksum,
                           absl::Span<const uint8_t> next, uint64_t next_checksum,
                           const BucketPatchOptions& options) {
  if (base.size() != next.size()) {
    BucketPatchPlan plan;
    plan.full = true;
    plan.why = absl::StrCat("the bucket is ", next.size(), " bytes, its base ", base.size());
    return plan;
  }
  switch (options.format) {
    case PatchFormat::kWordRuns:
      return DiffWordRuns(base, base_checksum, next, next_checksum, options);
    case PatchFormat::kIndexedUnits:
      return DiffIndexedUnits(base, base_checksum, next, next_checksum, options);
    case PatchFormat::kUnits:
      break;
  }
  return DiffUnits(base, base_checksum, next, next_checksum, options);
}

absl::StatusOr<BucketPatchPlan> UnitsFromXorRuns(absl::Span<const uint8_t> xor_runs,
                                                 double max_patch_fraction, int threads) {
  if (xor_runs.size() < kBucketPatchHeaderBytes || std::memcmp(xor_runs.data(), kMagic, 4) != 0 ||
      Get<uint32_t>(xor_runs.data() + 4) != static_cast<uint32_t>(PatchFormat::kWordRuns) ||
      Get<uint32_t>(xor_runs.data() + 36) != kXorRunsFlag) {
    return absl::InvalidArgumentError(
        "xor runs: not a format 1 patch with the xor-runs flag (header)");
  }
  // The runs' order and ranges checked as a patch's are.
  absl::StatusOr<Edits> runs = Parse(xor_runs, /*xor_runs=*/true);
  if (!runs.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("xor runs: ", runs.status().message()));
  }
  const uint64_t n = runs->n;
  // Slices of consecutive runs, about kDiffSliceWords words each.
  std::vector<size_t> first_run = {0};
  uint64_t words = 0;
  for (size_t r = 0; r < runs->runs.size(); ++r) {
    if (words >= kDiffSliceWords) {
      first_run.push_back(r);
      words = 0;
    }
    words += runs->runs[r].words;
  }
  first_run.push_back(runs->runs.size());
  std::atomic<bool> zero_word{false};
  BucketPatchPlan plan =
      EncodeUnits(first_run.size() - 1, threads, n, runs->base_checksum, runs->target_checksum,
                  max_patch_fraction, [&](size_t s, auto&& fn) {
                    for (size_t r = first_run[s]; r < first_run[s + 1]; ++r) {
                      const Run run = runs->runs[r];
                      const uint8_t* bytes = xor_runs.data() + runs->run_at[r];
                      for (uint64_t w = run.first; w < run.first + run.words; ++w) {
                        uint64_t x = 0;
                        std::memcpy(&x, bytes + (w - run.first) * kWord, WordBytes(w, n));
                        if (x == 0) zero_word = true;
                        ForUnits(x, w, fn);
                      }
                    }
                  });
  if (zero_word) {
    return absl::InvalidArgumentError("xor runs: a word in a run does not differ");
  }
  return plan;
}

uint64_t PatchTargetChecksum(absl::Span<const uint8_t> patch) {
  return patch.size() < kBucketPatchHeaderBytes ? 0 : Get<uint64_t>(patch.data() + 24);
}

absl::Status ApplyBucketPatchInto(absl::Span<const uint8_t> patch, absl::Span<const uint8_t> base,
                                  std::vector<uint8_t>* out, const ApplyPatchOptions& options) {
  WPUB_ASSIGN_OR_RETURN(const Edits e, Parse(patch));
  const uint64_t n = e.n;
  if (base.size() != n) {
    return absl::FailedPreconditionError(absl::StrCat("bucket patch: for a base of ", n,
                                                      " bytes, the receiver holds ", base.size()));
  }
  const bool read_base_sum = !options.base_checksum.has_value();
  if (!read_base_sum && *options.base_checksum != e.base_checksum) {
    return absl::FailedPreconditionError(
        "bucket patch: the receiver's bucket is not the patch's base (checksum)");
  }
  out->resize(n);
  // One pass: per slice, copy the base, sum it (unless known), patch, sum the result.
  const size_t slices = static_cast<size_t>((n + kApplySliceBytes - 1) / kApplySliceBytes);
  std::vector<uint64_t> base_sums(slices, 0), out_sums(slices, 0);
  ParallelFor(slices, options.threads, [&](size_t s) {
    const uint64_t lo = s * kApplySliceBytes, hi = std::min(n, lo + kApplySliceBytes);
    std::memcpy(out->data() + lo, base.data() + lo, hi - lo);
    if (read_base_sum)
      base_sums[s] = transport::ChecksumPartial(base.data() + lo, hi - lo, lo / kWord);
    ApplySlice(e, patch.data(), lo, hi, out->data());
    out_sums[s] = transport::ChecksumPartial(out->data() + lo, hi - lo, lo / kWord);
  });
  uint64_t base_sum = 0, out_sum = 0;
  for (size_t s = 0; s < slices; ++s) base_sum += base_sums[s], out_sum += out_sums[s];
  if (read_base_sum && transport::ChecksumFinish(base_sum, n) != e.base_checksum) {
    return absl::FailedPreconditionError(
        "bucket patch: the receiver's bucket is not the patch's base (checksum)");
  }
  if (transport::ChecksumFinish(out_sum, n) != e.target_checksum) {
    return absl::DataLossError(
        "bucket patch: the patched bucket does not have the target's checksum");
  }
  if (options.checksum != nullptr) *options.checksum = e.target_checksum;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> ApplyBucketPatch(absl::Span<const uint8_t> patch,
                                                      absl::Span<const uint8_t> base,
                                                      const ApplyPatchOptions& options) {
  std::vector<uint8_t> out;
  WPUB_RETURN_IF_ERROR(ApplyBucketPatchInto(patch, base, &out, options));
  return out;
}

}  // namespace wpub::delta
