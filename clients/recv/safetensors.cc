// wpub-recv's whole-file safetensors helpers, on top of core/safetensors (the one place the
// format is implemented): an atomic writer and a reader that validates and copies a file.
#include "clients/recv/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"

namespace wpub::recv {
namespace {

// fsync(2) of `path` (a file or a directory) through a read-only descriptor.
absl::Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot open to sync: ", std::strerror(errno)));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat(path, ": fsync: ", std::strerror(err)));
  return absl::OkStatus();
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::string_view SafetensorsDTypeName(DType dtype) { return safetensors::DTypeName(dtype); }

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata) {
  // Written next to `path` and renamed over it, so a reader never sees a partial file.
  const std::string tmp = absl::StrCat(path, ".tmp");
  WPUB_RETURN_IF_ERROR(StageSafetensors(tmp, entries, metadata));
  absl::Status status = PublishStagedFile(tmp, path);
  if (!status.ok()) std::remove(tmp.c_str());
  return status;
}

absl::Status StageSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<safetensors::OutputTensor> tensors;
  tensors.reserve(entries.size());
  for (const SafetensorsEntry& e : entries) {
    if (static_cast<int64_t>(e.bytes.size()) != e.desc.nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors ", path, ": tensor ", e.desc.name, " has ", e.bytes.size(),
          " bytes, its dtype and shape ", ShapeString(e.desc.shape), " need ", e.desc.nbytes()));
    }
    tensors.push_back(
        {e.desc.name, std::string(safetensors::DTypeName(e.desc.dtype)), e.desc.shape});
  }
  // transformers loads a file only with format "pt" in its metadata (when it has metadata).
  std::map<std::string, std::string> with_format = metadata;
  with_format.emplace("format", "pt");
  absl::StatusOr<std::unique_ptr<safetensors::Writer>> writer =
      safetensors::Writer::Create(path, std::move(tensors), with_format);
  absl::Status status = writer.status();
  for (size_t i = 0; i < entries.size() && status.ok(); ++i) {
    status = (*writer)->Write(i, 0, entries[i].bytes);
  }
  if (status.ok()) status = (*writer)->Finish();
  if (writer.ok()) writer->reset();
  // Durable before anyone is told the version can be applied: a crash after the
  // acknowledgement must not leave an empty file to rename.
  if (status.ok()) status = SyncPath(path);
  if (!status.ok()) std::remove(path.c_str());
  return status;
}

absl::Status PublishStagedFile(const std::string& staged, const std::string& path) {
  if (std::rename(staged.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("safetensors: cannot rename ", staged, " to ", path,
                                            ": ", std::strerror(errno)));
  }
  return SyncPath(DirectoryOf(path));
}

absl::StatusOr<std::map<std::string, std::string>> ReadSafetensorsMetadata(
    const std::string& path) {
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Reader> reader,
                        safetensors::Reader::Open(path));
  return reader->metadata();
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Reader> reader,
                        safetensors::Reader::Open(path));
  SafetensorsFile file;
  file.metadata = reader->metadata();
  for (const safetensors::TensorInfo& info : reader->tensors()) {
    absl::Span<const uint8_t> data = reader->Data(info);
    file.tensors[info.name] =
        LoadedTensor{info.dtype, info.shape, std::vector<uint8_t>(data.begin(), data.end())};
    file.order.push_back(info.name);
  }
  return file;
}

}  // namespace wpub::recv
