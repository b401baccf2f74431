// Block deltas of NVFP4 tensors (core/delta/block_delta.h): a patch applied to its base gives the
// next version byte for byte whatever changed (nothing, one code, one scale, random blocks, the
// first and last blocks); the full tensor where a patch cannot or should not go (a changed
// global scale or shape, too many blocks); a receiver without the base refuses the patch and
// keeps what it holds; a malformed or corrupted patch changes nothing.
#include "core/delta/block_delta.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/nvfp4_math.h"
#include "kernels/reference.h"

namespace wpub::delta {
namespace {

// An owned NVFP4 tensor.
struct Tensor {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed, scales;
  float decode_scale = 1.0f / 448;

  Tensor(int64_t r, int64_t c, uint64_t seed) : rows(r), cols(c) {
    packed.resize(static_cast<size_t>(r * c / 2));
    scales.resize(static_cast<size_t>(r * c / 16));
    std::mt19937_64 rng(seed);
    for (uint8_t& b : packed) b = static_cast<uint8_t>(rng());
    for (uint8_t& b : scales) b = static_cast<uint8_t>(rng() % 0x7E);  // finite E4M3
  }
  size_t blocks() const { return scales.size(); }
  Nvfp4View view() const { return {packed.data(), scales.data(), decode_scale, rows, cols}; }
  Nvfp4Mutable mut() { return {packed.data(), scales.data(), decode_scale, rows, cols}; }
  bool operator==(const Tensor& o) const {
    return packed == o.packed && scales == o.scales &&
           std::memcmp(&decode_scale, &o.decode_scale, 4) == 0;
  }
};

// Diffs base -> next, applies the patch to a copy of base, expects next; returns the plan.
DeltaPlan RoundTrip(const Tensor& base, const Tensor& next, const DiffOptions& o = {}) {
  absl::StatusOr<DeltaPlan> plan = DiffNvfp4(base.view(), next.view(), o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok() || plan->full) return plan.ok() ? *plan : DeltaPlan{};
  Tensor held = base;
  const absl::Status s = ApplyNvfp4Patch(plan->patch, held.mut());
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(held == next);
  return *plan;
}

TEST(BlockDelta, NothingChangedIsAnEmptyPatch) {
  const Tensor base(32, 64, 1);
  const DeltaPlan p = RoundTrip(base, base);
  EXPECT_FALSE(p.full);
  EXPECT_EQ(p.changed_blocks, 0u);
  EXPECT_EQ(p.patch.size(), kPatchHeaderBytes);
}

TEST(BlockDelta, OneCodeOrOneScaleIsOneBlock) {
  const Tensor base(32, 64, 2);
  for (size_t block : {size_t{0}, size_t{57}, base.blocks() - 1}) {
    SCOPED_TRACE(block);
    Tensor code = base;
    code.packed[8 * block + 7] ^= 0x10;  // the block's last code
    DeltaPlan p = RoundTrip(base, code);
    ASSERT_FALSE(p.full) << p.why;
    EXPECT_EQ(p.changed_blocks, 1u);
    EXPECT_EQ(p.patch.size(), kPatchHeaderBytes + kPatchBytesPerBlock);
    Tensor scale = base;
    scale.scales[block] ^= 0x01;
    p = RoundTrip(base, scale);
    ASSERT_FALSE(p.full) << p.why;
    EXPECT_EQ(p.changed_blocks, 1u);
  }
}

TEST(BlockDelta, RandomChangePatternsReconstructExactly) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 200; ++trial) {
    // At least 64 blocks: a quarter of them changed stays under the default threshold (the
    // 64-byte header dominates smaller tensors, which then go whole).
    const int64_t rows = 8 + static_cast<int64_t>(rng() % 40);
    const int64_t cols = 16 * (8 + static_cast<int64_t>(rng() % 12));
    const Tensor base(rows, cols, rng());
    Tensor next = base;
    const size_t k = rng() % (base.blocks() / 4 + 1);  // under the default 0.5 threshold
    for (size_t i = 0; i < k; ++i) {
      const size_t b = rng() % base.blocks();
      if (rng() % 3 == 0) {
        next.scales[b] = static_cast<uint8_t>(rng() % 0x7E);
      } else {
        next.packed[8 * b + rng() % 8] = static_cast<uint8_t>(rng());
      }
    }
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " [" << rows << ", " << cols << "], " << k << " edits");
    const DeltaPlan p = RoundTrip(base, next);
    ASSERT_FALSE(p.full) << p.why;
    EXPECT_LE(p.changed_blocks, k);
  }
}

