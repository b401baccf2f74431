// A snapshot's inventory: module grouping, roles, the engines' checks, its text and JSON forms.
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

#include "core/inspect/tensor_views.h"

namespace wpub::inspect {

bool IsGlob(absl::string_view entry) {
  return !policy::IsRegexRule(entry) &&
         (absl::StrContains(entry, '*') || absl::StrContains(entry, '?'));
}

absl::StatusOr<ExcludeList> ExcludeList::Create(std::vector<std::string> entries) {
  WPUB_ASSIGN_OR_RETURN(policy::RegexIgnoreRules rules, policy::RegexIgnoreRules::Create(entries));
  return ExcludeList(std::move(entries), std::move(rules));
}

const std::string* ExcludeList::EveryEngine(absl::string_view module) const {
  size_t first = rules_.FirstMatch(module).value_or(entries_.size());
  const std::string m(module);
  for (size_t i = 0; i < first; ++i) {
    if (IsGlob(entries_[i]) && ::fnmatch(entries_[i].c_str(), m.c_str(), 0) == 0) first = i;
  }
  return first < entries_.size() ? &entries_[first] : nullptr;
}

const std::string* ExcludeList::AnyEngine(absl::string_view module) const {
  const std::string* every = EveryEngine(module);
  const size_t first = every == nullptr ? entries_.size() : every - entries_.data();
  for (size_t i = 0; i < first; ++i) {
    const std::string& e = entries_[i];
    if (!e.empty() && !IsGlob(e) && !policy::IsRegexRule(e) && absl::StrContains(module, e)) {
      return &e;
    }
  }
  return every;
}

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kNvfp4Weight:
      return "nvfp4_weight";
    case Role::kNvfp4BlockScale:
      return "nvfp4_block_scale";
    case Role::kNvfp4GlobalScale:
      return "nvfp4_global_scale";
    case Role::kNvfp4InputScale:
      return "nvfp4_input_scale";
    case Role::kHighPrecision:
      return "high_precision";
  }
  return "?";
}

