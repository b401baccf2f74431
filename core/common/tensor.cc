// DType names and sizes, shape helpers.
#include "core/common/tensor.h"

#include <array>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace wpub {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view torch_name;
  absl::string_view safetensors_name;
  int64_t size;
};

constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::kBFloat16, "bfloat16", "BF16", 2},
    {DType::kFloat16, "float16", "F16", 2},
    {DType::kFloat32, "float32", "F32", 4},
    {DType::kUInt8, "uint8", "U8", 1},
    {DType::kFloat8E4M3, "float8_e4m3fn", "F8_E4M3", 1},
    {DType::kInt8, "int8", "I8", 1},
    {DType::kInt32, "int32", "I32", 4},
    {DType::kInt64, "int64", "I64", 8},
    {DType::kFloat64, "float64", "F64", 8},
    {DType::kBool, "bool", "BOOL", 1},
}};

constexpr bool TableMatchesEnum() {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(TableMatchesEnum(), "kDTypes must be indexed by DType");

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).torch_name; }

int64_t DTypeSize(DType dtype) { return Info(dtype).size; }

bool IsQuantizableFloat(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  absl::string_view bare = absl::StripPrefix(name, "torch.");
  for (const DTypeInfo& info : kDTypes) {
    if (bare == info.torch_name || bare == info.safetensors_name) return info.dtype;
  }
  // Common aliases.
  const std::string lower = absl::AsciiStrToLower(bare);
  if (lower == "bf16") return DType::kBFloat16;
  if (lower == "half" || lower == "fp16") return DType::kFloat16;
  if (lower == "float" || lower == "fp32") return DType::kFloat32;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace wpub
