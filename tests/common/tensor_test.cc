// DType names round-trip through the strings engines and safetensors use.
#include "core/common/tensor.h"

#include <gtest/gtest.h>

namespace wpub {
namespace {

TEST(DType, TorchNamesRoundTrip) {
  for (DType d :
       {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kUInt8, DType::kFloat8E4M3,
        DType::kInt8, DType::kInt32, DType::kInt64, DType::kFloat64, DType::kBool}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(*ParseDType("torch.float8_e4m3fn"), DType::kFloat8E4M3);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBFloat16);
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3), 1);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
}

TEST(DType, UnknownNameIsAnErrorNamingIt) {
  auto parsed = ParseDType("float4_e2m1");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("float4_e2m1"), std::string::npos);
}

TEST(Shape, ElementsAndString) {
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({3, 0, 2}), 0);
  EXPECT_EQ(NumElements({128, 768, 2048}), 128LL * 768 * 2048);
  EXPECT_EQ(ShapeString({4096, 2048}), "[4096, 2048]");
  TensorDesc t{"w", DType::kFloat32, {8, 16}};
  EXPECT_EQ(t.nbytes(), 8 * 16 * 4);
}

}  // namespace
}  // namespace wpub
