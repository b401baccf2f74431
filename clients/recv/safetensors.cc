// safetensors writer and reader.
#include "clients/recv/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace wpub::recv {

absl::string_view SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
    case DType::kFloat32:
      return "F32";
    case DType::kUInt8:
      return "U8";
    case DType::kFloat8E4M3:
      return "F8_E4M3";
    case DType::kInt8:
      return "I8";
    case DType::kInt32:
      return "I32";
    case DType::kInt64:
      return "I64";
    case DType::kFloat64:
      return "F64";
    case DType::kBool:
      return "BOOL";
  }
  return "UNKNOWN";
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const SafetensorsEntry& e : entries) {
    if (static_cast<int64_t>(e.bytes.size()) != e.desc.nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", e.desc.name, "': ", e.bytes.size(), " bytes for ", DTypeName(e.desc.dtype),
          " ", ShapeString(e.desc.shape), " (", e.desc.nbytes(), " expected)"));
    }
    if (!names.insert(e.desc.name).second || e.desc.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", e.desc.name, "' repeats"));
    }
    header[e.desc.name] = {{"dtype", std::string(SafetensorsDTypeName(e.desc.dtype))},
                           {"shape", e.desc.shape},
                           {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InternalError(absl::StrCat("cannot create '", tmp, "'"));
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const SafetensorsEntry& e : entries) {
      out.write(reinterpret_cast<const char*>(e.bytes.data()),
                static_cast<std::streamsize>(e.bytes.size()));
    }
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write '", tmp, "'"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  uint8_t len[8];
  if (!in.read(reinterpret_cast<char*>(len), 8)) {
    return absl::DataLossError(absl::StrCat("'", path, "': truncated header length"));
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t{len[i]} << (8 * i);
  if (header_len > (uint64_t{100} << 20)) {
    return absl::DataLossError(absl::StrCat("'", path, "': header of ", header_len, " bytes"));
  }
  std::string text(header_len, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(header_len))) {
    return absl::DataLossError(absl::StrCat("'", path, "': truncated header"));
  }
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) {
    return absl::DataLossError(absl::StrCat("'", path, "': header is not a JSON object"));
  }
  SafetensorsFile file;
  std::vector<std::pair<uint64_t, std::string>> by_offset;
  uint64_t covered = 0;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it->begin(); m != it->end(); ++m) {
          file.metadata[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const nlohmann::json& t = *it;
      LoadedTensor lt;
      lt.dtype = t.at("dtype").get<std::string>();
      lt.shape = t.at("shape").get<Shape>();
      const uint64_t begin = t.at("data_offsets").at(0).get<uint64_t>();
      const uint64_t end = t.at("data_offsets").at(1).get<uint64_t>();
      if (begin > end || end > data.size()) {
        return absl::DataLossError(
            absl::StrCat("'", path, "': tensor '", it.key(), "' offsets out of range"));
      }
      lt.bytes.assign(data.begin() + begin, data.begin() + end);
      covered += end - begin;
      by_offset.emplace_back(begin, it.key());
      file.tensors.emplace(it.key(), std::move(lt));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat("'", path, "': malformed header: ", e.what()));
  }
  if (covered != data.size()) {
    return absl::DataLossError(absl::StrCat("'", path, "': data has holes or overlaps (", covered,
                                            " of ", data.size(), " bytes indexed)"));
  }
  std::sort(by_offset.begin(), by_offset.end());
  for (auto& [offset, name] : by_offset) file.order.push_back(std::move(name));
  return file;
}

}  // namespace wpub::recv
