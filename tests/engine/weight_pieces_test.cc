// engine::AppendWeightPieces / SplitIntoWeightPieces: how quantized inputs become kernel weights.
#include "core/engine/weight_pieces.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace wpub::engine {
namespace {

InputTensor Input(const char* name, DType dtype, Shape shape, std::vector<Shape> parts,
                  int concat_dim) {
  InputTensor in;
  in.desc = TensorDesc{name, dtype, std::move(shape)};
  in.concat_dim = concat_dim;
  for (Shape& s : parts) in.parts.push_back(PartView{nullptr, std::move(s), 0});
  return in;
}

const uint8_t* Addr(uintptr_t a) { return reinterpret_cast<const uint8_t*>(a); }

TEST(WeightPieces, AppendsAfterWhatIsThereAndSplitsStacksByPart) {
  std::vector<WeightPiece> out;
  const InputTensor dense =
      Input("a.weight", DType::kBFloat16, {64, 256}, {{32, 256}, {32, 256}}, 0);
  const std::vector<const uint8_t*> dense_at = {Addr(0x1000), Addr(0x9000)};
  ASSERT_TRUE(AppendWeightPieces(dense, dense_at, &out).ok());
  const InputTensor stack = Input("e.weight", DType::kFloat16, {6, 64, 128},
                                  {{2, 64, 128}, {0, 64, 128}, {4, 64, 128}}, 0);
  const std::vector<const uint8_t*> stack_at = {Addr(0x20000), Addr(0x30000), Addr(0x40000)};
  ASSERT_TRUE(AppendWeightPieces(stack, stack_at, &out).ok());
  ASSERT_EQ(out.size(), 3u);  // one dense weight of two parts, two stacks (the empty part dropped)
  EXPECT_EQ(out[0].weight.num_parts, 2);
  EXPECT_EQ(out[0].weight.parts[1].data, dense_at[1]);
  EXPECT_EQ(out[0].weight.rows(), 64);
  EXPECT_EQ(out[0].slices, 1);
  EXPECT_EQ(out[1].weight.parts[0].data, stack_at[0]);
  EXPECT_EQ(out[1].slice_offset, 0);
  EXPECT_EQ(out[1].slices, 2);
  EXPECT_EQ(out[1].weight.type, kernels::ElemType::kF16);
  EXPECT_EQ(out[2].weight.parts[0].data, stack_at[2]);
  EXPECT_EQ(out[2].slice_offset, 2);
  EXPECT_EQ(out[2].slices, 4);
  // The split of one input alone is the same pieces.
  auto alone = SplitIntoWeightPieces(stack, stack_at);
  ASSERT_TRUE(alone.ok());
  ASSERT_EQ(alone->size(), 2u);
  EXPECT_EQ((*alone)[1].slice_offset, 2);
}

TEST(WeightPieces, BadInputNamesTheTensorAndAppendsNothing) {
  std::vector<WeightPiece> out(1);
  const InputTensor rank1 = Input("norm.weight", DType::kBFloat16, {64}, {{64}}, 0);
  const std::vector<const uint8_t*> one = {Addr(0x1000)};
  absl::Status st = AppendWeightPieces(rank1, one, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("norm.weight"), std::string::npos) << st;
  const InputTensor two = Input("b.weight", DType::kBFloat16, {64, 32}, {{64, 16}, {64, 16}}, 1);
  st = AppendWeightPieces(two, one, &out);  // one address for two parts
  EXPECT_NE(st.message().find("b.weight"), std::string::npos) << st;
  std::vector<Shape> many(kernels::kMaxWeightParts + 1, Shape{4, 32});
  const InputTensor too_many =
      Input("c.weight", DType::kBFloat16, {4 * static_cast<int64_t>(many.size()), 32}, many, 0);
  const std::vector<const uint8_t*> at(many.size(), Addr(0x1000));
  st = AppendWeightPieces(too_many, at, &out);
  EXPECT_NE(st.message().find("c.weight"), std::string::npos) << st;
  EXPECT_EQ(out.size(), 1u);
}

// CheckWeightPieces is the up-front check of a caller that builds pieces later: it must fail
// exactly when AppendWeightPieces would, with the same error, and never for a good input (a
// stack split by expert may have any number of parts).
TEST(WeightPieces, CheckFailsExactlyWhenAppendWould) {
  std::vector<Shape> many(kernels::kMaxWeightParts + 1, Shape{4, 32});
  std::vector<Shape> many_slices(kernels::kMaxWeightParts + 1, Shape{1, 4, 32});
  const int64_t n = static_cast<int64_t>(many.size());
  const std::vector<InputTensor> cases = {
      Input("ok.dense", DType::kBFloat16, {64, 256}, {{32, 256}, {32, 256}}, 0),
      Input("ok.cols", DType::kFloat16, {64, 32}, {{64, 16}, {64, 16}}, 1),
      Input("ok.stack_rows", DType::kBFloat16, {2, 64, 32}, {{2, 32, 32}, {2, 32, 32}}, 1),
      Input("ok.stack_by_expert", DType::kBFloat16, {n, 4, 32}, many_slices, 0),
      Input("ok.max_parts", DType::kBFloat16, {4 * (n - 1), 32},
            std::vector<Shape>(kernels::kMaxWeightParts, Shape{4, 32}), 0),
      Input("bad.rank1", DType::kBFloat16, {64}, {{64}}, 0),
      Input("bad.rank4", DType::kBFloat16, {1, 1, 4, 32}, {{1, 1, 4, 32}}, 0),
      Input("bad.too_many_rows", DType::kBFloat16, {4 * n, 32}, many, 0),
      Input("bad.stack_too_many_rows", DType::kBFloat16, {1, 4 * n, 32}, many_slices, 1),
  };
  for (const InputTensor& in : cases) {
    const bool good = in.desc.name.rfind("ok.", 0) == 0;
    for (size_t addresses : {in.parts.size(), in.parts.size() + 1}) {
      const std::vector<const uint8_t*> at(addresses, Addr(0x1000));
      std::vector<WeightPiece> out;
      const absl::Status appended = AppendWeightPieces(in, at, &out);
      const absl::Status checked = CheckWeightPieces(in, addresses);
      EXPECT_EQ(checked, appended) << in.desc.name << " with " << addresses << " addresses";
      EXPECT_EQ(checked.ok(), good && addresses == in.parts.size()) << in.desc.name << checked;
      if (!checked.ok()) {
        EXPECT_NE(checked.message().find(in.desc.name), std::string::npos) << checked;
        EXPECT_TRUE(out.empty()) << in.desc.name;
      }
    }
  }
}

}  // namespace
}  // namespace wpub::engine
