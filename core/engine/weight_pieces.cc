// The split of a quantized input into kernel weights (weight_pieces.h).
#include "core/engine/weight_pieces.h"

#include "absl/strings/str_cat.h"

namespace wpub::engine {

kernels::ElemType KernelElemType(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return kernels::ElemType::kF16;
    case DType::kFloat32:
      return kernels::ElemType::kF32;
    default:
      return kernels::ElemType::kBF16;
  }
}

absl::Status CheckWeightPieces(const InputTensor& in, size_t num_part_data) {
  const Shape& s = in.desc.shape;
  const bool stacked = s.size() == 3;
  if (s.size() != 2 && !stacked) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", in.desc.name, ": rank ", s.size(), " cannot be quantized"));
  }
  if (num_part_data != in.parts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", in.desc.name, ": ", num_part_data,
                                                   " part addresses for ", in.parts.size(),
                                                   " parts"));
  }
  // A stack split along its expert dimension becomes one piece per part; every other input is
  // one weight, which holds at most kMaxWeightParts parts.
  if (!(stacked && in.concat_dim == 0) &&
      in.parts.size() > static_cast<size_t>(kernels::kMaxWeightParts)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", in.desc.name, ": ", in.parts.size(),
                                                   " parts exceed the ", kernels::kMaxWeightParts,
                                                   " a quantized tensor may have"));
  }
  return absl::OkStatus();
}

absl::Status AppendWeightPieces(const InputTensor& in, std::span<const uint8_t* const> part_data,
                                std::vector<WeightPiece>* out) {
  if (absl::Status st = CheckWeightPieces(in, part_data.size()); !st.ok()) return st;
  const Shape& s = in.desc.shape;
  const kernels::ElemType type = KernelElemType(in.desc.dtype);
  const bool stacked = s.size() == 3;
  if (stacked && in.concat_dim == 0) {
    // Parts split the expert dimension: each part is a stack of its own slices.
    int64_t offset = 0;
    for (size_t i = 0; i < in.parts.size(); ++i) {
      const PartView& p = in.parts[i];
      WeightPiece piece;
      piece.weight = kernels::WeightDesc::Stack(part_data[i], p.shape[0], s[1], s[2], type);
      piece.slice_offset = offset;
      piece.slices = p.shape[0];
      offset += p.shape[0];
      if (piece.slices > 0) out->push_back(piece);
    }
    return absl::OkStatus();
  }
  // Built in place: a piece is ~420 bytes and a publication appends one per expert.
  WeightPiece& piece = out->emplace_back();
  piece.slices = stacked ? s[0] : 1;
  piece.weight.type = type;
  piece.weight.num_slices = piece.slices;
  // Rank 2: dim 0 = rows, dim 1 = cols. Rank 3 split along dim 1: rows of every slice.
  const bool along_cols = !stacked && in.concat_dim == 1;
  piece.weight.concat = along_cols ? kernels::ConcatDim::kCols : kernels::ConcatDim::kRows;
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const PartView& p = in.parts[i];
    const int64_t rows = stacked ? p.shape[1] : p.shape[0];
    const int64_t cols = stacked ? p.shape[2] : p.shape[1];
    if (!piece.weight.AddPart(part_data[i], rows, cols)) {  // excluded by CheckWeightPieces
      out->pop_back();
      return absl::InternalError(absl::StrCat("tensor ", in.desc.name, ": part ", i, " not added"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<WeightPiece>> SplitIntoWeightPieces(
    const InputTensor& in, std::span<const uint8_t* const> part_data) {
  std::vector<WeightPiece> pieces;
  if (absl::Status st = AppendWeightPieces(in, part_data, &pieces); !st.ok()) return st;
  return pieces;
}

}  // namespace wpub::engine
