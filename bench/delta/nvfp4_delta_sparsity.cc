// How much of a served NVFP4 weight changes from one RL step to the next (a program, not a test;
// CPU only, the reference quantizer of kernels/reference.h, so anyone can rerun it anywhere).
//
// The update model (stated, not measured from a trainer): an fp32 master copy of one routed
// expert weight, initialised N(0, init_std); every step a gradient of i.i.d. N(0, 1) entries
// (independent from step to step), one AdamW step (beta1 0.9, beta2 0.999, eps 1e-8, no weight
// decay, bias-corrected) at learning rate `lr`; the served weight is the bf16 copy of the master
// (round to nearest even) quantized to NVFP4 with one global scale per tensor. After each step
// the new NVFP4 tensor is compared with the previous step's:
//   elements  the fraction of 4-bit codes that changed,
//   blocks    the fraction of 16-element blocks whose codes or scale changed (what a block
//             delta ships),
//   scales    the fraction of block scales (e4m3) that changed,
//   global    whether the tensor's global scale (its amax) changed,
//   bf16      the fraction of bf16 elements that changed (what a BF16 delta ships),
// and the bytes a block delta would carry (each changed block's 8 code bytes + 1 scale byte + a
// 4-byte block index) against the full tensor's (codes + scales + global scale), and the bytes
// of the bucket patch wpubd --patches sends (core/delta/bucket_patch.h: the changed 8-byte word
// runs of a bucket holding the codes, the scales and the global scale; and of the bf16 copy, as a
// layer kept in bf16 would be patched). Steps after the first
// `warmup` are averaged (Adam's early steps are larger: bias correction).
//
// Usage: nvfp4_delta_sparsity [--rows 768] [--cols 2048] [--steps 12] [--warmup 2]
//        [--lrs 1e-7,1e-6,1e-5] [--init_std 0.02] [--seed 2026] [--threads 0] [--json FILE]
// Prints one line per (recipe, lr): standard NVFP4 and 4over6 (docs/specs/nvfp4.md).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/delta/bucket_patch.h"
#include "core/transport/checksum.h"
#include "kernels/nvfp4_math.h"
#include "kernels/reference.h"
#include "nlohmann/json.hpp"

namespace wpub::bench {
namespace {

using json = nlohmann::json;

struct Args {
  // Qwen3-30B-A3B's routed expert gate/up projection [768, 2048] (down_proj is [2048, 768]).
  int64_t rows = 768;
  int64_t cols = 2048;  // a multiple of 16
  int steps = 12;
  int warmup = 2;
  std::vector<double> lrs = {1e-7, 1e-6, 1e-5};
  double init_std = 0.02;
  uint64_t seed = 2026;
  int threads = 0;
  std::string json_path;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr, "nvfp4_delta_sparsity: %s\n", why.c_str());
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--rows") {
      ok = absl::SimpleAtoi(v, &a.rows) && a.rows > 0;
    } else if (k == "--cols") {
      ok = absl::SimpleAtoi(v, &a.cols) && a.cols > 0 && a.cols % 16 == 0;
    } else if (k == "--steps") {
      ok = absl::SimpleAtoi(v, &a.steps) && a.steps > 0;
    } else if (k == "--warmup") {
      ok = absl::SimpleAtoi(v, &a.warmup) && a.warmup >= 0;
    } else if (k == "--lrs") {
      a.lrs.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        double lr = 0;
        ok = ok && absl::SimpleAtod(s, &lr) && lr > 0;
        a.lrs.push_back(lr);
      }
    } else if (k == "--init_std") {
      ok = absl::SimpleAtod(v, &a.init_std) && a.init_std > 0;
    } else if (k == "--seed") {
      ok = absl::SimpleAtoi(v, &a.seed);
    } else if (k == "--threads") {
      ok = absl::SimpleAtoi(v, &a.threads) && a.threads >= 0;
    } else if (k == "--json") {
      a.json_path = v;
    } else {
      Usage("unknown flag " + k);
    }
    if (!ok) Usage("bad value '" + v + "' for " + k);
  }
  if (argc % 2 == 0) Usage("every flag takes a value");
  if (a.warmup >= a.steps) Usage("--warmup must be below --steps");
  return a;
}

// One NVFP4 tensor as served: codes (two per byte), e4m3 block scales, the global decode scale.
struct Served {
  std::vector<uint8_t> packed, scales;
  float decode_scale = 0;
};

Served Quantize(const std::vector<uint16_t>& bf16, const Args& a, kernels::QuantMode mode) {
  Served s;
  s.packed.resize(static_cast<size_t>(a.rows * a.cols / 2));
  s.scales.resize(static_cast<size_t>(a.rows * a.cols / 16));
  const kernels::WeightDesc w =
      kernels::WeightDesc::Dense(bf16.data(), a.rows, a.cols, kernels::ElemType::kBF16);
  kernels::QuantOutput out;
  out.packed = s.packed.data();
  out.scales = s.scales.data();
  out.decode_scale = &s.decode_scale;
  kernels::CpuOptions o;
  o.num_threads = a.threads;
  std::string error;
  if (kernels::Quantize(w, nullptr, mode, out, o, &error) != kernels::KernelStatus::kOk) {
    std::fprintf(stderr, "quantize: %s\n", error.c_str());
    std::exit(1);
  }
  return s;
}

