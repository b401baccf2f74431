// Snapshot opening, module grouping, the engines' checks, and the tensor-by-tensor diff.
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

std::string ModuleOf(absl::string_view name) {
  const size_t dot = name.rfind('.');
  return std::string(dot == absl::string_view::npos ? absl::string_view() : name.substr(0, dot));
}

std::string Hex(uint64_t v) { return absl::StrFormat("0x%016x", v); }

std::string Bytes(uint64_t n) {
  if (n >= uint64_t{1} << 30)
    return absl::StrFormat("%.3f GiB", static_cast<double>(n) / (1 << 30));
  if (n >= uint64_t{1} << 20)
    return absl::StrFormat("%.3f MiB", static_cast<double>(n) / (1 << 20));
  if (n >= uint64_t{1} << 10)
    return absl::StrFormat("%.3f KiB", static_cast<double>(n) / (1 << 10));
  return absl::StrCat(n, " B");
}

float LoadF32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// Element value of a float dtype; nullopt for any other dtype.
struct FloatDecoder {
  int64_t size = 0;
  float (*decode)(const uint8_t*) = nullptr;
};

std::optional<FloatDecoder> DecoderFor(absl::string_view dtype) {
  if (dtype == "BF16") {
    return FloatDecoder{2, [](const uint8_t* p) {
                          uint16_t h;
                          std::memcpy(&h, p, 2);
                          return kernels::Bf16ToFloat(h);
                        }};
  }
  if (dtype == "F16") {
    return FloatDecoder{2, [](const uint8_t* p) {
                          uint16_t h;
                          std::memcpy(&h, p, 2);
                          return kernels::Fp16ToFloat(h);
                        }};
  }
  if (dtype == "F32") return FloatDecoder{4, &LoadF32};
  if (dtype == "F8_E4M3") {
    return FloatDecoder{1, [](const uint8_t* p) { return kernels::E4M3ToFloat(*p); }};
  }
  return std::nullopt;
}

// The parts of one NVFP4 module, validated against each other.
struct Nvfp4Parts {
  const Tensor* weight = nullptr;
  const Tensor* scale = nullptr;
  const Tensor* scale_2 = nullptr;
  const Tensor* input_scale = nullptr;
  Shape logical;
  int64_t slices = 1;
  // weight, scale and scale_2 are consistent: the values can be decoded (input_scale plays no
  // part in that).
  bool decodable = false;
  std::vector<std::string> problems;  // every inconsistency found, each naming its tensor
};

// The NVFP4 module whose packed weight is `weight`, when `snapshot` has one there: a U8
// `.weight` beside an F8_E4M3 `.weight_scale`. A U8 `.weight` without that scale is no module
// (nullopt) but a problem in `*orphan`.
std::optional<Nvfp4Parts> FindNvfp4(const Snapshot& snapshot, const Tensor& weight,
                                    std::string* orphan = nullptr) {
  if (weight.dtype != "U8" || !absl::EndsWith(weight.name, ".weight")) return std::nullopt;
  Nvfp4Parts p;
  p.weight = &weight;
  const std::string module = ModuleOf(weight.name);
  p.scale = snapshot.Find(weight.name + "_scale");
  p.scale_2 = snapshot.Find(weight.name + "_scale_2");
  p.input_scale = snapshot.Find(module + ".input_scale");
  if (p.scale == nullptr || p.scale->dtype != "F8_E4M3") {
    if (orphan != nullptr) {
      *orphan = absl::StrCat(weight.name, ": a U8 weight without an F8_E4M3 ", weight.name,
                             "_scale (not a loadable NVFP4 module)");
    }
    return std::nullopt;
  }
  auto problem = [&p](auto&&... parts) { p.problems.push_back(absl::StrCat(parts...)); };
  const Shape& w = weight.shape;
  bool shapes_ok = false;
  if (w.size() < 2 || w.size() > 3) {
    problem(weight.name, ": NVFP4 weight of rank ", w.size(), " (2 or 3 expected)");
  } else if (w.back() > std::numeric_limits<int64_t>::max() / 2) {
    // Checked before anything is multiplied (a zero dim lets a header carry any other dim).
    problem(weight.name, ": packed K = ", w.back(), " is too large");
  } else if (w.back() % (policy::kNvfp4GroupSize / 2) != 0) {
    problem(weight.name, ": packed K = ", w.back(), " (the logical K = 2 x it must be a ",
            "multiple of ", policy::kNvfp4GroupSize, ")");
  } else {
    p.logical = w;
    p.logical.back() = w.back() * 2;
    p.slices = w.size() == 3 ? w[0] : 1;
    Shape want_scale = w;
    want_scale.back() = p.logical.back() / policy::kNvfp4GroupSize;
    if (p.scale->shape != want_scale) {
      problem(p.scale->name, ": shape ", ShapeString(p.scale->shape), ", expected ",
              ShapeString(want_scale), " for a packed weight of ", ShapeString(w));
    } else {
      shapes_ok = true;
    }
  }
  if (p.scale_2 == nullptr) {
    problem(weight.name, "_scale_2: missing (the module's global scale)");
  } else if (shapes_ok &&
             (p.scale_2->dtype != "F32" || NumElements(p.scale_2->shape) != p.slices)) {
    problem(p.scale_2->name, ": ", p.scale_2->dtype, " ", ShapeString(p.scale_2->shape),
            ", expected F32 with ", p.slices,
            p.slices == 1 ? " element" : " elements (one per slice)");
  } else if (shapes_ok) {
    p.decodable = true;
  }
  if (p.input_scale != nullptr &&
      (p.input_scale->dtype != "F32" ||
       (NumElements(p.input_scale->shape) != 1 &&
        (!shapes_ok || NumElements(p.input_scale->shape) != p.slices)))) {
    problem(p.input_scale->name, ": ", p.input_scale->dtype, " ", ShapeString(p.input_scale->shape),
            ", expected F32 with 1",
            shapes_ok && p.slices != 1 ? absl::StrCat(" or ", p.slices) : std::string(), " element",
            shapes_ok && p.slices != 1 ? "s" : "");
  }
  return p;
}

