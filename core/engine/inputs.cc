// Host ingestion: tensor input validation, shm mappings, inline buffers (see inputs.h).
#include "core/engine/inputs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/common/status.h"

namespace wpub::engine {
namespace {

constexpr size_t kMaxParts = 4096;
constexpr int kMaxRank = 8;

bool KnownDType(DType dtype) {
  return static_cast<uint8_t>(dtype) <= static_cast<uint8_t>(DType::kBool);
}

// numel * element size, or an error when it overflows.
absl::StatusOr<uint64_t> ByteSize(const Shape& shape, DType dtype, absl::string_view what) {
  uint64_t n = static_cast<uint64_t>(DTypeSize(dtype));
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension in shape ", ShapeString(shape)));
    }
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 2 / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeString(shape), " is too large"));
    }
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

// MemAvailable of /proc/meminfo in bytes, or -1 when it cannot be read.
int64_t AvailableHostMemory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

}  // namespace

absl::Status ValidateShmName(absl::string_view name, absl::string_view tensor) {
  absl::string_view bare = name;
  if (!bare.empty() && bare.front() == '/') bare.remove_prefix(1);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", tensor, ": invalid shared-memory segment name '", name, "': ", why));
  };
  if (bare.empty()) return bad("empty");
  if (name.size() > 255) return bad("longer than 255 bytes");
  if (absl::StrContains(bare, "/")) return bad("contains '/'");
  if (absl::StrContains(bare, "..")) return bad("contains '..'");
  if (bare.find('\0') != absl::string_view::npos) return bad("contains NUL");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<HostBuffer> HostBuffer::Allocate(uint64_t bytes, absl::string_view tensor) {
  // A zero-byte part still gets a page, so its view is never null.
  void* p = mmap(nullptr, std::max<uint64_t>(bytes, 1), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(
        absl::StrCat("tensor ", tensor, ": cannot reserve ", bytes,
                     " bytes of host memory: ", std::strerror(err)));
  }
  return HostBuffer(static_cast<uint8_t*>(p), bytes);
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, std::max<uint64_t>(size_, 1));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (data_ != nullptr) munmap(data_, std::max<uint64_t>(size_, 1));
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(absl::string_view name,
                                                             absl::string_view tensor) {
  WPUB_RETURN_IF_ERROR(ValidateShmName(name, tensor));
  const std::string path = name.front() == '/' ? std::string(name) : absl::StrCat("/", name);
  const int fd = shm_open(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("tensor ", tensor, ": shared-memory segment '", name,
                                         "': ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("tensor ", tensor, ": fstat of segment '", name, "': ", std::strerror(err)));
  }
  return std::unique_ptr<ShmSegment>(
      new ShmSegment(fd, static_cast<uint64_t>(st.st_size), std::string(name)));
}

ShmSegment::~ShmSegment() { close(fd_); }

absl::Status ShmSegment::ReadAt(uint64_t offset, absl::Span<uint8_t> dst,
                                absl::string_view tensor) const {
  uint64_t done = 0;
  while (done < dst.size()) {
    // pread takes at most 2 GiB - 4 KiB per call on Linux.
    const size_t want = static_cast<size_t>(std::min<uint64_t>(dst.size() - done, 1u << 30));
    const ssize_t n = pread(fd_, dst.data() + done, want, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return absl::InternalError(absl::StrCat("tensor ", tensor,
                                              ": reading shared-memory segment '", name_,
                                              "': ", std::strerror(err)));
    }
    if (n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor, ": shared-memory segment '", name_, "' ends at byte ",
                       offset + done, " while [", offset, ", +", dst.size(),
                       ") was being read (it was truncated after it was named)"));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

void IntervalSet::Add(uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  auto it = ranges_.upper_bound(begin);
  if (it != ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= begin) {  // overlaps or touches the previous range
      begin = prev->first;
      end = std::max(end, prev->second);
      it = ranges_.erase(prev);
    }
  }
  while (it != ranges_.end() && it->first <= end) {
    end = std::max(end, it->second);
    it = ranges_.erase(it);
  }
  ranges_.emplace(begin, end);
}

bool IntervalSet::Covers(uint64_t size) const { return FirstGap(size) == size; }

uint64_t IntervalSet::FirstGap(uint64_t size) const {
  if (size == 0) return 0;
  if (ranges_.empty() || ranges_.begin()->first != 0) return 0;
  return std::min(size, ranges_.begin()->second);
}

// ---------------------------------------------------------------------------------------------

absl::Status ValidateTensorInput(const TensorInput& input, bool cuda_ipc) {
  const TensorDesc& desc = input.desc;
  if (desc.name.empty()) return absl::InvalidArgumentError("tensor with an empty name");
  const std::string what = absl::StrCat("tensor ", desc.name);
  if (!KnownDType(desc.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unknown dtype (enum value ", static_cast<int>(desc.dtype), ")"));
  }
  if (desc.shape.size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", desc.shape.size(), " exceeds ", kMaxRank));
  }
  WPUB_RETURN_IF_ERROR(ByteSize(desc.shape, desc.dtype, what).status());
  if (input.parts.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": no parts"));
  if (input.parts.size() > kMaxParts) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", input.parts.size(), " parts exceed ", kMaxParts));
  }
  if (input.concat_dim != 0 && input.concat_dim != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": concat_dim ", input.concat_dim, " must be 0 or 1"));
  }
  const int rank = static_cast<int>(desc.shape.size());
  if (input.parts.size() > 1 && input.concat_dim >= rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": concat_dim ", input.concat_dim, " is out of range for rank ", rank));
  }
  int64_t concat_total = 0;
  for (size_t i = 0; i < input.parts.size(); ++i) {
    const TensorPart& part = input.parts[i];
    const std::string pwhat = absl::StrCat(what, " part ", i);
    if (part.shape.size() != desc.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(pwhat, ": shape ", ShapeString(part.shape),
                                                     " does not match the tensor's rank (",
                                                     ShapeString(desc.shape), ")"));
    }
    WPUB_ASSIGN_OR_RETURN(const uint64_t nbytes, ByteSize(part.shape, desc.dtype, pwhat));
    for (int d = 0; d < rank; ++d) {
      const bool along = input.parts.size() > 1 && d == input.concat_dim;
      if (!along && part.shape[d] != desc.shape[d]) {
        return absl::InvalidArgumentError(absl::StrCat(pwhat, ": shape ", ShapeString(part.shape),
                                                       " is inconsistent with the tensor shape ",
                                                       ShapeString(desc.shape), " (dim ", d, ")"));
      }
    }
    if (input.parts.size() > 1) concat_total += part.shape[input.concat_dim];
    if (const auto* shm = std::get_if<ShmSource>(&part.source)) {
      WPUB_RETURN_IF_ERROR(ValidateShmName(shm->name, desc.name));
      if (shm->length != nbytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            pwhat, ": shared-memory length ", shm->length, " does not match its shape ",
            ShapeString(part.shape), " x ", DTypeName(desc.dtype), " = ", nbytes, " bytes"));
      }
    } else if (const auto* ipc = std::get_if<CudaIpcSource>(&part.source)) {
      if (!cuda_ipc) {
        return absl::UnimplementedError(
            absl::StrCat("CUDA IPC ingestion needs the GPU backend; tensor ", desc.name));
      }
      if (ipc->length != nbytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            pwhat, ": CUDA IPC length ", ipc->length, " does not match its shape ",
            ShapeString(part.shape), " x ", DTypeName(desc.dtype), " = ", nbytes, " bytes"));
      }
    }
  }
  if (input.parts.size() > 1 && concat_total != desc.shape[input.concat_dim]) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": parts sum to ", concat_total, " along dim ", input.concat_dim,
                     ", shape ", ShapeString(desc.shape), " needs ", desc.shape[input.concat_dim]));
  }
  return absl::OkStatus();
}

