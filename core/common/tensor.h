// The tensor model shared by every module above kernels/: element types with their torch
// names (the strings engines put in manifests), shapes, and tensor descriptors (metadata only,
// no bytes). Thread-safe: everything here is a value type or a pure function.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace wpub {

// Element types a publication may carry. The string form is torch's dtype name without the
// `torch.` prefix, exactly as SGLang and vLLM read it from a manifest.
enum class DType : uint8_t {
  kBFloat16,
  kFloat16,
  kFloat32,
  kUInt8,
  kFloat8E4M3,  // float8_e4m3fn: NVFP4 block scales.
  kInt8,
  kInt32,
  kInt64,
  kFloat64,
  kBool,
};

// torch name, e.g. "bfloat16", "float8_e4m3fn".
absl::string_view DTypeName(DType dtype);
// Inverse of DTypeName; also accepts the "torch." prefix and safetensors names ("BF16", "F8_E4M3").
absl::StatusOr<DType> ParseDType(absl::string_view name);
// Bytes per element.
int64_t DTypeSize(DType dtype);
// True for the dtypes NVFP4 may quantize from: bf16, fp16, fp32.
bool IsQuantizableFloat(DType dtype);

using Shape = std::vector<int64_t>;

// Product of the dims (1 for a 0-d shape). Dims are assumed non-negative.
int64_t NumElements(const Shape& shape);
// "[4096, 2048]".
std::string ShapeString(const Shape& shape);

// Name, element type and shape of one tensor; no storage.
struct TensorDesc {
  std::string name;
  DType dtype = DType::kBFloat16;
  Shape shape;

  int64_t numel() const { return NumElements(shape); }
  int64_t nbytes() const { return numel() * DTypeSize(dtype); }
  friend bool operator==(const TensorDesc&, const TensorDesc&) = default;
};

}  // namespace wpub
