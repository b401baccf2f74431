// ConvertCheckpoint: input checks, the temporary output directory, writers per shard, the
// executor run, the index / config.json / hf_quant_config.json, copies of every other file, and
// the final rename.
#include "core/convert/convert.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/status.h"
#include "core/convert/plan.h"
#include "core/safetensors/safetensors.h"

namespace wpub::convert {
namespace {

// hf_quant_config.json's producer version: this project's (the build sets WPUB_PROJECT_VERSION).
constexpr char kProducerVersion[] = "wpub " WPUB_PROJECT_VERSION;

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Removes the temporary output directory unless released (on success it has been renamed).
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  void Release() { path_.clear(); }

 private:
  fs::path path_;
};

absl::StatusOr<std::string> ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), ": cannot open"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::Status WriteText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out) return absl::InternalError(absl::StrCat(p.string(), ": cannot write"));
  return absl::OkStatus();
}

// num_hidden_layers of config.json or its text_config; -1 when absent.
int64_t NumHiddenLayers(const nlohmann::ordered_json& config) {
  for (const nlohmann::ordered_json* c :
       {&config, config.contains("text_config") ? &config["text_config"] : nullptr}) {
    if (c == nullptr || !c->is_object()) continue;
    auto it = c->find("num_hidden_layers");
    if (it != c->end() && it->is_number_integer()) return it->get<int64_t>();
  }
  return -1;
}

absl::Status CheckDirectories(const ConvertOptions& o) {
  if (o.model_dir.empty() || o.save_dir.empty()) {
    return absl::InvalidArgumentError("--model-dir and --save-dir are required");
  }
  std::error_code ec;
  if (!fs::is_directory(o.model_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(o.model_dir, ": input directory not found"));
  }
  const fs::path in = fs::weakly_canonical(o.model_dir, ec);
  const fs::path out = fs::weakly_canonical(o.save_dir, ec);
  if (in == out || fs::equivalent(o.model_dir, o.save_dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("output directory ", o.save_dir, " is the input directory ", o.model_dir));
  }
  if (fs::exists(o.save_dir, ec)) {
    if (!fs::is_directory(o.save_dir, ec) || !fs::is_empty(o.save_dir, ec)) {
      return absl::AlreadyExistsError(
          absl::StrCat("output directory ", o.save_dir, " exists and is not empty"));
    }
  }
  return absl::OkStatus();
}

