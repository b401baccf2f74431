// Internal to core/inspect (inspect.cc, diff.cc, snapshot.cc): how a snapshot's tensors are
// read -- module names, float decoding, NVFP4 modules found and validated, checksums -- and
// printed. Not part of the library's interface.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/inspect/inspect.h"

namespace wpub::inspect {

// The module of a tensor name (everything before its last dot).
std::string ModuleOf(absl::string_view name);
// 0x-prefixed 16 hex digits.
std::string Hex(uint64_t v);
// A byte count with its binary unit ("1.500 MiB").
std::string Bytes(uint64_t n);
// A little-endian float32 at `p`.
float LoadF32(const uint8_t* p);
// Element value of a float dtype; nullopt for any other dtype.
struct FloatDecoder {
  int64_t size = 0;
  float (*decode)(const uint8_t*) = nullptr;
};
// The element decoder of a float dtype (BF16, F16, F32, F8_E4M3); nullopt for any other.
std::optional<FloatDecoder> DecoderFor(absl::string_view dtype);

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
                                    std::string* orphan = nullptr);

// Embeddings are never quantized layers (an LM head is: vLLM's ModelOpt config quantizes it
// unless excluded).
bool IsEmbedding(absl::string_view module);

// The threads a `--cpu_threads` of `threads` runs: <= 0 the hardware's, never more.
int InspectThreads(int threads);

// Each tensor's bucket checksum (core/transport/checksum.h), on `threads` threads (<= 0: the
// hardware's; never more).
std::vector<uint64_t> Checksums(const std::vector<Tensor>& tensors, int threads);

// One checksum over the rows' names, dtypes, shapes and checksums: equal digests, equal
// snapshots.
uint64_t Digest(const std::vector<TensorRow>& rows);

}  // namespace wpub::inspect