// Embeddings are never quantized layers (an LM head is: vLLM's ModelOpt config quantizes it
// unless excluded).
bool IsEmbedding(absl::string_view module) {
  return absl::EndsWith(module, "embed_tokens") || absl::EndsWith(module, "word_embeddings") ||
         absl::EndsWith(module, "wte") || absl::EndsWith(module, "embed_in");
}

// fn(i) for i in [0, n) on `threads` threads (0: the hardware's) pulling from one counter.
void ParallelFor(size_t n, int threads, const std::function<void(size_t)>& fn) {
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // More threads than the hardware's only add contention (and one per tensor could exhaust
  // the process's thread limit).
  threads = threads <= 0 ? hardware : std::min(threads, hardware);
  threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), n));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

std::vector<uint64_t> Checksums(const std::vector<Tensor>& tensors, int threads) {
  std::vector<uint64_t> out(tensors.size());
  ParallelFor(tensors.size(), threads, [&](size_t i) {
    out[i] = transport::Checksum(tensors[i].bytes.data(), tensors[i].bytes.size());
  });
  return out;
}

uint64_t Digest(const std::vector<TensorRow>& rows) {
  std::string buf;
  for (const TensorRow& r : rows) {
    const uint64_t name_size = r.name.size(), rank = r.shape.size();
    buf.append(reinterpret_cast<const char*>(&name_size), sizeof name_size);
    absl::StrAppend(&buf, r.name, r.dtype, std::string(1, '\0'));
    buf.append(reinterpret_cast<const char*>(&rank), sizeof rank);
    for (int64_t d : r.shape) buf.append(reinterpret_cast<const char*>(&d), sizeof d);
    buf.append(reinterpret_cast<const char*>(&r.checksum), sizeof r.checksum);
  }
  return transport::Checksum(reinterpret_cast<const uint8_t*>(buf.data()), buf.size());
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

// ---- Diff ----

absl::string_view ChangeName(Change change) {
  switch (change) {
    case Change::kIdentical:
      return "identical";
    case Change::kChangedBytes:
      return "changed_bytes";
    case Change::kChangedScales:
      return "changed_scales";
    case Change::kChangedDesc:
      return "changed_desc";
    case Change::kOnlyInA:
      return "only_in_a";
    case Change::kOnlyInB:
      return "only_in_b";
  }
  return "?";
}

bool DiffReport::identical() const {
  for (const TensorDiff& t : tensors) {
    const bool one_side = t.change == Change::kOnlyInA || t.change == Change::kOnlyInB;
    if (t.change != Change::kIdentical && !(common_only && one_side)) return false;
  }
  return true;
}

namespace {

// Both sides of an NVFP4 weight, block by block (16 elements: 8 bytes of codes, one E4M3
// scale, the slice's global scale); value = (E2M1(code) x block scale) x global scale, the
// first product exact. A block whose codes, block scale and global scale are all equal holds
// equal values and is skipped.
void CompareNvfp4(const Nvfp4Parts& pa, const Nvfp4Parts& pb, TensorDiff* d) {
  std::array<float, 16> e2m1;
  for (int c = 0; c < 16; ++c) e2m1[c] = kernels::E2M1ToFloat(static_cast<uint8_t>(c));
  d->elements = NumElements(pa.logical);
  const int64_t blocks = d->elements / policy::kNvfp4GroupSize;
  const int64_t per_slice = pa.slices > 0 ? std::max<int64_t>(blocks / pa.slices, 1) : 1;
  const uint8_t* ca = pa.weight->bytes.data();
  const uint8_t* cb = pb.weight->bytes.data();
  const uint8_t* sa = pa.scale->bytes.data();
  const uint8_t* sb = pb.scale->bytes.data();
  const uint8_t* ga = pa.scale_2->bytes.data();
  const uint8_t* gb = pb.scale_2->bytes.data();
  double max_diff = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t g = 4 * (blk / per_slice);
    const uint8_t* x = ca + 8 * blk;
    const uint8_t* y = cb + 8 * blk;
    if (sa[blk] == sb[blk] && std::memcmp(ga + g, gb + g, 4) == 0 && std::memcmp(x, y, 8) == 0) {
      continue;
    }
    const float block_a = kernels::E4M3ToFloat(sa[blk]), block_b = kernels::E4M3ToFloat(sb[blk]);
    const float global_a = LoadF32(ga + g), global_b = LoadF32(gb + g);
    for (int k = 0; k < 16; ++k) {
      const uint8_t qa = k % 2 == 0 ? x[k / 2] & 0xF : x[k / 2] >> 4;
      const uint8_t qb = k % 2 == 0 ? y[k / 2] & 0xF : y[k / 2] >> 4;
      d->differing_elements += qa != qb;
      const float va = (e2m1[qa] * block_a) * global_a;
      const float vb = (e2m1[qb] * block_b) * global_b;
      if (std::isfinite(va) != std::isfinite(vb)) {
        ++d->finiteness_changes;
      } else if (std::isfinite(va)) {
        max_diff = std::max(max_diff, std::fabs(static_cast<double>(va) - vb));
      }
    }
  }
  d->max_abs_diff = max_diff;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.bytes.size() == b.bytes.size() &&
         std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

// Element by element, as values where the dtype is a float one.
void CompareElements(const Tensor& a, const Tensor& b, TensorDiff* d) {
  std::optional<FloatDecoder> dec = DecoderFor(a.dtype);
  const int64_t size = dec ? dec->size : safetensors::DTypeSizeOf(a.dtype).value_or(1);
  d->elements = static_cast<int64_t>(a.bytes.size()) / std::max<int64_t>(size, 1);
  double max_diff = 0;
  for (int64_t i = 0; i < d->elements; ++i) {
    const uint8_t* x = a.bytes.data() + i * size;
    const uint8_t* y = b.bytes.data() + i * size;
    if (std::memcmp(x, y, size) == 0) continue;
    ++d->differing_elements;
    if (!dec) continue;
    const float fx = dec->decode(x), fy = dec->decode(y);
    if (std::isfinite(fx) != std::isfinite(fy)) {
      ++d->finiteness_changes;
    } else if (std::isfinite(fx)) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(fx) - fy));
    }
  }
  if (dec) d->max_abs_diff = max_diff;
}