// Copies every top-level entry of the input that the conversion does not produce.
absl::Status CopyOtherFiles(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(in, ec)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() == ".safetensors" || name == safetensors::kIndexFileName ||
        name == "config.json" || name == "hf_quant_config.json") {
      continue;
    }
    fs::copy(e.path(), out / name, fs::copy_options::recursive, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot copy ", e.path().string(), ": ", ec.message()));
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", in.string(), ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConvertSummary> ConvertCheckpoint(const ConvertOptions& options) {
  const Clock::time_point start = Clock::now();
  if (!options.mode.IsValid()) return absl::InvalidArgumentError("invalid quantization mode");
  WPUB_RETURN_IF_ERROR(CheckDirectories(options));
  const fs::path in_dir(options.model_dir);
  const fs::path config_path = in_dir / "config.json";
  WPUB_ASSIGN_OR_RETURN(std::string config_text, ReadText(config_path));
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(config_text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": not a JSON object"));
  }
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Checkpoint> ckpt,
                        safetensors::Checkpoint::Open(options.model_dir));
  const uint64_t unit_bytes = std::max<uint64_t>(options.staging_bytes, 1 << 20);
  WPUB_ASSIGN_OR_RETURN(ConvertPlan plan,
                        BuildPlan(*ckpt, options, NumHiddenLayers(config), unit_bytes));
  std::unique_ptr<Executor> executor;
  if (options.device == Device::kCuda) {
    WPUB_ASSIGN_OR_RETURN(executor, CreateCudaExecutor(options));
  } else {
    executor = CreateCpuExecutor(options);
  }

  // Everything is written under a hidden sibling of save_dir and renamed at the end.
  const fs::path out_dir = fs::absolute(options.save_dir).lexically_normal();
  const fs::path parent =
      out_dir.has_filename() ? out_dir.parent_path() : out_dir.parent_path().parent_path();
  const std::string leaf = out_dir.has_filename() ? out_dir.filename().string()
                                                  : out_dir.parent_path().filename().string();
  std::error_code ec;
  // Missing parents of save_dir are created, and removed again if the conversion fails.
  fs::path created_top;
  for (fs::path p = parent; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) created_top = p;
  fs::create_directories(parent, ec);
  TempDirGuard parents_guard(created_top);
  const fs::path tmp = parent / absl::StrCat(".", leaf, ".wpub-convert-", ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) {
    return absl::InternalError(absl::StrCat("cannot create ", tmp.string(), ": ", ec.message()));
  }
  TempDirGuard guard(tmp);

  std::vector<std::unique_ptr<safetensors::Writer>> owned;
  std::vector<safetensors::Writer*> writers;
  std::vector<std::pair<std::string, std::string>> weight_map;
  for (size_t s = 0; s < ckpt->shard_names().size(); ++s) {
    const std::string& shard = ckpt->shard_names()[s];
    fs::create_directories((tmp / shard).parent_path(), ec);
    WPUB_ASSIGN_OR_RETURN(
        std::unique_ptr<safetensors::Writer> w,
        safetensors::Writer::Create((tmp / shard).string(), plan.outputs[s], {{"format", "pt"}}));
    for (const safetensors::OutputTensor& t : plan.outputs[s])
      weight_map.emplace_back(t.name, shard);
    writers.push_back(w.get());
    owned.push_back(std::move(w));
  }

  ConvertSummary summary;
  summary.device = options.device;
  summary.quant_algo = options.weight_only ? "W4A16_NVFP4" : "NVFP4";
  summary.tensors_in = static_cast<int64_t>(ckpt->num_tensors());
  summary.tensors_quantized = plan.tensors_quantized;
  summary.tensors_kept = plan.tensors_kept;
  summary.bytes_in = ckpt->total_tensor_bytes();
  summary.bytes_out = plan.bytes_out;
  summary.shards = static_cast<int64_t>(writers.size());
  summary.ignore_entries = static_cast<int64_t>(plan.ignore.size());
  for (const auto& outs : plan.outputs) summary.tensors_out += static_cast<int64_t>(outs.size());

  Progress progress;
  progress.tensors_total = summary.tensors_in;
  progress.bytes_total = summary.bytes_in;
  const Clock::time_point run_start = Clock::now();
  auto on_unit = [&](size_t i) {
    const Unit& u = plan.units[i];
    progress.bytes_done += u.input_bytes();
    if (!u.quantize || u.slice_end == (u.stacked ? u.members[0].info->shape[0] : 1)) {
      progress.tensors_done += static_cast<int64_t>(u.members.size());
    }
    progress.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
    if (options.on_progress) options.on_progress(progress);
  };
  WPUB_RETURN_IF_ERROR(executor->Run(*ckpt, plan, writers, on_unit, &summary.nonfinite_elements));
  for (safetensors::Writer* w : writers) WPUB_RETURN_IF_ERROR(w->Finish());
  owned.clear();

  WPUB_RETURN_IF_ERROR(WriteText(tmp / std::string(safetensors::kIndexFileName),
                                 safetensors::IndexJson(plan.bytes_out, weight_map)));
  nlohmann::ordered_json qc;
  qc["quant_algo"] = summary.quant_algo;
  qc["quant_method"] = "modelopt";
  qc["group_size"] = 16;
  qc["kv_cache_quant_algo"] = nullptr;  // the KV cache stays unquantized
  qc["ignore"] = plan.ignore;
  config["quantization_config"] = qc;
  WPUB_RETURN_IF_ERROR(WriteText(tmp / "config.json", config.dump(2) + "\n"));
  nlohmann::ordered_json hf;
  // ModelOpt's layout (the loaders read "quantization"; "producer" is informational).
  hf["producer"] = {{"name", "modelopt"}, {"version", kProducerVersion}};
  nlohmann::ordered_json quant;
  quant["quant_algo"] = summary.quant_algo;
  // vLLM's nested-format reader requires the key (null: no KV-cache quantization); older
  // SGLang indexes it directly.
  quant["kv_cache_quant_algo"] = nullptr;
  quant["group_size"] = 16;
  quant["exclude_modules"] = plan.ignore;
  hf["quantization"] = quant;
  WPUB_RETURN_IF_ERROR(WriteText(tmp / "hf_quant_config.json", hf.dump(2) + "\n"));
  WPUB_RETURN_IF_ERROR(CopyOtherFiles(in_dir, tmp));

  if (fs::exists(out_dir, ec)) fs::remove(out_dir, ec);  // checked empty above
  fs::rename(tmp, out_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp.string(), " to ", out_dir.string(), ": ", ec.message()));
  }
  guard.Release();
  parents_guard.Release();
  progress.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
  progress.tensors_done = progress.tensors_total;
  if (options.on_progress) options.on_progress(progress);
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return summary;
}

std::string FormatSummary(const ConvertSummary& s) {
  const double gb_in = static_cast<double>(s.bytes_in) / 1e9;
  const double gb_out = static_cast<double>(s.bytes_out) / 1e9;
  std::string out;
  absl::StrAppendFormat(&out, "%-28s %s\n", "device", s.device == Device::kCuda ? "cuda" : "cpu");
  absl::StrAppendFormat(&out, "%-28s %d\n", "shards", s.shards);
  absl::StrAppendFormat(&out, "%-28s %d\n", "tensors in", s.tensors_in);
  absl::StrAppendFormat(&out, "%-28s %s\n", "quant_algo", s.quant_algo);
  absl::StrAppendFormat(&out, "%-28s %d (-> %d tensors each)\n", "tensors quantized (NVFP4)",
                        s.tensors_quantized, s.quant_algo == "W4A16_NVFP4" ? 3 : 4);
  absl::StrAppendFormat(&out, "%-28s %d\n", "tensors kept", s.tensors_kept);
  absl::StrAppendFormat(&out, "%-28s %d\n", "tensors out", s.tensors_out);
  absl::StrAppendFormat(&out, "%-28s %.3f GB (%d bytes)\n", "bytes in", gb_in, s.bytes_in);
  absl::StrAppendFormat(&out, "%-28s %.3f GB (%d bytes)\n", "bytes out", gb_out, s.bytes_out);
  absl::StrAppendFormat(&out, "%-28s %d\n", "ignore list entries", s.ignore_entries);
  absl::StrAppendFormat(&out, "%-28s %d\n", "non-finite elements", s.nonfinite_elements);
  absl::StrAppendFormat(&out, "%-28s %.2f\n", "seconds", s.seconds);
  absl::StrAppendFormat(&out, "%-28s %.3f GB/s of input\n", "throughput",
                        s.seconds > 0 ? gb_in / s.seconds : 0.0);
  return out;
}

}  // namespace wpub::convert
