// The tensor-by-tensor diff of two snapshots, its text and JSON forms.
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
  ParallelFor(pairs.size(), InspectThreads(threads), [&](size_t k) {
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
