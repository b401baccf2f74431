// Bucket patches: the changed 8-byte word runs of a bucket, and their exact application.
#include "core/delta/bucket_patch.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/common/parallel_for.h"
#include "core/transport/checksum.h"

namespace wpub::delta {
namespace {

constexpr char kMagic[4] = {'W', 'P', 'B', 'P'};
constexpr uint32_t kFormat = 1;
constexpr uint64_t kWord = 8;
constexpr size_t kRunHeaderBytes = 8;

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

bool WordDiffers(const uint8_t* a, const uint8_t* b, uint64_t w, uint64_t n) {
  return std::memcmp(a + w * kWord, b + w * kWord, WordBytes(w, n)) != 0;
}

struct Run {
  uint64_t first = 0, words = 0;
};

}  // namespace

uint64_t PatchTargetChecksum(absl::Span<const uint8_t> patch) {
  return patch.size() < kBucketPatchHeaderBytes ? 0 : Get<uint64_t>(patch.data() + 24);
}

BucketPatchPlan DiffBucket(absl::Span<const uint8_t> base, uint64_t base_checksum,
                           absl::Span<const uint8_t> next, uint64_t next_checksum,
                           const BucketPatchOptions& options) {
  BucketPatchPlan plan;
  if (base.size() != next.size()) {
    plan.full = true;
    plan.why = absl::StrCat("the bucket is ", next.size(), " bytes, its base ", base.size());
    return plan;
  }
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
  if (static_cast<double>(size) > options.max_patch_fraction * static_cast<double>(n)) {
    plan.full = true;
    plan.why = absl::StrCat("a patch would be ", size, " bytes, over ", options.max_patch_fraction,
                            " of the bucket's ", n);
    plan.patch.clear();
    return plan;
  }
  plan.runs = static_cast<uint32_t>(runs.size());
  plan.patch.assign(size, 0);
  std::memcpy(plan.patch.data(), kMagic, 4);
  Put<uint32_t>(&plan.patch, 4, kFormat);
  Put<uint64_t>(&plan.patch, 8, n);
  Put<uint64_t>(&plan.patch, 16, base_checksum);
  Put<uint64_t>(&plan.patch, 24, next_checksum);
  Put<uint32_t>(&plan.patch, 32, plan.runs);
  Put<uint64_t>(&plan.patch, 40, plan.changed_words);
  size_t at = kBucketPatchHeaderBytes;
  for (const Run& r : runs) {
    Put<uint32_t>(&plan.patch, at, static_cast<uint32_t>(r.first));
    Put<uint32_t>(&plan.patch, at + 4, static_cast<uint32_t>(r.words));
    at += kRunHeaderBytes;
    const uint64_t bytes = std::min(r.words * kWord, n - r.first * kWord);
    std::memcpy(plan.patch.data() + at, next.data() + r.first * kWord, bytes);
    at += bytes;
  }
  return plan;
}

absl::StatusOr<std::vector<uint8_t>> ApplyBucketPatch(absl::Span<const uint8_t> patch,
                                                      absl::Span<const uint8_t> base,
                                                      const ApplyPatchOptions& options) {
  if (patch.size() < kBucketPatchHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: ", patch.size(), " bytes, shorter than its header"));
  }
  const uint8_t* p = patch.data();
  if (std::memcmp(p, kMagic, 4) != 0) {
    return absl::InvalidArgumentError("bucket patch: not a patch (magic)");
  }
  if (Get<uint32_t>(p + 4) != kFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: format ", Get<uint32_t>(p + 4), ", not ", kFormat));
  }
  const uint64_t n = Get<uint64_t>(p + 8);
  const uint64_t base_checksum = Get<uint64_t>(p + 16);
  const uint64_t target_checksum = Get<uint64_t>(p + 24);
  const uint32_t runs = Get<uint32_t>(p + 32);
  if (base.size() != n) {
    return absl::FailedPreconditionError(absl::StrCat("bucket patch: for a base of ", n,
                                                      " bytes, the receiver holds ", base.size()));
  }
  if (transport::ParallelChecksum(base.data(), base.size(), options.threads) != base_checksum) {
    return absl::FailedPreconditionError(
        "bucket patch: the receiver's bucket is not the patch's base (checksum)");
  }
  const uint64_t words = (n + kWord - 1) / kWord;
  std::vector<uint8_t> out(n);
  constexpr uint64_t kCopySlice = uint64_t{16} << 20;
  ParallelFor(static_cast<size_t>((n + kCopySlice - 1) / kCopySlice), options.threads,
              [&](size_t s) {
                const uint64_t at = s * kCopySlice;
                std::memcpy(out.data() + at, base.data() + at, std::min(kCopySlice, n - at));
              });
  size_t at = kBucketPatchHeaderBytes;
  uint64_t next_free = 0;  // the first word a run may start at
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
    std::memcpy(out.data() + first * kWord, p + at, bytes);
    at += bytes;
    next_free = first + count + 1;  // runs never touch: adjacent ones would be one
  }
  if (at != patch.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket patch: ", patch.size() - at, " bytes after its last run"));
  }
  if (transport::ParallelChecksum(out.data(), out.size(), options.threads) != target_checksum) {
    return absl::DataLossError(
        "bucket patch: the patched bucket does not have the target's checksum");
  }
  if (options.checksum != nullptr) *options.checksum = target_checksum;
  return out;
}

}  // namespace wpub::delta
