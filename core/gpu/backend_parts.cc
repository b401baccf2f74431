// The GPU backend's helpers (backend_parts.h).
#include "core/gpu/backend_parts.h"

#include "absl/strings/str_cat.h"
#include "core/common/status.h"

namespace wpub::gpu::detail {

using engine::InputTensor;
using engine::PartView;

kernels::ElemType ToElemType(DType d) {
  return d == DType::kFloat16   ? kernels::ElemType::kF16
         : d == DType::kFloat32 ? kernels::ElemType::kF32
                                : kernels::ElemType::kBF16;
}

bool FloatKindOf(DType d, FloatKind* k) {
  switch (d) {
    case DType::kBFloat16:
      *k = FloatKind::kBF16;
      return true;
    case DType::kFloat16:
      *k = FloatKind::kF16;
      return true;
    case DType::kFloat32:
      *k = FloatKind::kF32;
      return true;
    case DType::kFloat64:
      *k = FloatKind::kF64;
      return true;
    default:
      return false;
  }
}

// As the CPU backend splits an input, over device part pointers.
absl::StatusOr<std::vector<Piece>> MakePieces(const InputTensor& in,
                                              const std::vector<const uint8_t*>& data) {
  const Shape& s = in.desc.shape;
  const kernels::ElemType type = ToElemType(in.desc.dtype);
  const bool stacked = s.size() == 3;
  if (s.size() != 2 && !stacked) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", in.desc.name, ": rank ", s.size(), " cannot be quantized"));
  }
  std::vector<Piece> pieces;
  if (stacked && in.concat_dim == 0) {
    int64_t offset = 0;
    for (size_t i = 0; i < in.parts.size(); ++i) {
      const PartView& p = in.parts[i];
      Piece piece;
      piece.weight = kernels::WeightDesc::Stack(data[i], p.shape[0], s[1], s[2], type);
      piece.slice_offset = offset;
      piece.slices = p.shape[0];
      offset += p.shape[0];
      if (piece.slices > 0) pieces.push_back(piece);
    }
    return pieces;
  }
  Piece piece;
  piece.slices = stacked ? s[0] : 1;
  piece.weight.type = type;
  piece.weight.num_slices = piece.slices;
  const bool along_cols = !stacked && in.concat_dim == 1;
  piece.weight.concat = along_cols ? kernels::ConcatDim::kCols : kernels::ConcatDim::kRows;
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const PartView& p = in.parts[i];
    const int64_t rows = stacked ? p.shape[1] : p.shape[0];
    const int64_t cols = stacked ? p.shape[2] : p.shape[1];
    if (!piece.weight.AddPart(data[i], rows, cols)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", in.desc.name, ": ", in.parts.size(),
                                                     " parts exceed the ", kernels::kMaxWeightParts,
                                                     " a quantized tensor may have"));
    }
  }
  pieces.push_back(piece);
  return pieces;
}

absl::Status KernelError(kernels::KernelStatus st, const std::string& what,
                         const std::string& msg) {
  return absl::InternalError(
      absl::StrCat(what, ": ", kernels::KernelStatusString(st), msg.empty() ? "" : ": ", msg));
}

absl::Status GrowBuffer::Ensure(uint64_t bytes, HostSyncs& syncs, const char* why) {
  if (bytes <= size) return absl::OkStatus();
  WPUB_RETURN_IF_ERROR(Release(syncs));
  const uint64_t want = AlignUp(bytes, uint64_t{1} << 20);
  WPUB_RETURN_IF_ERROR(pinned ? syncs.MallocHost(&ptr, want, why) : syncs.Malloc(&ptr, want, why));
  size = want;
  return absl::OkStatus();
}

absl::Status GrowBuffer::Release(HostSyncs& syncs) {
  if (ptr == nullptr) return absl::OkStatus();
  absl::Status s = pinned ? syncs.FreeHost(ptr) : syncs.Free(ptr);
  ptr = nullptr;
  size = 0;
  return s;
}

}  // namespace wpub::gpu::detail
