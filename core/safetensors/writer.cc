// The safetensors writer: header laid out at Create, tensor bytes written with pwrite.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/safetensors/safetensors.h"

namespace wpub::safetensors {
namespace {

absl::Status PwriteAll(int fd, const uint8_t* p, uint64_t n, uint64_t offset,
                       const std::string& where) {
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, 1u << 30));
    const ssize_t w = ::pwrite(fd, p, step, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat(where, ": write failed: ", std::strerror(errno)));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<Writer>> Writer::Create(
    const std::string& path, std::vector<OutputTensor> tensors,
    const std::map<std::string, std::string>& metadata) {
  std::unique_ptr<Writer> w(new Writer());
  w->path_ = path;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const OutputTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    const std::optional<int64_t> size = DTypeSizeOf(t.dtype);
    if (!size) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "': unknown dtype '", t.dtype, "'"));
    }
    uint64_t n = static_cast<uint64_t>(*size);
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "': negative dim"));
      }
      n *= static_cast<uint64_t>(d);
    }
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    w->offsets_.push_back(offset);
    w->sizes_.push_back(n);
    offset += n;
  }
  w->tensors_ = std::move(tensors);
  w->written_ = std::make_unique<std::atomic<uint64_t>[]>(w->tensors_.size());
  for (size_t i = 0; i < w->tensors_.size(); ++i) w->written_[i] = 0;
  w->data_bytes_ = offset;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  w->data_start_ = 8 + text.size();

  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>(uint64_t{text.size()} >> (8 * i));
  head += text;
  if (absl::Status s =
          PwriteAll(w->fd_, reinterpret_cast<const uint8_t*>(head.data()), head.size(), 0, path);
      !s.ok()) {
    return s;
  }
  // Size the file now so pieces may land in any order and a short disk fails early.
  if (::ftruncate(w->fd_, static_cast<off_t>(w->file_size())) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot size to ", w->file_size(), " bytes: ", std::strerror(errno)));
  }
  return w;
}

absl::Status Writer::Write(size_t index, uint64_t offset, absl::Span<const uint8_t> bytes) {
  if (index >= tensors_.size() || offset > sizes_[index] || bytes.size() > sizes_[index] - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": write of ", bytes.size(), " bytes at ", offset, " outside tensor ",
        index < tensors_.size() ? absl::StrCat("'", tensors_[index].name, "'") : "(bad index)"));
  }
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": already finished"));
  absl::Status s =
      PwriteAll(fd_, bytes.data(), bytes.size(), data_start_ + offsets_[index] + offset,
                absl::StrCat(path_, " (tensor '", tensors_[index].name, "')"));
  if (s.ok()) written_[index] += bytes.size();
  return s;
}

absl::Status Writer::Finish() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (written_[i].load() != sizes_[i]) {
      return absl::FailedPreconditionError(absl::StrCat(path_, ": tensor '", tensors_[i].name,
                                                        "' has ", written_[i].load(), " of ",
                                                        sizes_[i], " bytes written"));
    }
  }
  if (fd_ >= 0) {
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) {
      return absl::InternalError(absl::StrCat(path_, ": close failed: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace wpub::safetensors