Inventory Inspect(const Snapshot& snapshot, int threads) {
  Inventory inv;
  inv.path = snapshot.path();
  inv.kind = snapshot.kind();
  inv.metadata = snapshot.metadata();
  inv.quant_algo = snapshot.quant_algo();
  const ExcludeList* exclude = snapshot.exclude_list();
  if (exclude != nullptr) inv.exclude_modules = exclude->entries();
  inv.files = snapshot.files();

  const std::vector<Tensor>& tensors = snapshot.tensors();
  // ModelOpt MIXED_PRECISION checkpoints list their quantized layers instead of excluding the
  // rest: the exclude checks do not apply to them.
  const bool exclude_checks = exclude != nullptr && inv.quant_algo != "MIXED_PRECISION";
  absl::flat_hash_map<std::string, Role> roles;  // NVFP4 parts
  for (const Tensor& t : tensors) {
    std::string orphan;
    std::optional<Nvfp4Parts> parts = FindNvfp4(snapshot, t, &orphan);
    if (!orphan.empty()) inv.problems.push_back(orphan);
    if (!parts.has_value()) continue;
    for (std::string& problem : parts->problems) inv.problems.push_back(std::move(problem));
    roles[parts->weight->name] = Role::kNvfp4Weight;
    roles[parts->scale->name] = Role::kNvfp4BlockScale;
    Nvfp4Module m;
    m.name = ModuleOf(t.name);
    m.logical_shape = parts->logical;
    if (parts->scale_2 != nullptr) roles[parts->scale_2->name] = Role::kNvfp4GlobalScale;
    if (parts->decodable && parts->slices > 0) {
      const uint8_t* d = parts->scale_2->bytes.data();
      m.has_global_scale = true;
      m.min_global_scale = m.max_global_scale = LoadF32(d);
      int64_t bad = 0;
      for (int64_t i = 0; i < parts->slices; ++i) {
        const float g = LoadF32(d + 4 * i);
        m.min_global_scale = std::min(m.min_global_scale, g);
        m.max_global_scale = std::max(m.max_global_scale, g);
        if (!std::isfinite(g) || !(g > 0)) {
          if (bad++ == 0) {
            inv.problems.push_back(absl::StrCat(parts->scale_2->name, ": global scale ", g,
                                                " at slice ", i, " (finite and > 0 expected)"));
          }
        }
      }
    }
    if (parts->input_scale != nullptr) {
      roles[parts->input_scale->name] = Role::kNvfp4InputScale;
      m.has_input_scale = true;
    } else if (snapshot.kind() == Snapshot::Kind::kDirectory && inv.quant_algo == "NVFP4") {
      inv.problems.push_back(absl::StrCat(
          m.name,
          ".input_scale: missing; quant_algo NVFP4 (W4A4) loaders create the parameter "
          "and read it as the activation scale"));
    }
    if (exclude_checks) {
      if (const std::string* e = exclude->AnyEngine(m.name)) {
        inv.problems.push_back(absl::StrCat(m.name, ": NVFP4 module named by exclude entry \"", *e,
                                            "\" (an engine would load it unquantized)"));
      }
    }
    inv.modules.push_back(std::move(m));
  }
  if (!inv.modules.empty() && snapshot.kind() == Snapshot::Kind::kDirectory) {
    if (inv.quant_algo.empty()) {
      inv.problems.push_back(absl::StrCat(
          inv.modules.size(),
          " NVFP4 modules but neither hf_quant_config.json nor config.json names a quant_algo"));
    } else if (!absl::StrContains(inv.quant_algo, "FP4") && inv.quant_algo != "MIXED_PRECISION") {
      inv.problems.push_back(absl::StrCat(inv.modules.size(), " NVFP4 modules under quant_algo ",
                                          inv.quant_algo,
                                          " (engines would not build NVFP4 layers)"));
    }
  }
  // Scales without the NVFP4 weight they belong to: an engine has no parameter for them, or
  // finds a high-precision weight where it built an NVFP4 layer.
  const bool nvfp4_config = absl::StrContains(inv.quant_algo, "FP4");
  for (const Tensor& t : tensors) {
    if (roles.contains(t.name)) continue;
    const bool orphan =
        absl::EndsWith(t.name, ".weight_scale_2") ||
        (absl::EndsWith(t.name, ".weight_scale") && t.dtype == "F8_E4M3") ||
        (absl::EndsWith(t.name, ".input_scale") && (nvfp4_config || !inv.modules.empty()));
    if (orphan) {
      inv.problems.push_back(absl::StrCat(t.name, ": an NVFP4 scale without the U8 ",
                                          ModuleOf(t.name), ".weight it belongs to"));
    }
  }

  const std::vector<uint64_t> checksums = Checksums(tensors, threads);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Tensor& t = tensors[k];
    TensorRow row;
    row.name = t.name;
    row.dtype = t.dtype;
    row.shape = t.shape;
    row.nbytes = t.bytes.size();
    row.checksum = checksums[k];
    row.module = ModuleOf(t.name);
    row.file = t.file;
    auto it = roles.find(t.name);
    if (it != roles.end()) {
      row.role = it->second;
      row.reason = "quantized";
    } else {
      absl::StatusOr<DType> dtype = ParseDType(t.dtype);
      if (!dtype.ok()) {
        row.reason = std::string(policy::ReasonName(policy::Reason::kUnsupportedDType));
      } else {
        absl::StatusOr<policy::OfflineDecision> d =
            policy::ClassifyOfflineTensor(TensorDesc{t.name, *dtype, t.shape}, {});
        if (!d.ok()) {
          row.reason = "not_quantizable";  // e.g. an expert weight with K % 16 != 0
        } else if (!d->quantize) {
          row.reason = std::string(policy::ReasonName(d->reason));
        } else if (const std::string* e =
                       exclude != nullptr ? exclude->EveryEngine(row.module) : nullptr) {
          row.reason = absl::StrCat("excluded:", *e);
        } else {
          row.reason = "not_excluded";
        }
      }
      // A high-precision linear weight the exclude list does not name: engines build an NVFP4
      // layer there and find no scales.
      if (exclude_checks && !inv.modules.empty() && absl::EndsWith(t.name, ".weight") &&
          t.shape.size() >= 2 && dtype.ok() && IsQuantizableFloat(*dtype) &&
          !IsEmbedding(row.module) && exclude->EveryEngine(row.module) == nullptr) {
        inv.problems.push_back(absl::StrCat(t.name, ": high precision, but no exclude entry names ",
                                            row.module, " (an engine would expect NVFP4 there)"));
      }
      Tally& r = inv.by_reason[row.reason];
      ++r.tensors;
      r.bytes += row.nbytes;
    }
    Tally& ro = inv.by_role[std::string(RoleName(row.role))];
    ++ro.tensors;
    ro.bytes += row.nbytes;
    Tally& dt = inv.by_dtype[row.dtype];
    ++dt.tensors;
    dt.bytes += row.nbytes;
    inv.total_bytes += row.nbytes;
    inv.tensors.push_back(std::move(row));
  }
  inv.digest = Digest(inv.tensors);
  return inv;
}

