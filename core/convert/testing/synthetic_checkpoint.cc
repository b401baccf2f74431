// Synthetic HF checkpoint writer (tests and benchmark).
#include "core/convert/testing/synthetic_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "core/common/status.h"
#include "core/safetensors/safetensors.h"

namespace wpub::convert::testing {
namespace {

namespace fs = std::filesystem;

bool IsGate(const std::string& name) {
  return absl::EndsWith(name, ".gate_proj.weight") || absl::EndsWith(name, ".w1.weight");
}

absl::Status WriteFile(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out.flush()) return absl::InternalError("cannot write " + p.string());
  return absl::OkStatus();
}

}  // namespace

std::vector<TensorDesc> HfTensors(const synthetic::SyntheticModel& model) {
  std::vector<TensorDesc> out;
  for (const synthetic::ConversionBatch& b : model.batches()) {
    for (const TensorDesc& t : b.tensors) out.push_back(t);
  }
  return out;
}

absl::Status WriteSyntheticCheckpoint(const std::string& dir, const CheckpointSpec& spec) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError("cannot create " + dir + ": " + ec.message());
  const int n = std::max(1, std::min<int>(spec.num_shards, static_cast<int>(spec.tensors.size())));

  // Shard boundaries by bytes, then moved to just after a gate so a pair straddles them.
  uint64_t total = 0;
  for (const TensorDesc& t : spec.tensors) total += static_cast<uint64_t>(t.nbytes());
  std::vector<size_t> first(n + 1, spec.tensors.size());
  first[0] = 0;
  uint64_t acc = 0;
  int shard = 1;
  for (size_t i = 0; i < spec.tensors.size() && shard < n; ++i) {
    acc += static_cast<uint64_t>(spec.tensors[i].nbytes());
    if (acc * n < total * shard) continue;
    size_t cut = i + 1;
    if (spec.split_pairs) {
      size_t j = i;
      while (j < spec.tensors.size() && !IsGate(spec.tensors[j].name)) ++j;
      if (j + 1 < spec.tensors.size()) cut = j + 1;
    }
    if (cut <= first[shard - 1] || cut >= spec.tensors.size()) continue;
    first[shard++] = cut;
    for (size_t k = i + 1; k < cut; ++k) acc += static_cast<uint64_t>(spec.tensors[k].nbytes());
    i = cut - 1;
  }
  const int shards = shard;  // a short list may give fewer shards than asked
  first[shards] = spec.tensors.size();

  std::vector<std::string> names(shards);
  for (int s = 0; s < shards; ++s) {
    names[s] = shards == 1 ? std::string(safetensors::kSingleFileName)
                           : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards);
  }
  std::vector<std::unique_ptr<safetensors::Writer>> writers;
  std::vector<std::pair<std::string, std::string>> weight_map;
  for (int s = 0; s < shards; ++s) {
    std::vector<safetensors::OutputTensor> outs;
    for (size_t i = first[s]; i < first[s + 1]; ++i) {
      const TensorDesc& t = spec.tensors[i];
      outs.push_back({t.name, std::string(safetensors::DTypeName(t.dtype)), t.shape});
      weight_map.emplace_back(t.name, names[s]);
    }
    WPUB_ASSIGN_OR_RETURN(auto w, safetensors::Writer::Create((fs::path(dir) / names[s]).string(),
                                                              std::move(outs), {{"format", "pt"}}));
    writers.push_back(std::move(w));
  }

  // Fill and write tensors on worker threads (each tensor goes to one writer index).
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status status;
  auto work = [&]() {
    std::vector<uint8_t> buf;
    for (size_t i = next++; i < spec.tensors.size(); i = next++) {
      const TensorDesc& t = spec.tensors[i];
      const int s =
          static_cast<int>(std::upper_bound(first.begin(), first.begin() + shards + 1, i) -
                           first.begin()) -
          1;
      buf.resize(static_cast<size_t>(t.nbytes()));
      absl::Status st;
      if (IsQuantizableFloat(t.dtype)) {
        st = synthetic::FillTensor(t, spec.seed, absl::MakeSpan(buf));
      } else {
        for (size_t k = 0; k < buf.size(); ++k) buf[k] = static_cast<uint8_t>(k * 31 + i);
      }
      if (st.ok()) st = writers[s]->Write(i - first[s], 0, buf);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (status.ok()) status = st;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int k = 0; k < std::max(1, spec.threads); ++k) pool.emplace_back(work);
  for (std::thread& t : pool) t.join();
  WPUB_RETURN_IF_ERROR(status);
  uint64_t total_size = 0;
  for (auto& w : writers) {
    for (size_t i = 0; i < w->tensors().size(); ++i) total_size += w->nbytes(i);
    WPUB_RETURN_IF_ERROR(w->Finish());
  }
  if (shards > 1) {
    WPUB_RETURN_IF_ERROR(WriteFile(fs::path(dir) / std::string(safetensors::kIndexFileName),
                                   safetensors::IndexJson(total_size, weight_map)));
  }
  nlohmann::ordered_json config;
  config["architectures"] = {"SyntheticMoeForCausalLM"};
  config["model_type"] = "synthetic_moe";
  if (spec.nest_in_text_config) {
    config["text_config"] = {{"num_hidden_layers", spec.num_hidden_layers}};
  } else {
    config["num_hidden_layers"] = spec.num_hidden_layers;
  }
  config["torch_dtype"] = "bfloat16";
  WPUB_RETURN_IF_ERROR(WriteFile(fs::path(dir) / "config.json", config.dump(2) + "\n"));
  WPUB_RETURN_IF_ERROR(WriteFile(fs::path(dir) / "tokenizer.json", "{\"version\": \"1.0\"}\n"));
  fs::create_directories(fs::path(dir) / "extra", ec);
  WPUB_RETURN_IF_ERROR(WriteFile(fs::path(dir) / "extra" / "notes.txt", "synthetic\n"));
  return absl::OkStatus();
}

}  // namespace wpub::convert::testing