TEST(BlockDelta, TheFullTensorGoesWhenAPatchCannotOrShouldNot) {
  const Tensor base(16, 64, 3);
  Tensor rescaled = base;
  rescaled.decode_scale = base.decode_scale * 2;  // a changed amax
  absl::StatusOr<DeltaPlan> p = DiffNvfp4(base.view(), rescaled.view());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->full);
  EXPECT_NE(p->why.find("global decode scale changed"), std::string::npos) << p->why;
  EXPECT_TRUE(p->patch.empty());
  const Tensor reshaped(32, 32, 3);
  p = DiffNvfp4(base.view(), reshaped.view());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->full);
  EXPECT_NE(p->why.find("shape changed"), std::string::npos) << p->why;
  // Every block changed: a patch would be larger than the tensor.
  Tensor all = base;
  for (uint8_t& s : all.scales) s ^= 1;
  p = DiffNvfp4(base.view(), all.view());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->full);
  EXPECT_EQ(p->changed_blocks, base.blocks());
  // A tiny tensor goes whole even for one changed block: the patch's header outweighs it.
  const Tensor tiny(1, 32, 6);
  Tensor tiny_next = tiny;
  tiny_next.scales[0] ^= 1;
  p = DiffNvfp4(tiny.view(), tiny_next.view());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->full) << "a patch of " << kPatchHeaderBytes + kPatchBytesPerBlock << " bytes";
  // ... unless asked for one whatever its size: it still reconstructs.
  const DeltaPlan forced = RoundTrip(base, all, {.max_patch_fraction = 10});
  EXPECT_FALSE(forced.full);
  EXPECT_EQ(forced.changed_blocks, base.blocks());
}

TEST(BlockDelta, AReceiverWithoutTheBaseRefusesAndKeepsWhatItHolds) {
  const Tensor base(16, 64, 4);
  Tensor next = base;
  next.packed[3] ^= 0xFF;
  absl::StatusOr<DeltaPlan> p = DiffNvfp4(base.view(), next.view());
  ASSERT_TRUE(p.ok() && !p->full);
  Tensor other = base;
  other.packed[100] ^= 1;  // a version the patch was not made from
  const Tensor before = other;
  const absl::Status s = ApplyNvfp4Patch(p->patch, other.mut());
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("not the patch's base"), std::string::npos) << s;
  EXPECT_TRUE(other == before);
  // The target itself is not the base either (a patch applied twice).
  Tensor twice = base;
  ASSERT_TRUE(ApplyNvfp4Patch(p->patch, twice.mut()).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(ApplyNvfp4Patch(p->patch, twice.mut())));
  EXPECT_TRUE(twice == next);
}