absl::Status InputStore::AddBatch(uint64_t batch, absl::Span<const TensorInput> tensors) {
  if (batch != batch_first_.size()) {
    return absl::InternalError(absl::StrCat("batch ", batch, " added out of order"));
  }
  // Validate everything first so a failure leaves the store unchanged.
  uint64_t new_inline = 0;
  // Read once per batch, and only for a batch with host bytes: a GPU-path publication of CUDA
  // IPC parts (tens of thousands of batches) never reads /proc/meminfo.
  std::optional<int64_t> available;
  const uint64_t pending =
      inline_declared_ > inline_received_ ? inline_declared_ - inline_received_ : 0;
  std::unordered_map<std::string, size_t> in_batch;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInput& t = tensors[i];
    WPUB_RETURN_IF_ERROR(ValidateTensorInput(t, resolve_ipc_ != nullptr));
    if (auto it = names_.find(t.desc.name); it != names_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name ", t.desc.name,
                                                     " (batch ", batch, ", first in batch ",
                                                     it->second, ")"));
    }
    if (!in_batch.emplace(t.desc.name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate tensor name ", t.desc.name, " within batch ", batch));
    }
    for (const TensorPart& p : t.parts) {
      if (!std::holds_alternative<CudaIpcSource>(p.source)) {
        new_inline += static_cast<uint64_t>(NumElements(p.shape) * DTypeSize(t.desc.dtype));
      }
    }
    // A declaration the host cannot hold fails here, naming the tensor, instead of as the
    // bytes arrive (the kernel's OOM killer) or as an allocation failure. Bytes already
    // received are in `available`'s complement; those still to come are not.
    if (new_inline > 0 && !available) available = AvailableHostMemory();
    if (available && *available >= 0 && pending + new_inline > static_cast<uint64_t>(*available)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tensor ", t.desc.name, ": batch ", batch, " declares ", new_inline,
                       " bytes of host staging (", pending, " more still to arrive); the host has ",
                       *available, " bytes available"));
    }
  }
  if (inline_bytes_ + new_inline > max_inline_bytes_) {
    return absl::OutOfRangeError(
        absl::StrCat("batch ", batch, " needs ", new_inline,
                     " inline bytes (inline and shared-memory parts); the publication's limit is ",
                     max_inline_bytes_, " (", inline_bytes_, " already used)"));
  }
  // Open shm segments (kept even when a later check fails: they are reused by name) and copy
  // their ranges.
  std::vector<HostBuffer> copies;
  uint64_t copied = 0;
  std::vector<InputTensor> resolved;
  std::vector<std::vector<std::unique_ptr<InlineBuffer>>> buffers;
  resolved.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInput& t = tensors[i];
    InputTensor in;
    in.desc = t.desc;
    in.concat_dim = t.parts.size() > 1 ? t.concat_dim : 0;
    in.batch = batch;
    in.index_in_batch = static_cast<uint32_t>(i);
    std::vector<std::unique_ptr<InlineBuffer>> bufs(t.parts.size());
    for (size_t j = 0; j < t.parts.size(); ++j) {
      const TensorPart& p = t.parts[j];
      PartView view;
      view.shape = p.shape;
      view.nbytes = static_cast<uint64_t>(NumElements(p.shape) * DTypeSize(t.desc.dtype));
      if (const auto* shm = std::get_if<ShmSource>(&p.source)) {
        const std::string key(absl::StripPrefix(shm->name, "/"));
        auto it = shm_.find(key);
        if (it == shm_.end()) {
          WPUB_ASSIGN_OR_RETURN(auto segment, ShmSegment::Open(shm->name, t.desc.name));
          it = shm_.emplace(key, std::move(segment)).first;
        }
        const uint64_t size = it->second->size();
        if (shm->offset > size || shm->length > size - shm->offset) {
          return absl::OutOfRangeError(absl::StrCat(
              "tensor ", t.desc.name, " part ", j, ": range [", shm->offset, ", +", shm->length,
              ") exceeds shared-memory segment '", shm->name, "' of ", size, " bytes"));
        }
        WPUB_ASSIGN_OR_RETURN(HostBuffer copy, HostBuffer::Allocate(view.nbytes, t.desc.name));
        WPUB_RETURN_IF_ERROR(
            it->second->ReadAt(shm->offset, absl::MakeSpan(copy.data(), view.nbytes), t.desc.name));
        view.data = copy.data();
        view.memory = PartMemory::kHost;
        copied += view.nbytes;
        copies.push_back(std::move(copy));
      } else if (const auto* ipc = std::get_if<CudaIpcSource>(&p.source)) {
        WPUB_ASSIGN_OR_RETURN(view.data, resolve_ipc_(*ipc, view.nbytes, t.desc.name));
        view.memory = PartMemory::kDevice;
      } else {  // inline
        auto buf = std::make_unique<InlineBuffer>();
        WPUB_ASSIGN_OR_RETURN(buf->bytes, HostBuffer::Allocate(view.nbytes, t.desc.name));
        view.data = buf->bytes.data();
        view.memory = PartMemory::kHost;
        bufs[j] = std::move(buf);
      }
      in.parts.push_back(std::move(view));
    }
    resolved.push_back(std::move(in));
    buffers.push_back(std::move(bufs));
  }
  batch_first_.push_back(tensors_.size());
  for (size_t i = 0; i < resolved.size(); ++i) {
    names_.emplace(resolved[i].desc.name, batch);
    bytes_in_ += static_cast<uint64_t>(resolved[i].desc.nbytes());
    tensors_.push_back(std::move(resolved[i]));
    inline_.push_back(std::move(buffers[i]));
  }
  for (HostBuffer& c : copies) shm_copies_.push_back(std::move(c));
  inline_bytes_ += new_inline;
  inline_declared_ += new_inline - copied;
  return absl::OkStatus();
}

