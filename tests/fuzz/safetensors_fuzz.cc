// Fuzz target `safetensors`: a safetensors file as a checkpoint directory holds it, opened with
// safetensors::Reader (mmap, header validation). The input is the whole file; it lives in a
// memfd opened by its /proc path, so nothing touches the disk. Properties of an accepted file:
// every tensor's span lies inside the file and has dtype x shape bytes, Find returns it, and
// writing the same tensors and metadata with safetensors::Writer and reading that back gives
// the same names, dtypes, shapes, bytes and metadata. And `wpubctl inspect` / `diff` of it
// (core/inspect): the snapshot opens, its report and JSON are produced (NVFP4-looking modules of
// any shape, empty stacks, scales of the wrong size), the digest is deterministic, the file
// diffs identical against itself, and against a copy with the first and last byte of every
// tensor flipped every non-empty tensor differs (dequantized where it is an NVFP4 weight) with
// a count of differing elements within the tensor's and no NaN difference.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/inspect/inspect.h"
#include "core/safetensors/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using wpub::safetensors::Reader;
using wpub::safetensors::TensorInfo;

// A memory-backed file, closed on destruction.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(memfd_create(name, MFD_CLOEXEC)) {
    FUZZ_CHECK(fd_ >= 0, "memfd_create failed");
  }
  ~MemFile() { ::close(fd_); }
  std::string path() const { return absl::StrCat("/proc/self/fd/", fd_); }
  void Fill(const uint8_t* data, size_t size) {
    FUZZ_CHECK(ftruncate(fd_, 0) == 0, "ftruncate failed");
    size_t off = 0;
    while (off < size) {
      const ssize_t n = pwrite(fd_, data + off, size - off, static_cast<off_t>(off));
      FUZZ_CHECK(n > 0, "pwrite failed");
      off += static_cast<size_t>(n);
    }
  }

 private:
  int fd_;
};

void CheckConsistent(const Reader& r) {
  uint64_t covered = 0;
  for (const TensorInfo& t : r.tensors()) {
    const absl::Span<const uint8_t> data = r.Data(t);
    FUZZ_CHECK(data.size() == t.nbytes(), t.name);
    FUZZ_CHECK(t.end <= r.file_size(), t.name);
    const std::optional<int64_t> elem = wpub::safetensors::DTypeSizeOf(t.dtype);
    FUZZ_CHECK(elem.has_value(), t.dtype);
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, absl::StrCat(t.name, ": negative dim ", d));
      numel *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(numel * static_cast<uint64_t>(*elem) == t.nbytes(), t.name);
    FUZZ_CHECK(r.Find(t.name) == &t, t.name);
    // Touch the first and last byte: the span must be mapped.
    if (!data.empty()) covered += data.front() + data.back();
    r.Prefetch(t);
  }
  (void)covered;
}

// Writer -> Reader round trip of an accepted file.
void CheckRoundTrip(const Reader& r) {
  std::vector<wpub::safetensors::OutputTensor> out;
  for (const TensorInfo& t : r.tensors()) out.push_back({t.name, t.dtype, t.shape});
  MemFile copy("wpub-fuzz-safetensors-copy");
  absl::StatusOr<std::unique_ptr<wpub::safetensors::Writer>> w =
      wpub::safetensors::Writer::Create(copy.path(), out, r.metadata());
  if (!w.ok()) return;  // e.g. an empty tensor name, which the reader accepts and the writer not
  for (size_t i = 0; i < r.tensors().size(); ++i) {
    absl::Status s = (*w)->Write(i, 0, r.Data(r.tensors()[i]));
    FUZZ_CHECK(s.ok(), s.ToString());
  }
  absl::Status s = (*w)->Finish();
  FUZZ_CHECK(s.ok(), s.ToString());
  absl::StatusOr<std::unique_ptr<Reader>> back = Reader::Open(copy.path());
  FUZZ_CHECK(back.ok(), back.status().ToString());
  FUZZ_CHECK((*back)->metadata() == r.metadata(), "metadata differs");
  FUZZ_CHECK((*back)->tensors().size() == r.tensors().size(), "tensor count differs");
  for (const TensorInfo& t : r.tensors()) {
    const TensorInfo* b = (*back)->Find(t.name);
    FUZZ_CHECK(b != nullptr, t.name);
    FUZZ_CHECK(b->dtype == t.dtype && b->shape == t.shape, t.name);
    const absl::Span<const uint8_t> x = r.Data(t), y = (*back)->Data(*b);
    FUZZ_CHECK(std::equal(x.begin(), x.end(), y.begin(), y.end()), t.name);
  }
}