struct StepDelta {
  double elements = 0, blocks = 0, scales = 0, bf16 = 0, delta_bytes = 0, patch_bytes = 0;
  double bf16_patch = 0;  // the bucket patch of the bf16 copy (a layer kept bf16), a fraction
  // The same in format 1 (word runs), what wpubd sent before units.
  double patch_runs_bytes = 0, bf16_patch_runs = 0;
  bool global = false;
};

// The tensor as a bucket holds it: codes, scales, the decode scale, back to back.
std::vector<uint8_t> AsBucket(const Served& s) {
  std::vector<uint8_t> b(s.packed);
  b.insert(b.end(), s.scales.begin(), s.scales.end());
  const auto* f = reinterpret_cast<const uint8_t*>(&s.decode_scale);
  b.insert(b.end(), f, f + 4);
  return b;
}

// The bytes wpubd --patches sends for a bucket of these bytes (its patch, format 2 units, or
// the bucket when a patch is not worth it); in format 1 what it sent before.
double PatchBytes(const std::vector<uint8_t>& bx, const std::vector<uint8_t>& by,
                  delta::PatchFormat format = delta::PatchFormat::kUnits) {
  const delta::BucketPatchPlan plan =
      delta::DiffBucket(bx, transport::Checksum(bx.data(), bx.size()), by,
                        transport::Checksum(by.data(), by.size()), {.format = format});
  return static_cast<double>(plan.full ? by.size() : plan.patch.size());
}

StepDelta Compare(const Served& x, const Served& y, const std::vector<uint16_t>& bx,
                  const std::vector<uint16_t>& by) {
  StepDelta d;
  const size_t blocks = x.scales.size();
  uint64_t codes_changed = 0, blocks_changed = 0, scales_changed = 0, bf16_changed = 0;
  for (size_t b = 0; b < blocks; ++b) {
    bool changed = x.scales[b] != y.scales[b];
    scales_changed += changed;
    for (size_t i = 0; i < 8; ++i) {
      const uint8_t p = x.packed[b * 8 + i], q = y.packed[b * 8 + i];
      codes_changed += ((p & 0x0F) != (q & 0x0F)) + ((p >> 4) != (q >> 4));
      changed = changed || p != q;
    }
    blocks_changed += changed;
  }
  for (size_t i = 0; i < bx.size(); ++i) bf16_changed += bx[i] != by[i];
  d.elements = static_cast<double>(codes_changed) / (blocks * 16);
  d.blocks = static_cast<double>(blocks_changed) / blocks;
  d.scales = static_cast<double>(scales_changed) / blocks;
  d.bf16 = static_cast<double>(bf16_changed) / bx.size();
  d.global = x.decode_scale != y.decode_scale;
  // A changed block: its 8 code bytes, its scale byte and a 4-byte index; a changed global
  // scale ships every block (each block's codes and scale are relative to it).
  d.delta_bytes = d.global ? static_cast<double>(x.packed.size() + x.scales.size() + 4)
                           : static_cast<double>(blocks_changed) * (8 + 1 + 4) + 4;
  const std::vector<uint8_t> qx = AsBucket(x), qy = AsBucket(y);
  d.patch_bytes = PatchBytes(qx, qy);
  d.patch_runs_bytes = PatchBytes(qx, qy, delta::PatchFormat::kWordRuns);
  const auto* px = reinterpret_cast<const uint8_t*>(bx.data());
  const auto* py = reinterpret_cast<const uint8_t*>(by.data());
  const std::vector<uint8_t> wx(px, px + 2 * bx.size()), wy(py, py + 2 * by.size());
  d.bf16_patch = PatchBytes(wx, wy) / (2.0 * bx.size());
  d.bf16_patch_runs = PatchBytes(wx, wy, delta::PatchFormat::kWordRuns) / (2.0 * bx.size());
  return d;
}

