// Sharded checkpoints: `model.safetensors.index.json` parsing and cross-checking against the
// shards it names, and the index text the writer side produces.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"

namespace wpub::safetensors {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A shard name must stay inside the checkpoint directory.
bool SafeShardName(absl::string_view name) {
  if (name.empty() || absl::StartsWith(name, "/") || absl::StrContains(name, "\\")) return false;
  for (absl::string_view part : {absl::string_view("..")}) {
    if (name == part || absl::StartsWith(name, "../") || absl::StrContains(name, "/../") ||
        absl::EndsWith(name, "/..")) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> c(new Checkpoint());
  c->dir_ = dir;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  const fs::path index_path = root / std::string(kIndexFileName);
  // tensor name -> shard file name, as the index states it.
  std::vector<std::pair<std::string, std::string>> weight_map;
  if (fs::exists(index_path, ec)) {
    c->sharded_ = true;
    WPUB_ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    const std::string where = index_path.string();
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no weight_map object"));
    }
    std::set<std::string> shards;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": weight_map entry of '", it.key(), "' is not a string"));
      }
      const std::string shard = it.value().get<std::string>();
      if (!SafeShardName(shard)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": weight_map entry of '", it.key(), "' names '", shard,
                         "', which is not a file inside the checkpoint directory"));
      }
      weight_map.emplace_back(it.key(), shard);
      shards.insert(shard);
    }
    for (const std::string& s : shards) {
      if (!fs::is_regular_file(root / s, ec)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": names shard '", s, "', which is missing from ", dir));
      }
    }
    c->shard_names_.assign(shards.begin(), shards.end());
  } else if (fs::is_regular_file(root / std::string(kSingleFileName), ec)) {
    c->shard_names_.push_back(std::string(kSingleFileName));
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither ", kIndexFileName, " nor ", kSingleFileName, " found"));
  }

  for (size_t i = 0; i < c->shard_names_.size(); ++i) {
    WPUB_ASSIGN_OR_RETURN(std::unique_ptr<Reader> r,
                          Reader::Open((root / c->shard_names_[i]).string()));
    for (const TensorInfo& t : r->tensors()) {
      auto [it, inserted] = c->locations_.emplace(t.name, Location{static_cast<int>(i), &t});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            r->path(), ": tensor '", t.name, "' is also in ", c->shard_names_[it->second.shard]));
      }
      c->total_bytes_ += t.nbytes();
    }
    c->readers_.push_back(std::move(r));
  }
  if (c->sharded_) {
    absl::flat_hash_map<std::string, std::string> indexed;
    for (const auto& [name, shard] : weight_map) {
      auto loc = c->locations_.find(name);
      auto pos = std::lower_bound(c->shard_names_.begin(), c->shard_names_.end(), shard);
      const int want = static_cast<int>(pos - c->shard_names_.begin());
      if (loc == c->locations_.end() || loc->second.shard != want) {
        return absl::InvalidArgumentError(absl::StrCat((root / shard).string(), ": tensor '", name,
                                                       "' is named by the index but missing"));
      }
      indexed.emplace(name, shard);
    }
    for (const auto& [name, loc] : c->locations_) {
      if (!indexed.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat(c->readers_[loc.shard]->path(), ": tensor '",
                                                       name, "' is not in ", kIndexFileName));
      }
    }
  }
  return c;
}

std::optional<Checkpoint::Location> Checkpoint::Find(absl::string_view name) const {
  auto it = locations_.find(name);
  if (it == locations_.end()) return std::nullopt;
  return it->second;
}

std::string IndexJson(uint64_t total_size,
                      const std::vector<std::pair<std::string, std::string>>& weight_map) {
  nlohmann::ordered_json j;
  j["metadata"] = {{"total_size", total_size}};
  nlohmann::ordered_json wm = nlohmann::ordered_json::object();
  for (const auto& [name, shard] : weight_map) wm[name] = shard;
  j["weight_map"] = std::move(wm);
  return j.dump(2) + "\n";
}

}  // namespace wpub::safetensors
