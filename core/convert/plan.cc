// Conversion planning: per-tensor decisions from the policy's offline classifier, gate/up pairs
// matched over the whole checkpoint (so a pair split across shards shares one amax), output
// shard layouts and the compact ignore list.
#include <algorithm>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/convert/plan.h"
#include "core/policy/policy.h"

namespace wpub::convert {
namespace {

using safetensors::Checkpoint;
using safetensors::TensorInfo;

kernels::ElemType ElemTypeOf(DType d) {
  switch (d) {
    case DType::kFloat16:
      return kernels::ElemType::kF16;
    case DType::kFloat32:
      return kernels::ElemType::kF32;
    default:
      return kernels::ElemType::kBF16;
  }
}

// "model.layers.7." prefix of a name, or empty.
std::string LayerPrefix(absl::string_view name) {
  constexpr absl::string_view kPrefix = "model.layers.";
  const size_t pos = name.find(kPrefix);
  if (pos == absl::string_view::npos) return "";
  size_t end = pos + kPrefix.size();
  while (end < name.size() && absl::ascii_isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == pos + kPrefix.size() || end >= name.size() || name[end] != '.') return "";
  return std::string(name.substr(0, end + 1));
}

// Module of a tensor: its name without the last component.
std::string ModuleOf(absl::string_view name) {
  const size_t dot = name.rfind('.');
  return std::string(dot == absl::string_view::npos ? name : name.substr(0, dot));
}

// "...mlp.experts" container of a routed-expert name, or empty.
std::string ExpertContainer(absl::string_view name) {
  constexpr absl::string_view kMarker = ".experts.";
  const size_t pos = name.rfind(kMarker);
  if (pos == absl::string_view::npos) return "";
  return std::string(name.substr(0, pos + kMarker.size() - 1));
}

struct Decided {
  int shard;
  const TensorInfo* info;
  policy::OfflineDecision decision;
};

}  // namespace

uint64_t Unit::member_input_bytes(size_t m) const {
  const UnitMember& u = members[m];
  return static_cast<uint64_t>(slice_end - slice_begin) * static_cast<uint64_t>(u.rows) *
         static_cast<uint64_t>(u.cols) * kernels::ElemSize(u.type);
}

uint64_t Unit::input_bytes() const {
  if (!quantize) return members[0].info->nbytes();
  uint64_t n = 0;
  for (size_t m = 0; m < members.size(); ++m) n += member_input_bytes(m);
  return n;
}

const uint8_t* Unit::input(const Checkpoint& ckpt, size_t m) const {
  const UnitMember& u = members[m];
  const uint8_t* base = ckpt.readers()[u.shard]->Data(*u.info).data();
  if (!quantize) return base;
  return base + static_cast<uint64_t>(slice_begin) * static_cast<uint64_t>(u.rows) *
                    static_cast<uint64_t>(u.cols) * kernels::ElemSize(u.type);
}

QuantSizes QuantizedSizes(const UnitMember& m, int64_t slices) {
  const uint64_t per = static_cast<uint64_t>(m.rows) * static_cast<uint64_t>(m.cols);
  return QuantSizes{per / 2 * static_cast<uint64_t>(slices),
                    per / 16 * static_cast<uint64_t>(slices), 4 * static_cast<uint64_t>(slices)};
}

absl::Status WriteQuantized(const Unit& unit, size_t m, const uint8_t* packed,
                            const uint8_t* scales, const float* scale2,
                            const std::vector<safetensors::Writer*>& writers) {
  const UnitMember& u = unit.members[m];
  safetensors::Writer* w = writers[u.shard];
  const int64_t n = unit.slice_end - unit.slice_begin;
  const QuantSizes size = QuantizedSizes(u, n);
  const QuantSizes before = QuantizedSizes(u, unit.slice_begin);
  WPUB_RETURN_IF_ERROR(
      w->Write(u.out_index, before.packed, absl::Span<const uint8_t>(packed, size.packed)));
  WPUB_RETURN_IF_ERROR(
      w->Write(u.out_index + 1, before.scales, absl::Span<const uint8_t>(scales, size.scales)));
  WPUB_RETURN_IF_ERROR(
      w->Write(u.out_index + 2, before.scale2,
               absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(scale2), size.scale2)));
  if (unit.input_scale && unit.slice_begin == 0) {
    const float one = 1.0f;
    WPUB_RETURN_IF_ERROR(w->Write(
        u.out_index + 3, 0, absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&one), 4)));
  }
  return absl::OkStatus();
}