TEST(BlockDelta, MalformedOrCorruptedPatchesChangeNothing) {
  const Tensor base(16, 64, 5);
  Tensor next = base;
  for (size_t b : {size_t{1}, size_t{9}, size_t{40}}) next.packed[8 * b] ^= 0x33;
  absl::StatusOr<DeltaPlan> plan = DiffNvfp4(base.view(), next.view());
  ASSERT_TRUE(plan.ok() && !plan->full);
  const std::vector<uint8_t> good = plan->patch;
  const auto expect_refused = [&](std::vector<uint8_t> patch, absl::StatusCode code,
                                  const std::string& says) {
    Tensor held = base;
    const absl::Status s = ApplyNvfp4Patch(patch, held.mut());
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(says), std::string::npos) << s;
    EXPECT_TRUE(held == base) << s;
  };
  using absl::StatusCode;
  expect_refused(std::vector<uint8_t>(good.begin(), good.begin() + 10),
                 StatusCode::kInvalidArgument, "shorter than its 64-byte header");
  expect_refused(std::vector<uint8_t>(good.begin(), good.end() - 1), StatusCode::kInvalidArgument,
                 "expected");
  std::vector<uint8_t> bad = good;
  bad[0] = 'X';
  expect_refused(bad, StatusCode::kInvalidArgument, "magic");
  bad = good;
  bad[4] = 9;
  expect_refused(bad, StatusCode::kInvalidArgument, "format 9");
  bad = good;
  bad[8] = 17;  // rows
  expect_refused(bad, StatusCode::kInvalidArgument, "shape");
  bad = good;
  bad[24] ^= 1;  // decode scale bits
  expect_refused(bad, StatusCode::kInvalidArgument, "decode scale");
  bad = good;
  uint32_t index = 1000000;
  std::memcpy(bad.data() + kPatchHeaderBytes + 4, &index, 4);
  expect_refused(bad, StatusCode::kInvalidArgument, "is not below");
  bad = good;
  index = 1;  // the second index equal to the first
  std::memcpy(bad.data() + kPatchHeaderBytes + 4, &index, 4);
  expect_refused(bad, StatusCode::kInvalidArgument, "not ascending");
  // A flipped code byte in the payload: the result is not the target, the base is put back.
  bad = good;
  bad[kPatchHeaderBytes + 3 * 4 + 5] ^= 0x01;
  expect_refused(bad, StatusCode::kDataLoss, "not the patch's target");
  // A bad tensor view.
  Tensor held = base;
  Nvfp4Mutable m = held.mut();
  m.cols = 60;
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyNvfp4Patch(good, m)));
  EXPECT_TRUE(absl::IsInvalidArgument(DiffNvfp4({}, base.view()).status()));
}

// Two successive AdamW steps of one weight, quantized by the CPU reference as the daemon would:
// the patch between them rebuilds the second exactly, and is a small fraction of the tensor.
TEST(BlockDelta, TwoQuantizedRlStepsPatchExactly) {
  const int64_t rows = 64, cols = 512;
  const size_t n = static_cast<size_t>(rows * cols);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> init(0.0f, 0.02f), grad(0.0f, 1.0f);
  std::vector<float> w(n);
  for (float& x : w) x = init(rng);
  const auto quantize = [&](const std::vector<float>& master) {
    std::vector<uint16_t> bf16(n);
    for (size_t i = 0; i < n; ++i) bf16[i] = kernels::FloatToBf16(master[i]);
    Tensor t(rows, cols, 0);
    const kernels::WeightDesc d =
        kernels::WeightDesc::Dense(bf16.data(), rows, cols, kernels::ElemType::kBF16);
    kernels::QuantOutput out;
    out.packed = t.packed.data();
    out.scales = t.scales.data();
    out.decode_scale = &t.decode_scale;
    EXPECT_EQ(kernels::Quantize(d, nullptr, kernels::QuantMode::Standard(), out),
              kernels::KernelStatus::kOk);
    return t;
  };
  const Tensor step1 = quantize(w);
  // One Adam step at lr 1e-5 from zero moments: each weight moves by about lr * sign(g).
  for (float& x : w) x -= 1e-5f * (grad(rng) > 0 ? 1.0f : -1.0f);
  const Tensor step2 = quantize(w);
  ASSERT_FALSE(step1 == step2);
  const DeltaPlan p = RoundTrip(step1, step2);
  if (p.full) {
    // Only a moved amax may force the full tensor.
    EXPECT_NE(p.why.find("global decode scale"), std::string::npos) << p.why;
  } else {
    EXPECT_GT(p.changed_blocks, 0u);
    EXPECT_LT(p.patch.size(), p.full_bytes / 4);
  }
}

}  // namespace
}  // namespace wpub::delta
