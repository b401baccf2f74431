// Opening a snapshot: one safetensors file (a receiver's output) or a checkpoint directory with
// its config files.
#include "core/inspect/inspect.h"

#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/common/json_bounds.h"
#include "core/common/parallel_for.h"
#include "core/common/status.h"
#include "core/policy/policy.h"
#include "core/safetensors/safetensors.h"
#include "core/transport/checksum.h"
#include "kernels/nvfp4_math.h"

namespace wpub::inspect {

namespace {

namespace fs = std::filesystem;

// Config files are small; anything past this is not a config an engine reads either.
constexpr JsonBounds kConfigBounds{size_t{64} << 20, 64};

absl::StatusOr<std::optional<nlohmann::json>> ReadJsonFile(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<nlohmann::json>();
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > kConfigBounds.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", size,
                                                   " bytes, more than a config holds (",
                                                   kConfigBounds.max_bytes, ")"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream s;
  s << in.rdbuf();
  const std::string text = s.str();
  WPUB_RETURN_IF_ERROR(CheckJsonBounds(text, path.string(), kConfigBounds));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  }
  return std::optional<nlohmann::json>(std::move(j));
}

// The quantization block's quant_algo and exclude list, from hf_quant_config.json's
// "quantization" or config.json's "quantization_config".
absl::Status ReadQuantConfig(const nlohmann::json& block, const std::string& where,
                             const char* list_key, std::string* algo,
                             std::optional<ExcludeList>* exclude) {
  if (!block.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  }
  if (auto it = block.find("quant_algo"); it != block.end() && it->is_string()) {
    *algo = it->get<std::string>();
  }
  auto it = block.find(list_key);
  std::vector<std::string> entries;
  if (it == block.end() || it->is_null()) {
    exclude->emplace(*ExcludeList::Create({}));
    return absl::OkStatus();
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", list_key, ": not a list"));
  }
  for (const auto& e : *it) {
    if (!e.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", list_key, ": entry ", e.dump(), " is not a string"));
    }
    entries.push_back(e.get<std::string>());
  }
  absl::StatusOr<ExcludeList> list = ExcludeList::Create(std::move(entries));
  if (!list.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", list_key, ": ", list.status().message()));
  }
  exclude->emplace(*std::move(list));
  return absl::OkStatus();
}

}  // namespace

struct Snapshot::Storage {
  std::unique_ptr<safetensors::Checkpoint> checkpoint;
  std::unique_ptr<safetensors::Reader> reader;
};

Snapshot::~Snapshot() = default;

absl::StatusOr<std::unique_ptr<Snapshot>> Snapshot::Open(const std::string& path) {
  std::unique_ptr<Snapshot> s(new Snapshot());
  s->path_ = path;
  s->storage_ = std::make_unique<Storage>();
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  auto add = [&](const safetensors::Reader& r, const std::string& file) {
    for (const safetensors::TensorInfo& t : r.tensors()) {
      s->tensors_.push_back(Tensor{t.name, t.dtype, t.shape, r.Data(t), file});
    }
  };
  if (fs::is_directory(p, ec)) {
    s->kind_ = Kind::kDirectory;
    WPUB_ASSIGN_OR_RETURN(s->storage_->checkpoint, safetensors::Checkpoint::Open(path));
    const safetensors::Checkpoint& c = *s->storage_->checkpoint;
    for (size_t i = 0; i < c.readers().size(); ++i) add(*c.readers()[i], c.shard_names()[i]);
    s->files_ = c.shard_names();
    if (!c.readers().empty()) s->metadata_ = c.readers()[0]->metadata();
    WPUB_ASSIGN_OR_RETURN(std::optional<nlohmann::json> hf,
                          ReadJsonFile(p / "hf_quant_config.json"));
    WPUB_ASSIGN_OR_RETURN(std::optional<nlohmann::json> config, ReadJsonFile(p / "config.json"));
    if (hf.has_value() && hf->contains("quantization") && !(*hf)["quantization"].is_null()) {
      WPUB_RETURN_IF_ERROR(ReadQuantConfig((*hf)["quantization"],
                                           (p / "hf_quant_config.json").string() + ": quantization",
                                           "exclude_modules", &s->quant_algo_, &s->exclude_));
    } else if (config.has_value() && config->contains("quantization_config") &&
               !(*config)["quantization_config"].is_null()) {
      WPUB_RETURN_IF_ERROR(ReadQuantConfig((*config)["quantization_config"],
                                           (p / "config.json").string() + ": quantization_config",
                                           "ignore", &s->quant_algo_, &s->exclude_));
    }
  } else {
    WPUB_ASSIGN_OR_RETURN(s->storage_->reader, safetensors::Reader::Open(path));
    const std::string file = p.filename().string();
    add(*s->storage_->reader, file);
    s->files_ = {file};
    s->metadata_ = s->storage_->reader->metadata();
  }
  std::sort(s->tensors_.begin(), s->tensors_.end(),
            [](const Tensor& a, const Tensor& b) { return a.name < b.name; });
  return s;
}

const Tensor* Snapshot::Find(absl::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const Tensor& t, absl::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

}  // namespace wpub::inspect