void ConfigChange(DiffReport* r, const std::string& key, const std::optional<std::string>& a,
                  const std::optional<std::string>& b) {
  if (a != b) r->config_changes[key] = {a.value_or("<absent>"), b.value_or("<absent>")};
}

}  // namespace

DiffReport Diff(const Snapshot& a, const Snapshot& b, int threads) {
  DiffReport r;
  r.path_a = a.path();
  r.path_b = b.path();
  const std::vector<Tensor>& ta = a.tensors();
  const std::vector<Tensor>& tb = b.tensors();
  // Names are merged here; the byte comparisons of tensors present on both sides with one dtype
  // and shape run in parallel after.
  std::vector<std::pair<const Tensor*, const Tensor*>> pairs;
  std::vector<size_t> pair_row;
  size_t i = 0, j = 0;
  while (i < ta.size() || j < tb.size()) {
    TensorDiff d;
    if (j == tb.size() || (i < ta.size() && ta[i].name < tb[j].name)) {
      d.name = ta[i].name;
      d.change = Change::kOnlyInA;
      d.dtype_a = ta[i].dtype;
      d.shape_a = ta[i].shape;
      ++i;
    } else if (i == ta.size() || tb[j].name < ta[i].name) {
      d.name = tb[j].name;
      d.change = Change::kOnlyInB;
      d.dtype_b = tb[j].dtype;
      d.shape_b = tb[j].shape;
      ++j;
    } else {
      const Tensor& x = ta[i++];
      const Tensor& y = tb[j++];
      d.name = x.name;
      d.dtype_a = x.dtype;
      d.dtype_b = y.dtype;
      d.shape_a = x.shape;
      d.shape_b = y.shape;
      if (x.dtype != y.dtype || x.shape != y.shape) {
        d.change = Change::kChangedDesc;
      } else {
        pairs.emplace_back(&x, &y);
        pair_row.push_back(r.tensors.size());
      }
    }
    r.tensors.push_back(std::move(d));
  }
  ParallelFor(pairs.size(), threads, [&](size_t k) {
    const Tensor& x = *pairs[k].first;
    const Tensor& y = *pairs[k].second;
    TensorDiff& d = r.tensors[pair_row[k]];
    // An NVFP4 weight on both sides is compared as values: its codes under its scales (equal
    // codes under other scales are other values).
    const std::optional<Nvfp4Parts> na = FindNvfp4(a, x);
    const std::optional<Nvfp4Parts> nb = FindNvfp4(b, y);
    const bool nvfp4 = na && nb && na->decodable && nb->decodable && na->logical == nb->logical;
    if (!SameBytes(x, y)) {
      d.change = Change::kChangedBytes;
      nvfp4 ? CompareNvfp4(*na, *nb, &d) : CompareElements(x, y, &d);
    } else if (nvfp4 &&
               (!SameBytes(*na->scale, *nb->scale) || !SameBytes(*na->scale_2, *nb->scale_2))) {
      d.change = Change::kChangedScales;
      CompareNvfp4(*na, *nb, &d);
    } else {
      d.change = Change::kIdentical;
    }
  });
  for (const TensorDiff& d : r.tensors) ++r.counts[std::string(ChangeName(d.change))];
  auto digest = [threads](const std::vector<Tensor>& tensors) {
    const std::vector<uint64_t> checksums = Checksums(tensors, threads);
    std::vector<TensorRow> rows(tensors.size());
    for (size_t k = 0; k < tensors.size(); ++k) {
      rows[k].name = tensors[k].name;
      rows[k].dtype = tensors[k].dtype;
      rows[k].shape = tensors[k].shape;
      rows[k].checksum = checksums[k];
    }
    return Digest(rows);
  };
  r.digest_a = digest(ta);
  r.digest_b = digest(tb);

  std::set<std::string> keys;
  for (const auto& [k, v] : a.metadata()) keys.insert(k);
  for (const auto& [k, v] : b.metadata()) keys.insert(k);
  for (const std::string& k : keys) {
    auto get = [&k](const Snapshot& s) -> std::optional<std::string> {
      auto it = s.metadata().find(k);
      return it == s.metadata().end() ? std::nullopt : std::optional<std::string>(it->second);
    };
    ConfigChange(&r, "metadata." + k, get(a), get(b));
  }
  auto algo = [](const Snapshot& s) {
    return s.quant_algo().empty() ? std::nullopt : std::optional<std::string>(s.quant_algo());
  };
  ConfigChange(&r, "quant_algo", algo(a), algo(b));
  const ExcludeList* xa = a.exclude_list();
  const ExcludeList* xb = b.exclude_list();
  if ((xa == nullptr) != (xb == nullptr)) {
    // One side has no quantization config (a receiver's file): the list as a whole.
    auto entries = [](const ExcludeList* x) -> std::optional<std::string> {
      if (x == nullptr) return std::nullopt;
      return absl::StrCat(x->entries().size(), " entries");
    };
    ConfigChange(&r, "exclude_modules", entries(xa), entries(xb));
    return r;
  }
  std::set<std::string> ea, eb;
  if (xa != nullptr) ea.insert(xa->entries().begin(), xa->entries().end());
  if (xb != nullptr) eb.insert(xb->entries().begin(), xb->entries().end());
  for (const std::string& e : ea) {
    if (!eb.contains(e)) ConfigChange(&r, "exclude_modules: " + e, "listed", std::nullopt);
  }
  for (const std::string& e : eb) {
    if (!ea.contains(e)) ConfigChange(&r, "exclude_modules: " + e, std::nullopt, "listed");
  }
  return r;
}