json Run(const Args& a, double lr, kernels::QuantMode mode, const char* recipe) {
  const size_t n = static_cast<size_t>(a.rows * a.cols);
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> init(0.0f, static_cast<float>(a.init_std)), grad(0.0f, 1.0f);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : master) x = init(rng);
  std::vector<uint16_t> bf16(n), prev_bf16;
  const auto cast = [&] {
    for (size_t i = 0; i < n; ++i) bf16[i] = kernels::FloatToBf16(master[i]);
  };
  cast();
  Served prev = Quantize(bf16, a, mode);
  prev_bf16 = bf16;
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  std::vector<StepDelta> steps;
  for (int t = 1; t <= a.steps; ++t) {
    const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < n; ++i) {
      const float g = grad(rng);
      m[i] = static_cast<float>(b1 * m[i] + (1 - b1) * g);
      v[i] = static_cast<float>(b2 * v[i] + (1 - b2) * g * g);
      const double step = lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
      master[i] = static_cast<float>(master[i] - step);
    }
    cast();
    Served now = Quantize(bf16, a, mode);
    steps.push_back(Compare(prev, now, prev_bf16, bf16));
    prev = std::move(now);
    prev_bf16 = bf16;
  }
  StepDelta mean;
  int globals = 0;
  const int counted = a.steps - a.warmup;
  for (int t = a.warmup; t < a.steps; ++t) {
    mean.elements += steps[t].elements / counted;
    mean.blocks += steps[t].blocks / counted;
    mean.scales += steps[t].scales / counted;
    mean.bf16 += steps[t].bf16 / counted;
    mean.delta_bytes += steps[t].delta_bytes / counted;
    mean.patch_bytes += steps[t].patch_bytes / counted;
    mean.bf16_patch += steps[t].bf16_patch / counted;
    mean.patch_runs_bytes += steps[t].patch_runs_bytes / counted;
    mean.bf16_patch_runs += steps[t].bf16_patch_runs / counted;
    globals += steps[t].global;
  }
  const double full = static_cast<double>(prev.packed.size() + prev.scales.size() + 4);
  std::printf(
      "%-8s lr %-7.0e bf16 %7.3f%%  nvfp4 elements %7.4f%%  blocks %7.4f%%  block scales %7.4f%%"
      "  global scale changed %d/%d steps  delta %7.3f%% of the full tensor  bucket patch "
      "%7.3f%% (word runs %7.3f%%)  bf16 copy's bucket patch %6.2f%% (word runs %6.2f%%)\n",
      recipe, lr, 100 * mean.bf16, 100 * mean.elements, 100 * mean.blocks, 100 * mean.scales,
      globals, counted, 100 * mean.delta_bytes / full, 100 * mean.patch_bytes / full,
      100 * mean.patch_runs_bytes / full, 100 * mean.bf16_patch, 100 * mean.bf16_patch_runs);
  json per_step = json::array();
  for (const StepDelta& s : steps) {
    per_step.push_back({{"bf16", s.bf16},
                        {"elements", s.elements},
                        {"blocks", s.blocks},
                        {"scales", s.scales},
                        {"global", s.global},
                        {"delta_bytes", s.delta_bytes},
                        {"patch_bytes", s.patch_bytes},
                        {"bf16_patch_fraction", s.bf16_patch},
                        {"patch_runs_bytes", s.patch_runs_bytes},
                        {"bf16_patch_runs_fraction", s.bf16_patch_runs}});
  }
  return {{"recipe", recipe},
          {"lr", lr},
          {"bf16_changed", mean.bf16},
          {"elements_changed", mean.elements},
          {"blocks_changed", mean.blocks},
          {"scales_changed", mean.scales},
          {"global_changed_steps", globals},
          {"steps_counted", counted},
          {"delta_bytes", mean.delta_bytes},
          {"full_bytes", full},
          {"delta_over_full", mean.delta_bytes / full},
          {"patch_bytes", mean.patch_bytes},
          {"patch_over_full", mean.patch_bytes / full},
          {"bf16_patch_fraction", mean.bf16_patch},
          {"patch_runs_over_full", mean.patch_runs_bytes / full},
          {"bf16_patch_runs_fraction", mean.bf16_patch_runs},
          {"steps", per_step}};
}

int Main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::printf(
      "one [%ld, %ld] weight, fp32 master N(0, %.3g), AdamW on i.i.d. N(0,1) gradients, %d steps "
      "(the first %d not averaged), served as bf16 -> NVFP4\n",
      static_cast<long>(a.rows), static_cast<long>(a.cols), a.init_std, a.steps, a.warmup);
  json rows = json::array();
  for (const auto& [mode, name] : {std::pair{kernels::QuantMode::Standard(), "standard"},
                                   std::pair{kernels::QuantMode::FourOverSixDefault(), "4over6"}}) {
    for (double lr : a.lrs) rows.push_back(Run(a, lr, mode, name));
  }
  if (!a.json_path.empty()) {
    json out = {{"rows", a.rows},
                {"cols", a.cols},
                {"steps", a.steps},
                {"warmup", a.warmup},
                {"init_std", a.init_std},
                {"seed", a.seed},
                {"model", "fp32 master, AdamW(0.9, 0.999, 1e-8) on i.i.d. N(0,1) gradients"},
                {"results", rows}};
    std::ofstream(a.json_path) << out.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace wpub::bench

int main(int argc, char** argv) { return wpub::bench::Main(argc, argv); }
