// The memory-mapped safetensors reader: header parsing and the complete validation of a file.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/safetensors/safetensors.h"

namespace wpub::safetensors {
namespace {

struct DTypeRow {
  absl::string_view name;
  int64_t size;
  std::optional<DType> wpub;
};

// Every byte-addressable dtype of the format.
const DTypeRow kDTypes[] = {
    {"BOOL", 1, DType::kBool},          {"U8", 1, DType::kUInt8},     {"I8", 1, DType::kInt8},
    {"F8_E4M3", 1, DType::kFloat8E4M3}, {"F8_E5M2", 1, std::nullopt}, {"F8_E8M0", 1, std::nullopt},
    {"I16", 2, std::nullopt},           {"U16", 2, std::nullopt},     {"F16", 2, DType::kFloat16},
    {"BF16", 2, DType::kBFloat16},      {"I32", 4, DType::kInt32},    {"U32", 4, std::nullopt},
    {"F32", 4, DType::kFloat32},        {"I64", 8, DType::kInt64},    {"U64", 8, std::nullopt},
    {"F64", 8, DType::kFloat64},
};

const DTypeRow* FindDType(absl::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}
absl::Status BadTensor(const std::string& path, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", tensor, "': ", what));
}

bool ReadU64(const nlohmann::json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

}  // namespace

absl::string_view DTypeName(DType dtype) {
  for (const DTypeRow& r : kDTypes) {
    if (r.wpub == dtype) return r.name;
  }
  return "UNKNOWN";
}

std::optional<int64_t> DTypeSizeOf(absl::string_view name) {
  const DTypeRow* r = FindDType(name);
  if (r == nullptr) return std::nullopt;
  return r->size;
}

Reader::~Reader() {
  if (map_ != nullptr) munmap(const_cast<uint8_t*>(map_), file_size_);
}

absl::StatusOr<std::unique_ptr<Reader>> Reader::Open(const std::string& path) {
  std::unique_ptr<Reader> r(new Reader());
  r->path_ = path;
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; it is
  // refused below, as is everything but a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat(path, ": cannot open: ", why));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file (",
                                                   S_ISFIFO(st.st_mode)  ? "a FIFO"
                                                   : S_ISDIR(st.st_mode) ? "a directory"
                                                   : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)
                                                       ? "a device"
                                                   : S_ISSOCK(st.st_mode) ? "a socket"
                                                                          : "not a file",
                                                   ")"));
  }
  r->file_size_ = static_cast<uint64_t>(st.st_size);
  if (r->file_size_ < 8) {
    ::close(fd);
    return Bad(path, absl::StrCat("truncated header: the file has ", r->file_size_,
                                  " bytes, fewer than the 8-byte header length"));
  }
  void* m = mmap(nullptr, r->file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file referenced
  if (m == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": cannot mmap: ", std::strerror(errno)));
  }
  r->map_ = static_cast<const uint8_t*>(m);

  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t{r->map_[i]} << (8 * i);
  if (header_len > kMaxHeaderBytes) {
    return Bad(path, absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes,
                                  "-byte limit"));
  }
  if (header_len > r->file_size_ - 8) {
    return Bad(path, absl::StrCat("header length ", header_len, " goes beyond the file (",
                                  r->file_size_, " bytes; the file is truncated)"));
  }
  r->data_start_ = 8 + header_len;
  const uint64_t data_size = r->file_size_ - r->data_start_;
  const char* text = reinterpret_cast<const char*>(r->map_ + 8);
  nlohmann::json header = nlohmann::json::parse(text, text + header_len, nullptr,
                                                /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return Bad(path, "truncated or malformed header: not valid JSON");
  }
  if (!header.is_object()) return Bad(path, "header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad(path, "__metadata__ is not an object");
      for (auto m2 = v.begin(); m2 != v.end(); ++m2) {
        if (!m2.value().is_string()) {
          return Bad(path, absl::StrCat("__metadata__ value of '", m2.key(), "' is not a string"));
        }
        r->metadata_[m2.key()] = m2.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return BadTensor(path, name, "entry is not an object");
    TensorInfo info;
    info.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) return BadTensor(path, name, "missing string dtype");
    info.dtype = dt->get<std::string>();
    const DTypeRow* row = FindDType(info.dtype);
    if (row == nullptr)
      return BadTensor(path, name, absl::StrCat("unknown dtype '", info.dtype, "'"));
    info.wpub_dtype = row->wpub;
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) return BadTensor(path, name, "missing shape array");
    // Overflow-checked element count: a crafted shape must not wrap around.
    unsigned __int128 numel = 1;
    for (const nlohmann::json& d : *sh) {
      uint64_t dim = 0;
      if (!ReadU64(d, &dim))
        return BadTensor(path, name, "shape has a negative or non-integer dim");
      // Shape holds int64 dims; a larger one (possible beside a 0 dim, where numel stays 0)
      // would turn negative.
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return BadTensor(path, name, absl::StrCat("shape dim ", dim, " is too large"));
      }
      info.shape.push_back(static_cast<int64_t>(dim));
      numel *= dim;
      if (numel > std::numeric_limits<uint64_t>::max() / 16) {
        return BadTensor(path, name, "shape is too large");
      }
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 ||
        !ReadU64((*off)[0], &info.begin) || !ReadU64((*off)[1], &info.end)) {
      return BadTensor(path, name, "data_offsets must be two non-negative integers");
    }
    if (info.end < info.begin) {
      return BadTensor(
          path, name, absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] are reversed"));
    }
    if (info.end > data_size) {
      return BadTensor(
          path, name,
          absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                       "] are out of bounds (data section has ", data_size, " bytes)"));
    }
    const uint64_t expected = static_cast<uint64_t>(numel) * static_cast<uint64_t>(row->size);
    if (info.nbytes() != expected) {
      return BadTensor(path, name,
                       absl::StrCat(info.nbytes(), " bytes at data_offsets for ", info.dtype, " ",
                                    ShapeString(info.shape), " (", expected, " expected)"));
    }
    r->tensors_.push_back(std::move(info));
  }
  std::sort(r->tensors_.begin(), r->tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  for (size_t i = 0; i < r->tensors_.size(); ++i) {
    const TensorInfo& t = r->tensors_[i];
    if (t.begin < pos) {
      return BadTensor(path, t.name,
                       absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] overlap tensor '",
                                    r->tensors_[i - 1].name, "'"));
    }
    if (t.begin > pos) {
      return BadTensor(
          path, t.name,
          absl::StrCat("data_offsets start at ", t.begin, ", leaving a hole after ", pos));
    }
    pos = t.end;
    r->by_name_[t.name] = i;
  }
  if (pos != data_size) {
    return Bad(path, absl::StrCat("the tensors cover ", pos, " bytes of a ", data_size,
                                  "-byte data section (trailing bytes)"));
  }
  return r;
}

const TensorInfo* Reader::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::Span<const uint8_t> Reader::Data(const TensorInfo& info) const {
  return absl::Span<const uint8_t>(map_ + data_start_ + info.begin, info.nbytes());
}

void Reader::Prefetch(const TensorInfo& info) const {
  if (info.nbytes() == 0) return;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t begin = (data_start_ + info.begin) / page * page;
  const uint64_t end = data_start_ + info.end;
  madvise(const_cast<uint8_t*>(map_) + begin, end - begin, MADV_WILLNEED);
}

}  // namespace wpub::safetensors
