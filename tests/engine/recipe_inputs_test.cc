// Recipe parsing, shared-memory names and mappings, inline coverage tracking and tensor input
// validation.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "core/engine/inputs.h"
#include "core/engine/recipe.h"

namespace wpub::engine {
namespace {

TEST(RecipeTest, ParsesEverySpelling) {
  auto r = ParseRecipeString("nvfp4");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->recipe, policy::Recipe::kNvfp4);
  EXPECT_EQ(r->mode.Index(), 0);
  r = ParseRecipeString("BF16");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->recipe, policy::Recipe::kBf16);
  r = ParseRecipeString("nvfp4_4over6");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mode, kernels::QuantMode::FourOverSixDefault());
  EXPECT_EQ(r->canonical, "nvfp4_4over6:mae-e256-exact");
  r = ParseRecipeString("nvfp4_4over6:mse-e448-fp16");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mode, kernels::QuantMode::FourOverSix(kernels::ErrMetric::kMSE, 448,
                                                     kernels::ErrKind::kFP16));
  r = ParseRecipeString("nvfp4_4over6:mse_448");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->canonical, "nvfp4_4over6:mse-e448-exact");
}

TEST(RecipeTest, RejectsUnknownRecipesNamingThem) {
  for (const char* bad : {"fp8", "", "nvfp4:mae", "nvfp4_4over6:", "nvfp4_4over6:mae-e512"}) {
    auto r = ParseRecipeString(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("recipe"), std::string::npos);
  }
}

TEST(ShmNameTest, RejectsTraversalAndSlashes) {
  EXPECT_TRUE(ValidateShmName("wpub_seg", "t").ok());
  EXPECT_TRUE(ValidateShmName("/wpub_seg", "t").ok());
  for (const char* bad : {"", "/", "a/b", "//a", "..", "a..b", "/../etc"}) {
    absl::Status s = ValidateShmName(bad, "my.tensor");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("my.tensor"), std::string::npos);
  }
}

TEST(ShmSegmentTest, ReadsAnExistingSegment) {
  const std::string name = "/wpub_engine_test_" + std::to_string(getpid());
  int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 0x5A, 4096);
  auto m = ShmSegment::Open(name, "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->size(), 4096u);
  uint8_t last = 0;
  ASSERT_TRUE((*m)->ReadAt(4095, absl::MakeSpan(&last, 1), "t").ok());
  EXPECT_EQ(last, 0x5A);
  munmap(p, 4096);
  close(fd);
  shm_unlink(name.c_str());
  auto missing = ShmSegment::Open("wpub_no_such_segment_xyz", "model.w");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("model.w"), std::string::npos);
  EXPECT_NE(missing.status().message().find("wpub_no_such_segment_xyz"), std::string::npos);
}

TEST(IntervalSetTest, MergesOverlapsAndFindsGaps) {
  IntervalSet s;
  EXPECT_TRUE(s.Covers(0));
  EXPECT_EQ(s.FirstGap(10), 0u);
  s.Add(5, 10);
  EXPECT_EQ(s.FirstGap(10), 0u);
  s.Add(0, 3);
  EXPECT_EQ(s.FirstGap(10), 3u);
  s.Add(2, 6);
  EXPECT_TRUE(s.Covers(10));
  EXPECT_FALSE(s.Covers(11));
  s.Add(20, 30);
  s.Add(10, 20);  // touching ranges merge
  EXPECT_TRUE(s.Covers(30));
}

TensorInput Input(std::string name, DType dtype, Shape shape) {
  TensorInput in;
  in.desc = TensorDesc{std::move(name), dtype, shape};
  in.parts.push_back(TensorPart{InlineSource{}, shape});
  return in;
}

TEST(ValidateTensorInputTest, AcceptsConsistentMultiPartTensors) {
  TensorInput in = Input("w", DType::kBFloat16, {8, 32});
  in.parts = {TensorPart{InlineSource{}, {8, 16}}, TensorPart{InlineSource{}, {8, 16}}};
  in.concat_dim = 1;
  EXPECT_TRUE(ValidateTensorInput(in).ok());
  in.concat_dim = 0;
  EXPECT_EQ(ValidateTensorInput(in).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateTensorInputTest, ErrorsNameTheTensor) {
  TensorInput in = Input("bad.tensor", DType::kBFloat16, {4, 4});
  in.parts[0].shape = {4, 5};
  absl::Status s = ValidateTensorInput(in);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bad.tensor"), std::string::npos);

  in = Input("ipc.tensor", DType::kBFloat16, {4, 4});
  in.parts[0].source = CudaIpcSource{};
  s = ValidateTensorInput(in);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(s.message(), "CUDA IPC ingestion needs the GPU backend; tensor ipc.tensor");

  in = Input("shm.tensor", DType::kFloat32, {4, 4});
  in.parts[0].source = ShmSource{"seg", 0, 63};
  s = ValidateTensorInput(in);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("shm.tensor"), std::string::npos);
  EXPECT_NE(s.message().find("64"), std::string::npos);
}

}  // namespace
}  // namespace wpub::engine