std::string FormatInventory(const Inventory& inv, bool list_tensors) {
  std::string out;
  absl::StrAppendFormat(&out, "%-12s %s (%s, %d file%s)\n", "snapshot", inv.path,
                        inv.kind == Snapshot::Kind::kFile ? "file" : "directory", inv.files.size(),
                        inv.files.size() == 1 ? "" : "s");
  for (const auto& [k, v] : inv.metadata) {
    absl::StrAppendFormat(&out, "%-12s %s = %s\n", "metadata", k, v);
  }
  if (!inv.quant_algo.empty() || inv.exclude_modules.has_value()) {
    absl::StrAppendFormat(&out, "%-12s quant_algo %s, %d exclude entries\n", "quantization",
                          inv.quant_algo.empty() ? "<none>" : inv.quant_algo,
                          inv.exclude_modules ? inv.exclude_modules->size() : 0);
  }
  absl::StrAppendFormat(&out, "%-12s %d (%s, %d bytes)\n", "tensors", inv.tensors.size(),
                        Bytes(inv.total_bytes), inv.total_bytes);
  absl::StrAppendFormat(&out, "%-12s %s\n", "digest", Hex(inv.digest));
  int64_t with_input = 0, with_global = 0;
  float lo = 0, hi = 0;
  for (const Nvfp4Module& m : inv.modules) {
    with_input += m.has_input_scale;
    if (!m.has_global_scale) continue;
    lo = with_global == 0 ? m.min_global_scale : std::min(lo, m.min_global_scale);
    hi = with_global == 0 ? m.max_global_scale : std::max(hi, m.max_global_scale);
    ++with_global;
  }
  absl::StrAppendFormat(&out, "%-12s %d NVFP4 (%d with input_scale)", "modules", inv.modules.size(),
                        with_input);
  if (with_global > 0) absl::StrAppendFormat(&out, ", global scales [%g, %g]", lo, hi);
  out += "\n";
  auto table = [&](const char* title, const std::map<std::string, Tally>& t) {
    absl::StrAppendFormat(&out, "\n%-40s %9s %16s\n", title, "tensors", "bytes");
    for (const auto& [k, v] : t)
      absl::StrAppendFormat(&out, "  %-38s %9d %16d\n", k, v.tensors, v.bytes);
  };
  table("by role", inv.by_role);
  table("by dtype", inv.by_dtype);
  table("high precision, by reason", inv.by_reason);
  if (inv.problems.empty()) {
    out += "\nproblems: none\n";
  } else {
    absl::StrAppendFormat(&out, "\nproblems: %d\n", inv.problems.size());
    for (const std::string& p : inv.problems) absl::StrAppend(&out, "  ", p, "\n");
  }
  if (list_tensors) {
    absl::StrAppendFormat(&out, "\n%-64s %-8s %-20s %12s %-18s %-18s %s\n", "tensor", "dtype",
                          "shape", "bytes", "checksum", "role", "reason");
    for (const TensorRow& r : inv.tensors) {
      absl::StrAppendFormat(&out, "%-64s %-8s %-20s %12d %-18s %-18s %s\n", r.name, r.dtype,
                            ShapeString(r.shape), r.nbytes, Hex(r.checksum), RoleName(r.role),
                            r.reason);
    }
  }
  return out;
}

std::string InventoryJson(const Inventory& inv) {
  nlohmann::ordered_json j;
  j["path"] = inv.path;
  j["kind"] = inv.kind == Snapshot::Kind::kFile ? "file" : "directory";
  j["files"] = inv.files;
  j["metadata"] = inv.metadata;
  j["quant_algo"] =
      inv.quant_algo.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(inv.quant_algo);
  j["exclude_modules"] =
      inv.exclude_modules ? nlohmann::ordered_json(*inv.exclude_modules) : nlohmann::ordered_json();
  j["total_bytes"] = inv.total_bytes;
  j["digest"] = Hex(inv.digest);
  auto tallies = [](const std::map<std::string, Tally>& t) {
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    for (const auto& [k, v] : t) o[k] = {{"tensors", v.tensors}, {"bytes", v.bytes}};
    return o;
  };
  j["by_role"] = tallies(inv.by_role);
  j["by_dtype"] = tallies(inv.by_dtype);
  j["by_reason"] = tallies(inv.by_reason);
  j["problems"] = inv.problems;
  nlohmann::ordered_json modules = nlohmann::ordered_json::array();
  for (const Nvfp4Module& m : inv.modules) {
    modules.push_back({{"name", m.name},
                       {"logical_shape", m.logical_shape},
                       {"input_scale", m.has_input_scale},
                       {"min_global_scale", m.min_global_scale},
                       {"max_global_scale", m.max_global_scale}});
  }
  j["nvfp4_modules"] = std::move(modules);
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const TensorRow& r : inv.tensors) {
    rows.push_back({{"name", r.name},
                    {"dtype", r.dtype},
                    {"shape", r.shape},
                    {"bytes", r.nbytes},
                    {"checksum", Hex(r.checksum)},
                    {"role", RoleName(r.role)},
                    {"reason", r.reason},
                    {"file", r.file}});
  }
  j["tensors"] = std::move(rows);
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace wpub::inspect
