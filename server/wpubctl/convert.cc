// `wpubctl convert`: an HF safetensors checkpoint in, an NVFP4 (modelopt layout) checkpoint that
// SGLang and vLLM load out, with the daemon's policy and kernels (core/convert). Shows progress
// on a terminal and prints a summary table at the end.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/convert/convert.h"
#include "core/policy/settings.h"
#include "server/wpubctl/subcommand.h"

// Shared with policy-report (defined in policy_flags.cc).
ABSL_DECLARE_FLAG(std::optional<std::string>, recipe);
ABSL_DECLARE_FLAG(std::vector<std::string>, extra_high_precision_layers_hf);
ABSL_DECLARE_FLAG(int64_t, num_layers_at_start_in_bf16);
ABSL_DECLARE_FLAG(int64_t, num_layers_at_end_in_bf16);

ABSL_FLAG(std::string, model_dir, "",
          "convert: input HF checkpoint directory (model.safetensors.index.json + shards, or "
          "model.safetensors, and config.json).");
ABSL_FLAG(std::string, save_dir, "",
          "convert: output directory (must not exist or be empty; written only on success).");
ABSL_FLAG(std::string, device, "cpu", "convert: cpu (reference kernels) or cuda.");
ABSL_FLAG(std::string, four_over_six_metric, "mae", "convert with --recipe=4over6: mae or mse.");
ABSL_FLAG(int32_t, four_over_six_e4m3_max, 256, "convert with --recipe=4over6: 256 or 448.");
ABSL_FLAG(std::string, four_over_six_error, "exact",
          "convert with --recipe=4over6: exact or fp16 (TE's fast-math error).");
ABSL_FLAG(int32_t, cpu_threads, 0,
          "convert --device=cpu, inspect, diff: worker threads (0: all cores).");
ABSL_FLAG(uint64_t, staging_mb, 256,
          "convert --device=cuda: MiB of input per pinned staging buffer (two are used).");
ABSL_FLAG(std::string, quant_algo, "NVFP4",
          "convert: NVFP4 (W4A4: input_scale 1.0 per module, which W4A4 kernels use as the "
          "activation scale) or W4A16_NVFP4 (weight-only, no input_scale; vLLM's ModelOpt "
          "W4A16 loader). Same weight bytes either way.");
ABSL_FLAG(std::string, progress, "auto",
          "convert: auto (a live line on a terminal, a line every 10 s otherwise), always, never.");

namespace wpub::wpubctl {
namespace {

absl::StatusOr<kernels::QuantMode> ModeFromFlags() {
  const std::string recipe_name = absl::GetFlag(FLAGS_recipe).value_or("nvfp4");
  absl::StatusOr<policy::Recipe> recipe = policy::ParseRecipe(recipe_name);
  if (!recipe.ok()) return recipe.status();
  if (*recipe == policy::Recipe::kNvfp4) return kernels::QuantMode::Standard();
  if (*recipe != policy::Recipe::kNvfp4FourOverSix) {
    return absl::InvalidArgumentError(
        absl::StrCat("--recipe=", recipe_name, ": convert writes nvfp4 or 4over6"));
  }
  const std::string metric = absl::AsciiStrToLower(absl::GetFlag(FLAGS_four_over_six_metric));
  const std::string err = absl::AsciiStrToLower(absl::GetFlag(FLAGS_four_over_six_error));
  const int e = absl::GetFlag(FLAGS_four_over_six_e4m3_max);
  if (metric != "mae" && metric != "mse") {
    return absl::InvalidArgumentError("--four_over_six_metric must be mae or mse");
  }
  if (err != "exact" && err != "fp16") {
    return absl::InvalidArgumentError("--four_over_six_error must be exact or fp16");
  }
  if (e != 256 && e != 448) {
    return absl::InvalidArgumentError("--four_over_six_e4m3_max must be 256 or 448");
  }
  return kernels::QuantMode::FourOverSix(
      metric == "mae" ? kernels::ErrMetric::kMAE : kernels::ErrMetric::kMSE, e,
      err == "exact" ? kernels::ErrKind::kExact : kernels::ErrKind::kFP16);
}

std::string Duration(double s) {
  if (s < 0 || s > 1e7) return "--";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? absl::StrFormat("%dh%02dm", t / 3600, t / 60 % 60)
                   : absl::StrFormat("%dm%02ds", t / 60, t % 60);
}

// Prints progress to stderr: a rewritten line on a terminal, periodic lines otherwise.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(const std::string& mode)
      : live_(mode == "always" || (mode == "auto" && isatty(STDERR_FILENO))),
        enabled_(mode != "never") {}

