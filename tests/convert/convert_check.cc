// Independent checks of a converted checkpoint (see convert_check.h).
#include "tests/convert/convert_check.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"
#include "kernels/reference.h"

namespace wpub::convert {
namespace {

namespace fs = std::filesystem;
using safetensors::Checkpoint;
using safetensors::TensorInfo;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::Status Fail(absl::string_view a, absl::string_view b = "", absl::string_view c = "") {
  return absl::InternalError(absl::StrCat(a, b, c));
}

std::string Partner(const std::string& name) {
  for (auto [x, y] : {std::pair<const char*, const char*>{".gate_proj.weight", ".up_proj.weight"},
                      {".up_proj.weight", ".gate_proj.weight"},
                      {".w1.weight", ".w3.weight"},
                      {".w3.weight", ".w1.weight"}}) {
    if (absl::EndsWith(name, x)) return name.substr(0, name.size() - strlen(x)) + y;
  }
  return "";
}

bool IsGate(const std::string& n) {
  return absl::EndsWith(n, ".gate_proj.weight") || absl::EndsWith(n, ".w1.weight");
}

kernels::ElemType Elem(const std::string& st) {
  return st == "F16"   ? kernels::ElemType::kF16
         : st == "F32" ? kernels::ElemType::kF32
                       : kernels::ElemType::kBF16;
}

kernels::WeightDesc Desc(const Checkpoint& c, const Checkpoint::Location& l) {
  const Shape& s = l.info->shape;
  const int64_t e = s.size() == 3 ? s[0] : 1;
  return kernels::WeightDesc::Stack(c.readers()[l.shard]->Data(*l.info).data(), e, s[s.size() - 2],
                                    s.back(), Elem(l.info->dtype));
}

bool Covers(const std::string& entry, const std::string& module) {
  if (absl::EndsWith(entry, "*")) {
    return absl::StartsWith(module, entry.substr(0, entry.size() - 1));
  }
  return module == entry || absl::StartsWith(module, entry + ".");
}

std::string ModuleOf(const std::string& n) { return n.substr(0, n.rfind('.')); }

absl::Status Bytes(const Checkpoint& out, const std::string& name, int shard,
                   const std::string& dtype, const Shape& shape, const void* want, size_t n) {
  auto l = out.Find(name);
  if (!l) return Fail("output lacks '", name, "'");
  if (l->shard != shard) return Fail("'", name, "' is in another shard than its input");
  if (l->info->dtype != dtype || l->info->shape != shape) {
    return Fail("'", name,
                absl::StrCat("' is ", l->info->dtype, " ", ShapeString(l->info->shape),
                             ", expected ", dtype, " ", ShapeString(shape)));
  }
  auto d = out.readers()[shard]->Data(*l->info);
  if (d.size() != n || std::memcmp(d.data(), want, n) != 0) {
    return Fail("bytes of '", name, "' differ from the reference");
  }
  return absl::OkStatus();
}

absl::Status CheckAll(const std::string& in_dir, const std::string& out_dir,
                      const std::set<std::string>& quantized, kernels::QuantMode mode,
                      bool weight_only, CheckResult* r) {
  const std::string algo = weight_only ? "W4A16_NVFP4" : "NVFP4";
  WPUB_ASSIGN_OR_RETURN(auto in, Checkpoint::Open(in_dir));
  WPUB_ASSIGN_OR_RETURN(auto out, Checkpoint::Open(out_dir));
  if (in->shard_names() != out->shard_names()) return Fail("output shard names differ");
  size_t expected_out = 0;
  std::set<std::string> seen_quantized;
  for (size_t s = 0; s < in->readers().size(); ++s) {
    for (const TensorInfo& t : in->readers()[s]->tensors()) {
      const Checkpoint::Location here{static_cast<int>(s), &t};
      auto src = in->readers()[s]->Data(t);
      if (!quantized.contains(t.name)) {
        ++expected_out;
        WPUB_RETURN_IF_ERROR(Bytes(*out, t.name, s, t.dtype, t.shape, src.data(), src.size()));
        continue;
      }
      seen_quantized.insert(t.name);
      expected_out += weight_only ? 3 : 4;
      const kernels::WeightDesc w = Desc(*in, here);
      std::vector<float> amax(w.num_slices);
      const std::string partner = Partner(t.name);
      auto pl = partner.empty() ? std::nullopt : in->Find(partner);
      kernels::KernelStatus ks;
      if (pl) {
        const kernels::WeightDesc p = Desc(*in, *pl);
        ks = IsGate(t.name) ? kernels::ComputePairAmax(w, p, amax.data())
                            : kernels::ComputePairAmax(p, w, amax.data());
        if (IsGate(t.name) && pl->shard != static_cast<int>(s)) ++r->pairs_across_shards;
      } else {
        ks = kernels::ComputeAmax(w, amax.data());
      }
      if (ks != kernels::KernelStatus::kOk) return Fail("reference amax failed for ", t.name);
      const int64_t rows = w.rows() * w.num_slices, cols = w.cols();
      std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 16);
      std::vector<float> s2(w.num_slices);
      ks = kernels::Quantize(w, amax.data(), mode,
                             {packed.data(), scales.data(), nullptr, s2.data()});
      if (ks != kernels::KernelStatus::kOk) return Fail("reference quantize failed for ", t.name);
      Shape ps = t.shape, ss = t.shape;
      ps.back() /= 2;
      ss.back() /= 16;
      const Shape s2s = t.shape.size() == 3 ? Shape{t.shape[0]} : Shape{};
      WPUB_RETURN_IF_ERROR(Bytes(*out, t.name, s, "U8", ps, packed.data(), packed.size()));
      WPUB_RETURN_IF_ERROR(
          Bytes(*out, t.name + "_scale", s, "F8_E4M3", ss, scales.data(), scales.size()));
      WPUB_RETURN_IF_ERROR(
          Bytes(*out, t.name + "_scale_2", s, "F32", s2s, s2.data(), s2.size() * 4));
      const std::string input_scale = ModuleOf(t.name) + ".input_scale";
      if (weight_only) {
        if (out->Find(input_scale)) return Fail(input_scale, " in a weight-only output");
      } else {
        const float one = 1.0f;
        WPUB_RETURN_IF_ERROR(Bytes(*out, input_scale, s, "F32", {}, &one, 4));
      }
    }
  }
  if (seen_quantized != quantized) return Fail("expected quantized names missing from the input");
  if (out->num_tensors() != expected_out) {
    return Fail(
        absl::StrCat("output has ", out->num_tensors(), " tensors, expected ", expected_out));
  }
  uint64_t total = 0;
  for (const auto& rd : out->readers()) {
    if (rd->metadata() != std::map<std::string, std::string>{{"format", "pt"}}) {
      return Fail(rd->path(), ": metadata is not {format: pt}");
    }
    for (const TensorInfo& t : rd->tensors()) total += t.nbytes();
  }
  // The index (always written) maps every tensor to its shard.
  auto index = nlohmann::json::parse(Slurp(fs::path(out_dir) / "model.safetensors.index.json"));
  if (index["metadata"]["total_size"].get<uint64_t>() != total) return Fail("index total_size");
  if (index["weight_map"].size() != out->num_tensors()) return Fail("index weight_map size");
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    auto l = out->Find(it.key());
    if (!l || out->shard_names()[l->shard] != it.value().get<std::string>()) {
      return Fail("index entry of '", it.key(), "' is wrong");
    }
  }
  auto config_in = nlohmann::json::parse(Slurp(fs::path(in_dir) / "config.json"));
  auto config = nlohmann::json::parse(Slurp(fs::path(out_dir) / "config.json"));
  const nlohmann::json qc = config["quantization_config"];
  if (qc["quant_algo"] != algo || qc["quant_method"] != "modelopt" || qc["group_size"] != 16) {
    return Fail("config.json quantization_config: ", qc.dump());
  }
  config.erase("quantization_config");
  if (config != config_in) return Fail("config.json lost or changed keys");
  r->ignore = qc["ignore"].get<std::vector<std::string>>();
  auto hf = nlohmann::json::parse(Slurp(fs::path(out_dir) / "hf_quant_config.json"));
  // The keys vLLM's nested-format reader requires (kv_cache_quant_algo null: no KV-cache
  // quantization) and the producer's version.
  if (hf["producer"]["name"] != "modelopt" || !hf["producer"]["version"].is_string() ||
      hf["quantization"]["quant_algo"] != algo ||
      !hf["quantization"].contains("kv_cache_quant_algo") ||
      !hf["quantization"]["kv_cache_quant_algo"].is_null() || !qc.contains("kv_cache_quant_algo") ||
      hf["quantization"]["group_size"] != 16 ||
      hf["quantization"]["exclude_modules"].get<std::vector<std::string>>() != r->ignore) {
    return Fail("hf_quant_config.json: ", hf.dump());
  }
  for (size_t s = 0; s < in->readers().size(); ++s) {
    for (const TensorInfo& t : in->readers()[s]->tensors()) {
      const std::string module = ModuleOf(t.name);
      bool covered = false;
      for (const std::string& e : r->ignore) covered = covered || Covers(e, module);
      if (quantized.contains(t.name) && covered)
        return Fail("ignore list covers quantized ", module);
      if (!quantized.contains(t.name) && !covered && !quantized.contains(module + ".weight")) {
        return Fail("ignore list misses kept module ", module);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

CheckResult CheckConvertedCheckpoint(const std::string& in_dir, const std::string& out_dir,
                                     const std::set<std::string>& quantized,
                                     kernels::QuantMode mode, bool weight_only) {
  CheckResult r;
  r.status = CheckAll(in_dir, out_dir, quantized, mode, weight_only, &r);
  return r;
}

absl::Status CompareDirectories(const std::string& a, const std::string& b) {
  std::map<std::string, fs::path> fa, fb;
  for (const auto& e : fs::recursive_directory_iterator(a)) {
    if (e.is_regular_file()) fa[fs::relative(e.path(), a).string()] = e.path();
  }
  for (const auto& e : fs::recursive_directory_iterator(b)) {
    if (e.is_regular_file()) fb[fs::relative(e.path(), b).string()] = e.path();
  }
  if (fa.size() != fb.size()) return Fail("different file lists");
  for (const auto& [rel, p] : fa) {
    auto it = fb.find(rel);
    if (it == fb.end()) return Fail(rel, " only in ", a);
    if (Slurp(p) != Slurp(it->second)) return Fail(rel, " differs");
  }
  return absl::OkStatus();
}

}  // namespace wpub::convert
