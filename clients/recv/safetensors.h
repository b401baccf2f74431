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

// Writes `entries` in order to `path` atomically (a temporary file renamed over `path`), with
// `metadata` plus {"format": "pt"} (what transformers requires of a file with metadata).
// INVALID_ARGUMENT naming the tensor when a byte count does not match its shape or a name
// repeats; INTERNAL naming the path on I/O errors.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata);

// The two halves of WriteSafetensors, for a receiver that must know the file can be written
// before it acknowledges a version, and publish it only once the version commits.
// StageSafetensors writes `path` itself (a temporary name the caller chose, in the target's
// directory) and fsyncs it; on error it removes what it wrote. Errors as WriteSafetensors.
absl::Status StageSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata);
// Renames the staged file over `path` and fsyncs the directory. INTERNAL naming both on error.
absl::Status PublishStagedFile(const std::string& staged, const std::string& path);

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

// The `__metadata__` of a file, reading only its header (cheap for any file size). NOT_FOUND
// when the file does not exist; INVALID_ARGUMENT / INTERNAL as core/safetensors' Reader::Open.
absl::StatusOr<std::map<std::string, std::string>> ReadSafetensorsMetadata(const std::string& path);

}  // namespace wpub::recv