  void Update(const convert::Progress& p) {
    if (!enabled_) return;
    const double interval = live_ ? 0.25 : 10.0;
    const bool last = p.bytes_done >= p.bytes_total && p.tensors_done >= p.tensors_total;
    if (last_done_ || (!last && p.seconds - last_print_ < interval)) return;
    last_done_ = last;
    last_print_ = p.seconds;
    const double gb = static_cast<double>(p.bytes_done) / 1e9;
    const double total = static_cast<double>(p.bytes_total) / 1e9;
    const double rate = p.seconds > 0 ? gb / p.seconds : 0;
    const double eta = rate > 0 ? (total - gb) / rate : -1;
    std::fprintf(stderr, "%s[convert] %lld/%lld tensors  %.2f/%.2f GB  %.3f GB/s  ETA %s%s",
                 live_ ? "\r" : "", static_cast<long long>(p.tensors_done),
                 static_cast<long long>(p.tensors_total), gb, total, rate, Duration(eta).c_str(),
                 live_ ? "   " : "\n");
    if (live_ && last) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  bool live_;
  bool enabled_;
  double last_print_ = -1e9;
  bool last_done_ = false;  // the final line is printed once
};

}  // namespace

int RunConvert(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "wpubctl convert: unexpected argument \"%s\" (flags only)\n",
                 args[0].c_str());
    return 2;
  }
  convert::ConvertOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model_dir);
  options.save_dir = absl::GetFlag(FLAGS_save_dir);
  const std::string device = absl::AsciiStrToLower(absl::GetFlag(FLAGS_device));
  if (device == "cuda" || device == "gpu") {
    options.device = convert::Device::kCuda;
  } else if (device != "cpu") {
    std::fprintf(stderr, "wpubctl convert: --device must be cpu or cuda, got \"%s\"\n",
                 device.c_str());
    return 2;
  }
  const std::string progress_mode = absl::GetFlag(FLAGS_progress);
  if (progress_mode != "auto" && progress_mode != "always" && progress_mode != "never") {
    std::fprintf(stderr, "wpubctl convert: --progress must be auto, always or never\n");
    return 2;
  }
  options.num_layers_at_start_in_bf16 = absl::GetFlag(FLAGS_num_layers_at_start_in_bf16);
  options.num_layers_at_end_in_bf16 = absl::GetFlag(FLAGS_num_layers_at_end_in_bf16);
  options.extra_high_precision_layers_hf = absl::GetFlag(FLAGS_extra_high_precision_layers_hf);
  absl::StatusOr<kernels::QuantMode> mode = ModeFromFlags();
  if (!mode.ok()) {
    std::fprintf(stderr, "wpubctl convert: %s\n", std::string(mode.status().message()).c_str());
    return 2;
  }
  options.mode = *mode;
  const std::string algo = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_quant_algo));
  if (algo != "NVFP4" && algo != "W4A16_NVFP4") {
    std::fprintf(stderr, "wpubctl convert: --quant_algo must be NVFP4 or W4A16_NVFP4, got \"%s\"\n",
                 absl::GetFlag(FLAGS_quant_algo).c_str());
    return 2;
  }
  options.weight_only = algo == "W4A16_NVFP4";
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.staging_bytes = absl::GetFlag(FLAGS_staging_mb) << 20;
  ProgressPrinter printer(progress_mode);
  options.on_progress = [&printer](const convert::Progress& p) { printer.Update(p); };

  std::fprintf(stderr, "[convert] %s -> %s on %s, mode %s\n", options.model_dir.c_str(),
               options.save_dir.c_str(), device.c_str(), options.mode.Name());
  absl::StatusOr<convert::ConvertSummary> summary = convert::ConvertCheckpoint(options);
  if (!summary.ok()) {
    std::fprintf(stderr, "\nwpubctl convert: %s\n", summary.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", convert::FormatSummary(*summary).c_str());
  return 0;
}

}  // namespace wpub::wpubctl