std::string FormatDiff(const DiffReport& r, int64_t max_rows) {
  std::string out;
  absl::StrAppendFormat(&out, "a: %s (digest %s)\nb: %s (digest %s)\n", r.path_a, Hex(r.digest_a),
                        r.path_b, Hex(r.digest_b));
  for (Change c : {Change::kIdentical, Change::kChangedBytes, Change::kChangedScales,
                   Change::kChangedDesc, Change::kOnlyInA, Change::kOnlyInB}) {
    auto it = r.counts.find(std::string(ChangeName(c)));
    absl::StrAppendFormat(&out, "  %-14s %d\n", ChangeName(c),
                          it == r.counts.end() ? 0 : it->second);
  }
  if (!r.config_changes.empty()) {
    out += "\nconfig and metadata:\n";
    for (const auto& [k, v] : r.config_changes) {
      absl::StrAppendFormat(&out, "  %s: %s -> %s\n", k, v.first, v.second);
    }
  }
  int64_t shown = 0, not_identical = 0;
  for (const TensorDiff& d : r.tensors) {
    if (d.change == Change::kIdentical) continue;
    ++not_identical;
    if (max_rows >= 0 && shown >= max_rows) continue;
    if (shown++ == 0) out += "\ntensors:\n";
    switch (d.change) {
      case Change::kChangedBytes:
      case Change::kChangedScales:
        absl::StrAppendFormat(&out, "  %-14s %s: %d of %d elements differ", ChangeName(d.change),
                              d.name, d.differing_elements, d.elements);
        if (d.max_abs_diff) absl::StrAppendFormat(&out, ", max |a-b| %g", *d.max_abs_diff);
        if (d.finiteness_changes > 0) {
          absl::StrAppendFormat(&out, ", %d finite on one side only", d.finiteness_changes);
        }
        out += "\n";
        break;
      case Change::kChangedDesc:
        absl::StrAppendFormat(&out, "  %-14s %s: %s %s -> %s %s\n", ChangeName(d.change), d.name,
                              d.dtype_a, ShapeString(d.shape_a), d.dtype_b, ShapeString(d.shape_b));
        break;
      case Change::kOnlyInA:
        absl::StrAppendFormat(&out, "  %-14s %s: %s %s\n", ChangeName(d.change), d.name, d.dtype_a,
                              ShapeString(d.shape_a));
        break;
      case Change::kOnlyInB:
        absl::StrAppendFormat(&out, "  %-14s %s: %s %s\n", ChangeName(d.change), d.name, d.dtype_b,
                              ShapeString(d.shape_b));
        break;
      case Change::kIdentical:
        break;
    }
  }
  if (shown < not_identical) {
    absl::StrAppendFormat(&out, "  ... %d more (--max_rows)\n", not_identical - shown);
  }
  out += r.identical() ? "\nidentical tensors\n" : "\ntensors differ\n";
  if (r.common_only) {
    const auto count = [&](const char* k) {
      const auto it = r.counts.find(k);
      return it == r.counts.end() ? int64_t{0} : it->second;
    };
    absl::StrAppendFormat(&out,
                          "(--common_only: compared the tensors both hold; %d only in A, "
                          "%d only in B not counted)\n",
                          count("only_in_a"), count("only_in_b"));
  }
  return out;
}

