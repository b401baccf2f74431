// wpub-recv's whole-file safetensors helpers, on top of core/safetensors (the one place the
// format is implemented): an atomic writer and a reader that validates and copies a file.
#include "clients/recv/safetensors.h"

#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"

namespace wpub::recv {

absl::string_view SafetensorsDTypeName(DType dtype) { return safetensors::DTypeName(dtype); }

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
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
  // Written next to `path` and renamed over it, so a reader never sees a partial file.
  const std::string tmp = absl::StrCat(path, ".tmp");
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Writer> writer,
                        safetensors::Writer::Create(tmp, std::move(tensors), metadata));
  absl::Status status;
  for (size_t i = 0; i < entries.size() && status.ok(); ++i) {
    status = writer->Write(i, 0, entries[i].bytes);
  }
  if (status.ok()) status = writer->Finish();
  writer.reset();
  if (status.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(absl::StrCat("safetensors: cannot rename ", tmp, " to ", path));
  }
  if (!status.ok()) std::remove(tmp.c_str());
  return status;
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