namespace {

// The precision exceptions the options ask for (the layer counts need num_hidden_layers).
absl::StatusOr<policy::PrecisionExceptions> Exceptions(const Checkpoint& ckpt,
                                                       const ConvertOptions& options,
                                                       int64_t num_hidden_layers) {
  policy::PrecisionExceptions exceptions;
  exceptions.extra_high_precision_layers_hf = options.extra_high_precision_layers_hf;
  if (options.num_layers_at_start_in_bf16 < 0 || options.num_layers_at_end_in_bf16 < 0) {
    return absl::InvalidArgumentError(
        "num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16 must be >= 0");
  }
  if (options.num_layers_at_start_in_bf16 > 0 || options.num_layers_at_end_in_bf16 > 0) {
    if (num_hidden_layers <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt.dir(),
                       "/config.json: num_hidden_layers (or text_config.num_hidden_layers) is "
                       "needed for --num-layers-at-start/end-in-bf16"));
    }
    exceptions.first_last_layers_bf16 = true;
    exceptions.num_layers = num_hidden_layers;
    exceptions.num_layers_at_start_in_bf16 = options.num_layers_at_start_in_bf16;
    exceptions.num_layers_at_end_in_bf16 = options.num_layers_at_end_in_bf16;
  }

  return exceptions;
}

// 1. Decisions, in shard and data-offset order.
absl::StatusOr<std::vector<Decided>> Decide(const Checkpoint& ckpt,
                                            const policy::PrecisionExceptions& exceptions) {
  std::vector<Decided> all;
  all.reserve(ckpt.num_tensors());
  for (size_t s = 0; s < ckpt.readers().size(); ++s) {
    const safetensors::Reader& r = *ckpt.readers()[s];
    for (const TensorInfo& t : r.tensors()) {
      absl::StatusOr<policy::OfflineDecision> d =
          policy::ClassifyOfflineTensor(t.desc(), exceptions);
      if (!d.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(r.path(), ": ", d.status().message()));
      }
      all.push_back(Decided{static_cast<int>(s), &t, *std::move(d)});
    }
  }

  return all;
}

// 2. Gate/up pairs over the whole checkpoint: each complete, with equal rank and expert count.
struct PairSlots {
  int gate = -1;
  int up = -1;
};
using Pairs = absl::flat_hash_map<std::string, PairSlots>;
absl::StatusOr<Pairs> PairUp(const Checkpoint& ckpt, const std::vector<Decided>& all) {
  Pairs pairs;
  for (size_t i = 0; i < all.size(); ++i) {
    const Decided& d = all[i];
    if (!d.decision.quantize) continue;
    const policy::PairRole role = d.decision.role;
    if (role != policy::PairRole::kGate && role != policy::PairRole::kUp) continue;
    PairSlots& p = pairs[d.decision.pair_base];
    int& slot = role == policy::PairRole::kGate ? p.gate : p.up;
    if (slot >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.readers()[d.shard]->path(), ": tensor '", d.info->name, "' and '",
          all[slot].info->name, "' are both the ", role == policy::PairRole::kGate ? "gate" : "up",
          " of '", d.decision.pair_base, "'; a gate/up pair must be a single complete pair"));
    }
    slot = static_cast<int>(i);
  }
  for (const auto& [base, p] : pairs) {
    if (p.gate >= 0 && p.up >= 0) {
      const Decided& g = all[p.gate];
      const Decided& u = all[p.up];
      const int64_t eg = g.info->shape.size() == 3 ? g.info->shape[0] : 1;
      const int64_t eu = u.info->shape.size() == 3 ? u.info->shape[0] : 1;
      if (g.info->shape.size() != u.info->shape.size() || eg != eu) {
        return absl::InvalidArgumentError(absl::StrCat(
            ckpt.readers()[u.shard]->path(), ": tensor '", u.info->name, "' has shape ",
            ShapeString(u.info->shape), " but its gate '", g.info->name, "' has ",
            ShapeString(g.info->shape), "; a pair needs equal rank and expert count"));
      }
      continue;
    }
    const Decided& d = all[p.gate >= 0 ? p.gate : p.up];
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.readers()[d.shard]->path(), ": tensor '", d.info->name, "' is the ",
        p.gate >= 0 ? "gate" : "up", " of '", base, "' but its ", p.gate >= 0 ? "up" : "gate",
        " partner is missing or kept in high precision (a gate/up pair shares one amax)"));
  }

  return pairs;
}

