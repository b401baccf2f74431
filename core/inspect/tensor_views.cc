// Reading a snapshot's tensors: module names, float decoding, NVFP4 modules, checksums.
#include "core/inspect/tensor_views.h"

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

std::optional<Nvfp4Parts> FindNvfp4(const Snapshot& snapshot, const Tensor& weight,
                                    std::string* orphan) {
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

bool IsEmbedding(absl::string_view module) {
  return absl::EndsWith(module, "embed_tokens") || absl::EndsWith(module, "word_embeddings") ||
         absl::EndsWith(module, "wte") || absl::EndsWith(module, "embed_in");
}

int InspectThreads(int threads) {
  // More threads than the hardware's only add contention (and one per tensor could exhaust the
  // process's thread limit).
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return threads <= 0 ? hardware : std::min(threads, hardware);
}

std::vector<uint64_t> Checksums(const std::vector<Tensor>& tensors, int threads) {
  std::vector<uint64_t> out(tensors.size());
  ParallelFor(tensors.size(), InspectThreads(threads), [&](size_t i) {
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

}  // namespace wpub::inspect
