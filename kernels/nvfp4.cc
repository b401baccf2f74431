// Host helpers of the NVFP4 API types: status/type names, descriptor builders and validation.
#include "kernels/nvfp4.h"

namespace wpub::kernels {

const char* KernelStatusString(KernelStatus status) {
  switch (status) {
    case KernelStatus::kOk:
      return "ok";
    case KernelStatus::kInvalidArgument:
      return "invalid argument";
    case KernelStatus::kUnsupported:
      return "unsupported";
    case KernelStatus::kCudaError:
      return "CUDA error";
    case KernelStatus::kWorkspaceTooSmall:
      return "workspace too small";
  }
  return "unknown kernel status";
}

const char* ElemTypeName(ElemType t) {
  switch (t) {
    case ElemType::kBF16:
      return "bfloat16";
    case ElemType::kF16:
      return "float16";
    case ElemType::kF32:
      return "float32";
  }
  return "unknown";
}

WeightDesc WeightDesc::Dense(const void* data, int64_t rows, int64_t cols, ElemType type) {
  return Stack(data, 1, rows, cols, type);
}

WeightDesc WeightDesc::Stack(const void* data, int64_t slices, int64_t rows, int64_t cols,
                             ElemType type) {
  WeightDesc w;
  w.type = type;
  w.num_slices = slices;
  w.AddPart(data, rows, cols);
  return w;
}

bool WeightDesc::AddPart(const void* data, int64_t rows, int64_t cols) {
  if (num_parts < 0 || num_parts >= kMaxWeightParts) return false;
  parts[num_parts++] = WeightPart{data, rows, cols};
  return true;
}

int64_t WeightDesc::rows() const {
  if (num_parts <= 0) return 0;
  if (concat == ConcatDim::kCols) return parts[0].rows;
  int64_t r = 0;
  for (int i = 0; i < num_parts; ++i) r += parts[i].rows;
  return r;
}

int64_t WeightDesc::cols() const {
  if (num_parts <= 0) return 0;
  if (concat == ConcatDim::kRows) return parts[0].cols;
  int64_t c = 0;
  for (int i = 0; i < num_parts; ++i) c += parts[i].cols;
  return c;
}

namespace {

KernelStatus Fail(int index, const std::string& what, std::string* message) {
  if (message != nullptr) {
    *message = index >= 0 ? "weight " + std::to_string(index) + ": " + what : what;
  }
  return KernelStatus::kInvalidArgument;
}

}  // namespace

KernelStatus ValidateWeight(const WeightDesc& w, int index, std::string* message) {
  if (w.type != ElemType::kBF16 && w.type != ElemType::kF16 && w.type != ElemType::kF32) {
    return Fail(index, "unknown element type " + std::to_string(static_cast<int>(w.type)), message);
  }
  if (w.num_parts < 1 || w.num_parts > kMaxWeightParts) {
    return Fail(index,
                "has " + std::to_string(w.num_parts) + " parts (allowed 1.." +
                    std::to_string(kMaxWeightParts) + ")",
                message);
  }
  if (w.num_slices < 1) {
    return Fail(index, "num_slices " + std::to_string(w.num_slices) + " < 1", message);
  }
  if (w.concat != ConcatDim::kRows && w.concat != ConcatDim::kCols) {
    return Fail(index, "unknown concat dimension", message);
  }
  for (int p = 0; p < w.num_parts; ++p) {
    const WeightPart& part = w.parts[p];
    const std::string name = "part " + std::to_string(p);
    if (part.data == nullptr) return Fail(index, name + " has a null data pointer", message);
    if (part.rows < 1 || part.cols < 1) {
      return Fail(index,
                  name + " has shape [" + std::to_string(part.rows) + ", " +
                      std::to_string(part.cols) + "] (extents must be positive)",
                  message);
    }
    if (w.concat == ConcatDim::kRows && part.cols != w.parts[0].cols) {
      return Fail(index,
                  name + " has " + std::to_string(part.cols) + " columns, part 0 has " +
                      std::to_string(w.parts[0].cols) + " (concatenation along dim 0)",
                  message);
    }
    if (w.concat == ConcatDim::kCols && part.rows != w.parts[0].rows) {
      return Fail(index,
                  name + " has " + std::to_string(part.rows) + " rows, part 0 has " +
                      std::to_string(w.parts[0].rows) + " (concatenation along dim 1)",
                  message);
    }
  }
  const int64_t k = w.cols();
  if (k % kBlockSize != 0) {
    return Fail(index,
                "last dimension " + std::to_string(k) + " is not a multiple of " +
                    std::to_string(kBlockSize) + " (the NVFP4 block size)",
                message);
  }
  return KernelStatus::kOk;
}

}  // namespace wpub::kernels