// 3. Output layouts per shard; returns each decided tensor's first output index.
absl::StatusOr<std::vector<size_t>> LayOutOutputs(const Checkpoint& ckpt,
                                                  const std::vector<Decided>& all,
                                                  ConvertPlan* out) {
  ConvertPlan& plan = *out;
  plan.outputs.resize(ckpt.readers().size());
  std::vector<size_t> out_index(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const Decided& d = all[i];
    std::vector<safetensors::OutputTensor>& outs = plan.outputs[d.shard];
    out_index[i] = outs.size();
    if (!d.decision.quantize) {
      outs.push_back({d.info->name, d.info->dtype, d.info->shape});
      ++plan.tensors_kept;
      continue;
    }
    if (d.info->shape.size() == 3 && d.info->shape[0] == 0) {
      // No slice, so no unit would ever write its scales: refused rather than half written.
      return absl::InvalidArgumentError(
          absl::StrCat(d.info->name, ": a stacked expert tensor of shape ",
                       ShapeString(d.info->shape), " holds no expert"));
    }
    ++plan.tensors_quantized;
    WPUB_ASSIGN_OR_RETURN(std::vector<TensorDesc> q, policy::Nvfp4OutputDescs(d.info->desc()));
    for (const TensorDesc& o : q) {
      outs.push_back({o.name, std::string(safetensors::DTypeName(o.dtype)), o.shape});
    }
    if (plan.input_scale) {
      outs.push_back({absl::StrCat(ModuleOf(d.info->name), ".input_scale"), "F32", {}});
    }
  }
  for (size_t s = 0; s < plan.outputs.size(); ++s) {
    for (const safetensors::OutputTensor& o : plan.outputs[s]) {
      plan.bytes_out += static_cast<uint64_t>(NumElements(o.shape)) *
                        static_cast<uint64_t>(*safetensors::DTypeSizeOf(o.dtype));
    }
  }

  return out_index;
}

