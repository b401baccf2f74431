// Whole-file safetensors helpers of wpub-recv over core/safetensors (the format lives there):
// used by wpub-recv to save a committed version and by tests to read it back.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"

namespace wpub::recv {

// safetensors dtype name ("BF16", "F8_E4M3", ...) of a torch dtype.
absl::string_view SafetensorsDTypeName(DType dtype);

struct SafetensorsEntry {
  TensorDesc desc;
  absl::Span<const uint8_t> bytes;  // desc.nbytes() bytes, borrowed
};

// Writes `entries` in order to `path` atomically (a temporary file renamed over `path`).
// INVALID_ARGUMENT naming the tensor when a byte count does not match its shape or a name
// repeats; INTERNAL naming the path on I/O errors.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata);

struct LoadedTensor {
  std::string dtype;  // safetensors name as stored ("BF16", ...)
  Shape shape;
  std::vector<uint8_t> bytes;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, LoadedTensor> tensors;
  std::vector<std::string> order;  // tensor names by data offset
};

// Reads and validates a whole file (offsets in range, contiguous, no holes).
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace wpub::recv
