// Offline checkpoint conversion (specs/policy.md "Offline conversion"): an HF safetensors
// checkpoint in, a checkpoint whose routed-expert GEMM weights are NVFP4 (modelopt layout that
// SGLang and vLLM load) out, using the publication policy's offline classifier and the same
// NVFP4 kernels as the daemon: the CPU reference, or the CUDA launchers when built with CUDA.
// Both paths produce byte-identical files.
//
// ConvertCheckpoint blocks until the conversion is complete or failed. It writes into a
// temporary directory next to save_dir and renames it to save_dir only on success; on any error
// save_dir is left as it was (absent or empty) and the temporary directory is removed.
// Thread-safety: independent calls may run concurrently on different directories; the progress
// callback runs on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/nvfp4_math.h"

namespace wpub::convert {

enum class Device : uint8_t { kCpu, kCuda };

struct Progress {
  int64_t tensors_done = 0;
  int64_t tensors_total = 0;  // input tensors
  uint64_t bytes_done = 0;    // input bytes
  uint64_t bytes_total = 0;
  double seconds = 0;  // since the conversion started
};

struct ConvertOptions {
  std::string model_dir;  // input: model.safetensors.index.json + shards, or model.safetensors
  std::string save_dir;   // output: must not exist, or be an empty directory; not model_dir
  Device device = Device::kCpu;
  // Layers model.layers.{i}. with i < start or i >= num_hidden_layers - end stay high precision;
  // num_hidden_layers comes from config.json (or its text_config).
  int64_t num_layers_at_start_in_bf16 = 0;
  int64_t num_layers_at_end_in_bf16 = 0;
  // A tensor whose HF name contains any of these substrings stays high precision.
  std::vector<std::string> extra_high_precision_layers_hf;
  // Standard NVFP4 or one of the eight 4over6 modes (same tensor layout).
  kernels::QuantMode mode = kernels::QuantMode::Standard();
  // false: quant_algo "NVFP4" (W4A4), each NVFP4 module with input_scale = 1.0, which W4A4
  // kernels (Blackwell) use as the activation scale. true: quant_algo "W4A16_NVFP4" (weight-only:
  // activations stay bf16), no input_scale; the weight bytes are the same. README says which
  // engines load which.
  bool weight_only = false;
  // CPU path: worker threads per quantize call (0: all hardware threads). CUDA path: host
  // threads that read inputs into and write results from the pinned buffers (0: up to 8).
  int cpu_threads = 0;
  // CUDA path: bytes of input per staging buffer (two are used, so the next batch is read
  // while the current one is quantized). Stacked expert tensors are split by slices to fit;
  // a single slice or rank-2 tensor larger than this enlarges the buffers.
  uint64_t staging_bytes = uint64_t{256} << 20;
  // Called after each tensor batch and once at the end (may be empty).
  std::function<void(const Progress&)> on_progress;
};

struct ConvertSummary {
  int64_t tensors_in = 0;
  int64_t tensors_quantized = 0;  // input tensors written as NVFP4 (4 output tensors each, 3
                                  // when weight_only)
  int64_t tensors_kept = 0;       // input tensors copied unchanged
  int64_t tensors_out = 0;
  uint64_t bytes_in = 0;   // tensor bytes read
  uint64_t bytes_out = 0;  // tensor bytes written
  int64_t shards = 0;
  int64_t nonfinite_elements = 0;  // NaN/inf elements met in quantized tensors
  int64_t ignore_entries = 0;      // length of the written ignore list
  double seconds = 0;
  Device device = Device::kCpu;
  std::string quant_algo;  // as written to the configs: "NVFP4" or "W4A16_NVFP4"
};

// Converts options.model_dir into options.save_dir. Errors (nothing written to save_dir) name
// the file and tensor: anything safetensors::Checkpoint::Open rejects, K % 16 != 0 on an expert
// weight, an incomplete gate/up pair, pair halves with different slice counts, save_dir equal to
// model_dir or not empty, config.json missing or without
// num_hidden_layers when BF16 head/tail layers are asked for, --device cuda without a GPU or in
// a build without CUDA, I/O errors.
absl::StatusOr<ConvertSummary> ConvertCheckpoint(const ConvertOptions& options);

// The end-of-run table: tensors quantized / kept, bytes in / out, seconds, throughput.
std::string FormatSummary(const ConvertSummary& summary);

}  // namespace wpub::convert