// 4. Units in processing order; a pair becomes one unit where its first member is met, a
// stack is cut into units of at most max_unit_bytes of input.
void MakeUnits(const std::vector<Decided>& all, const Pairs& pairs,
               const std::vector<size_t>& out_index, uint64_t max_unit_bytes, ConvertPlan* out) {
  ConvertPlan& plan = *out;
  auto member = [&](size_t i) {
    const Decided& d = all[i];
    UnitMember m;
    m.shard = d.shard;
    m.info = d.info;
    m.out_index = out_index[i];
    if (d.decision.quantize) {
      m.type = ElemTypeOf(*d.info->wpub_dtype);
      m.cols = d.info->shape.back();
      m.rows = d.info->shape[d.info->shape.size() - 2];
    }
    return m;
  };
  std::vector<bool> done(all.size(), false);
  for (size_t i = 0; i < all.size(); ++i) {
    if (done[i]) continue;
    const Decided& d = all[i];
    Unit unit;
    unit.quantize = d.decision.quantize;
    unit.input_scale = plan.input_scale;
    if (!unit.quantize) {
      unit.members.push_back(member(i));
      plan.units.push_back(std::move(unit));
      continue;
    }
    const policy::PairRole role = d.decision.role;
    if (role == policy::PairRole::kGate || role == policy::PairRole::kUp) {
      const PairSlots& p = pairs.at(d.decision.pair_base);
      unit.members = {member(p.gate), member(p.up)};
      done[p.gate] = done[p.up] = true;
    } else {
      unit.members.push_back(member(i));
    }
    unit.stacked = d.info->shape.size() == 3;
    const int64_t slices = unit.stacked ? d.info->shape[0] : 1;
    uint64_t slice_bytes = 0;
    for (size_t m = 0; m < unit.members.size(); ++m) {
      const UnitMember& u = unit.members[m];
      slice_bytes +=
          static_cast<uint64_t>(u.rows) * static_cast<uint64_t>(u.cols) * kernels::ElemSize(u.type);
    }
    const int64_t per_unit = std::max<int64_t>(
        1, static_cast<int64_t>(max_unit_bytes / std::max<uint64_t>(slice_bytes, 1)));
    for (int64_t s = 0; s < slices; s += per_unit) {
      Unit piece = unit;
      piece.slice_begin = s;
      piece.slice_end = std::min(slices, s + per_unit);
      plan.units.push_back(std::move(piece));
    }
  }
}

// 5. Compact ignore list: everything left in high precision, as engines match modules.
void IgnoreList(const std::vector<Decided>& all, ConvertPlan* out) {
  ConvertPlan& plan = *out;
  absl::flat_hash_set<std::string> quantized_modules;
  absl::flat_hash_set<std::string> quantized_containers;
  for (const Decided& d : all) {
    if (!d.decision.quantize) continue;
    quantized_modules.insert(ModuleOf(d.info->name));
    quantized_containers.insert(ExpertContainer(d.info->name));
  }
  std::set<std::string> seen;
  auto add = [&](std::string entry) {
    if (seen.insert(entry).second) plan.ignore.push_back(std::move(entry));
  };
  for (const Decided& d : all) {
    if (d.decision.quantize) continue;
    const std::string& name = d.info->name;
    if (d.decision.reason == policy::Reason::kBf16Layer) {
      // Every module of a BF16 layer: one glob entry (SGLang and modelopt read `*` as a
      // wildcard over the rest of the module path).
      const std::string prefix = LayerPrefix(name);
      if (!prefix.empty()) {
        add(absl::StrCat(prefix, "*"));
        continue;
      }
    }
    if (policy::IsRoutedExpertHfName(name)) {
      const std::string container = ExpertContainer(name);
      if (!container.empty() && !quantized_containers.contains(container)) {
        add(container);
        continue;
      }
    }
    std::string module = ModuleOf(name);
    if (quantized_modules.contains(module)) continue;  // e.g. a bias beside a quantized weight
    add(std::move(module));
  }
}

}  // namespace

absl::StatusOr<ConvertPlan> BuildPlan(const Checkpoint& ckpt, const ConvertOptions& options,
                                      int64_t num_hidden_layers, uint64_t max_unit_bytes) {
  WPUB_ASSIGN_OR_RETURN(const policy::PrecisionExceptions exceptions,
                        Exceptions(ckpt, options, num_hidden_layers));
  WPUB_ASSIGN_OR_RETURN(const std::vector<Decided> all, Decide(ckpt, exceptions));
  WPUB_ASSIGN_OR_RETURN(const Pairs pairs, PairUp(ckpt, all));
  ConvertPlan plan;
  plan.input_scale = !options.weight_only;
  WPUB_ASSIGN_OR_RETURN(const std::vector<size_t> out_index, LayOutOutputs(ckpt, all, &plan));
  MakeUnits(all, pairs, out_index, max_unit_bytes, &plan);
  IgnoreList(all, &plan);
  return plan;
}

}  // namespace wpub::convert