absl::Status InputStore::AppendInline(uint64_t batch, uint32_t tensor, uint32_t part,
                                      uint64_t offset, absl::Span<const uint8_t> bytes) {
  if (batch >= batch_first_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("inline chunk for unknown batch ", batch, " (",
                                                   batch_first_.size(), " batches added)"));
  }
  const size_t end = batch + 1 < batch_first_.size() ? batch_first_[batch + 1] : tensors_.size();
  if (batch_first_[batch] + tensor >= end) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline chunk for unknown tensor ", tensor, " of batch ", batch));
  }
  const size_t flat = batch_first_[batch] + tensor;
  const std::string& name = tensors_[flat].desc.name;
  if (part >= inline_[flat].size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": inline chunk for unknown part ", part));
  }
  InlineBuffer* buf = inline_[flat][part].get();
  if (buf == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " part ", part, " is not an inline part"));
  }
  const uint64_t size = buf->bytes.size();
  if (offset > size || bytes.size() > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " part ", part, ": chunk overflow: [", offset, ", ", offset,
                     " + ", bytes.size(), ") exceeds the part's ", size, " bytes"));
  }
  if (!bytes.empty()) std::memcpy(buf->bytes.data() + offset, bytes.data(), bytes.size());
  inline_received_ += bytes.size();
  buf->written.Add(offset, offset + bytes.size());
  return absl::OkStatus();
}

absl::Status InputStore::CheckComplete() const {
  for (size_t t = 0; t < inline_.size(); ++t) {
    for (size_t p = 0; p < inline_[t].size(); ++p) {
      const InlineBuffer* buf = inline_[t][p].get();
      if (buf == nullptr) continue;
      const uint64_t size = buf->bytes.size();
      const uint64_t gap = buf->written.FirstGap(size);
      if (gap != size) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", tensors_[t].desc.name, " part ",
                                                       p, ": inline bytes missing from offset ",
                                                       gap, " (", size, " expected)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace wpub::engine
