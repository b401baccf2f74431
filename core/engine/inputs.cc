// Host ingestion: tensor input validation, shm mappings, inline buffers (see inputs.h).
#include "core/engine/inputs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

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

absl::StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Open(absl::string_view name,
                                                             absl::string_view tensor) {
  WPUB_RETURN_IF_ERROR(ValidateShmName(name, tensor));
  const std::string path = name.front() == '/' ? std::string(name) : absl::StrCat("/", name);
  const int fd = shm_open(path.c_str(), O_RDONLY, 0);
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
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    close(fd);
    return std::unique_ptr<ShmMapping>(new ShmMapping(nullptr, 0));
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the segment alive
  if (p == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("tensor ", tensor, ": mmap of segment '", name, "' (",
                                            size, " bytes): ", std::strerror(err)));
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(static_cast<const uint8_t*>(p), size));
}

ShmMapping::~ShmMapping() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
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
      if (std::holds_alternative<InlineSource>(p.source)) {
        new_inline += static_cast<uint64_t>(NumElements(p.shape) * DTypeSize(t.desc.dtype));
      }
    }
  }
  if (inline_bytes_ + new_inline > max_inline_bytes_) {
    return absl::OutOfRangeError(absl::StrCat(
        "batch ", batch, " needs ", new_inline, " inline bytes; the publication's limit is ",
        max_inline_bytes_, " (", inline_bytes_, " already used)"));
  }
  // Map shm segments (kept even when a later check fails: they are reused by name).
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
          WPUB_ASSIGN_OR_RETURN(auto mapping, ShmMapping::Open(shm->name, t.desc.name));
          it = shm_.emplace(key, std::move(mapping)).first;
        }
        const uint64_t size = it->second->size();
        if (shm->offset > size || shm->length > size - shm->offset) {
          return absl::OutOfRangeError(absl::StrCat(
              "tensor ", t.desc.name, " part ", j, ": range [", shm->offset, ", +", shm->length,
              ") exceeds shared-memory segment '", shm->name, "' of ", size, " bytes"));
        }
        view.data = it->second->data() + shm->offset;
        view.memory = PartMemory::kHost;
      } else if (const auto* ipc = std::get_if<CudaIpcSource>(&p.source)) {
        WPUB_ASSIGN_OR_RETURN(view.data, resolve_ipc_(*ipc, view.nbytes, t.desc.name));
        view.memory = PartMemory::kDevice;
      } else {  // inline
        auto buf = std::make_unique<InlineBuffer>();
        buf->size = view.nbytes;
        buf->bytes.reset(new uint8_t[std::max<uint64_t>(view.nbytes, 1)]);
        view.data = buf->bytes.get();
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
  inline_bytes_ += new_inline;
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
  if (offset > buf->size || bytes.size() > buf->size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " part ", part, ": chunk overflow: [", offset, ", ", offset,
                     " + ", bytes.size(), ") exceeds the part's ", buf->size, " bytes"));
  }
  if (!bytes.empty()) std::memcpy(buf->bytes.get() + offset, bytes.data(), bytes.size());
  buf->written.Add(offset, offset + bytes.size());
  return absl::OkStatus();
}

absl::Status InputStore::CheckComplete() const {
  for (size_t t = 0; t < inline_.size(); ++t) {
    for (size_t p = 0; p < inline_[t].size(); ++p) {
      const InlineBuffer* buf = inline_[t][p].get();
      if (buf == nullptr) continue;
      const uint64_t gap = buf->written.FirstGap(buf->size);
      if (gap != buf->size) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", tensors_[t].desc.name, " part ",
                                                       p, ": inline bytes missing from offset ",
                                                       gap, " (", buf->size, " expected)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace wpub::engine