std::string DiffJson(const DiffReport& r) {
  nlohmann::ordered_json j;
  j["a"] = {{"path", r.path_a}, {"digest", Hex(r.digest_a)}};
  j["b"] = {{"path", r.path_b}, {"digest", Hex(r.digest_b)}};
  j["identical"] = r.identical();
  j["common_only"] = r.common_only;
  j["counts"] = r.counts;
  nlohmann::ordered_json changes = nlohmann::ordered_json::object();
  for (const auto& [k, v] : r.config_changes) changes[k] = {{"a", v.first}, {"b", v.second}};
  j["config_changes"] = std::move(changes);
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const TensorDiff& d : r.tensors) {
    if (d.change == Change::kIdentical) continue;
    nlohmann::ordered_json row = {{"name", d.name}, {"change", ChangeName(d.change)}};
    if (!d.dtype_a.empty()) row["a"] = {{"dtype", d.dtype_a}, {"shape", d.shape_a}};
    if (!d.dtype_b.empty()) row["b"] = {{"dtype", d.dtype_b}, {"shape", d.shape_b}};
    if (d.change == Change::kChangedBytes || d.change == Change::kChangedScales) {
      row["elements"] = d.elements;
      row["differing_elements"] = d.differing_elements;
      row["max_abs_diff"] =
          d.max_abs_diff ? nlohmann::ordered_json(*d.max_abs_diff) : nlohmann::ordered_json();
      row["finiteness_changes"] = d.finiteness_changes;
    }
    rows.push_back(std::move(row));
  }
  j["tensors"] = std::move(rows);
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace wpub::inspect