void CheckInspect(const Reader& r, const std::string& path) {
  using namespace wpub::inspect;  // NOLINT: a test's local scope
  absl::StatusOr<std::unique_ptr<Snapshot>> s = Snapshot::Open(path);
  FUZZ_CHECK(s.ok(), s.status().ToString());
  const Inventory a = Inspect(**s, 1);
  const Inventory b = Inspect(**s, 1);
  FUZZ_CHECK(a.tensors.size() == r.tensors().size(), "inspect lost tensors");
  FUZZ_CHECK(a.digest == b.digest, "digest not deterministic");
  FUZZ_CHECK(!FormatInventory(a, true).empty(), "empty report");
  FUZZ_CHECK(!InventoryJson(a).empty(), "empty JSON");
  const DiffReport self = Diff(**s, **s, 1);
  FUZZ_CHECK(self.identical(), "a file differs from itself");
  FUZZ_CHECK(self.digest_a == a.digest, "diff digest differs from inspect's");

  // The flipped copy.
  std::vector<wpub::safetensors::OutputTensor> out;
  for (const TensorInfo& t : r.tensors()) out.push_back({t.name, t.dtype, t.shape});
  MemFile copy("wpub-fuzz-safetensors-flipped");
  auto w = wpub::safetensors::Writer::Create(copy.path(), out, r.metadata());
  if (!w.ok()) return;  // names the writer refuses (CheckRoundTrip says which)
  for (size_t i = 0; i < r.tensors().size(); ++i) {
    const absl::Span<const uint8_t> data = r.Data(r.tensors()[i]);
    std::vector<uint8_t> flipped(data.begin(), data.end());
    if (!flipped.empty()) flipped.front() ^= 0xFF;
    if (flipped.size() > 1) flipped.back() ^= 0xFF;
    FUZZ_CHECK((*w)->Write(i, 0, flipped).ok(), "write");
  }
  FUZZ_CHECK((*w)->Finish().ok(), "finish");
  absl::StatusOr<std::unique_ptr<Snapshot>> f = Snapshot::Open(copy.path());
  FUZZ_CHECK(f.ok(), f.status().ToString());
  const DiffReport d = Diff(**s, **f, 1);
  FUZZ_CHECK(d.tensors.size() == r.tensors().size(), "diff lost tensors");
  FUZZ_CHECK(d.config_changes.empty(), "same metadata reported as changed");
  for (const TensorDiff& t : d.tensors) {
    const TensorInfo* info = r.Find(t.name);
    FUZZ_CHECK(info != nullptr, t.name);
    if (info->nbytes() == 0) {
      FUZZ_CHECK(t.change == Change::kIdentical || t.change == Change::kChangedScales, t.name);
      continue;
    }
    FUZZ_CHECK(t.change == Change::kChangedBytes, absl::StrCat(t.name, ": ", ChangeName(t.change)));
    FUZZ_CHECK(t.differing_elements >= 1 && t.differing_elements <= t.elements, t.name);
    FUZZ_CHECK(!t.max_abs_diff.has_value() || !std::isnan(*t.max_abs_diff), t.name);
  }
  FUZZ_CHECK(!FormatDiff(d, -1).empty() && !DiffJson(d).empty(), "empty diff report");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  MemFile file("wpub-fuzz-safetensors");
  file.Fill(data, size);
  absl::StatusOr<std::unique_ptr<Reader>> r = Reader::Open(file.path());
  if (!r.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(r.status()), r.status().ToString());
    return 0;
  }
  CheckConsistent(**r);
  CheckRoundTrip(**r);
  CheckInspect(**r, file.path());
  return 0;
}
