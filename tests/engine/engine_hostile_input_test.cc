// Inputs a hostile or broken client controls, and that once took the daemon down: JSON nested
// deep enough to overflow a recursive walk, shared memory truncated between AddBatch and
// Commit (SIGBUS through a mapping), and inline declarations the host cannot hold
// (std::bad_alloc). Each must end as a clear error (or, for shm, a publication of the bytes
// as they were at AddBatch) while the engine keeps serving.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "core/common/json_bounds.h"
#include "core/engine/engine.h"
#include "core/engine/inputs.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

std::string Nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(JsonBoundsTest, CountsNestingOutsideStringsOnly) {
  EXPECT_TRUE(CheckJsonBounds(R"({"a": [1, {"b": []}]})", "doc").ok());
  JsonBounds tight;
  tight.max_depth = 2;
  EXPECT_TRUE(CheckJsonBounds(R"({"a": "[[[[{{{{", "b": [1]})", "doc", tight).ok());
  // An escaped quote does not end the string, so the brackets after it are still text.
  EXPECT_TRUE(CheckJsonBounds(R"({"a": "\"[[[[", "b": 1})", "doc", tight).ok());
  const absl::Status deep = CheckJsonBounds(R"({"a": [[1]]})", "policy_json", tight);
  EXPECT_EQ(deep.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::HasSubstr(deep, "policy_json")) << deep;
  EXPECT_TRUE(testing::HasSubstr(deep, "nested deeper than 2")) << deep;
  tight.max_bytes = 8;
  const absl::Status big = CheckJsonBounds(R"({"a": 12345})", "answer", tight);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::HasSubstr(big, "exceed the limit of 8")) << big;
}

class HostileInputTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(EngineOptions{}); }

  void Make(EngineOptions options) {
    receiver_.reset();
    engine_.reset();
    options.bucket_bytes = 4096;
    options.min_bucket_bytes = 1024;
    options.ack_deadline = absl::Seconds(20);
    auto engine = Engine::Create(options, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    auto r = transport::testing::InprocReceiver::Start(engine_->pull_transport(), {.name = "r"});
    ASSERT_TRUE(r.ok()) << r.status();
    receiver_ = std::move(*r);
  }

  // A good publication of `version` commits (the engine still serves).
  void ExpectServes(uint64_t version) {
    auto session = engine_->Open(testing::Header(version));
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(
        testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 7)).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
    EXPECT_TRUE(receiver_->WaitForOutcome(version, absl::Seconds(20)));
    EXPECT_EQ(receiver_->committed_version(), version);
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<transport::testing::InprocReceiver> receiver_;
};

TEST_F(HostileInputTest, DeeplyNestedHeaderJsonIsRefusedNamingTheField) {
  struct Case {
    const char* field;
    PublicationHeader header;
  };
  PublicationHeader qc = testing::Header(1);
  qc.quantization_config_json = "{\"quant_algo\": " + Nested(80000) + "}";
  PublicationHeader pj = testing::Header(1);
  pj.quantization_config_json.clear();
  pj.policy_json = "{\"extra_high_precision_layers_hf\": " + Nested(80000) + "}";
  PublicationHeader huge = testing::Header(1);
  huge.quantization_config_json =
      R"({"quant_algo": "NVFP4", "ignore": [")" + std::string(8 << 20, 'x') + R"("]})";
  for (const Case& c : {Case{"quantization_config_json", qc}, Case{"policy_json", pj},
                        Case{"quantization_config_json", huge}}) {
    auto session = engine_->Open(c.header);
    ASSERT_FALSE(session.ok()) << c.field;
    EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(testing::HasSubstr(session.status(), c.field)) << session.status();
  }
  ExpectServes(1);
}

TEST_F(HostileInputTest, ShmTruncatedAfterItsBatchPublishesTheBytesAsAdded) {
  auto shm = testing::ShmSegment::Create("/wpub_hostile_" + std::to_string(getpid()), 1 << 20);
  auto batches = testing::ModelBatches(synthetic::ModelShape::Tiny(), 11);
  uint64_t offset = 0;
  for (auto& b : batches) {
    for (auto& t : b.tensors) {
      shm->Place(t, offset);
      offset += (t.full.size() + 63) / 64 * 64;
    }
  }
  ASSERT_GT(offset, 4096u);
  auto session = engine_->Open(testing::Header(1));
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(testing::Send(**session, batches).ok());
  // The trainer rewrites, then truncates its segment before Commit: a daemon reading it in
  // place would publish torn bytes or die of SIGBUS.
  std::memset(shm->data(), 0x7f, 4096);
  shm->Truncate(0);
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->status, PublicationStatus::kCommitted) << report->error;
  ASSERT_TRUE(receiver_->WaitForOutcome(1, absl::Seconds(20)));
  const auto expected =
      testing::ExpectedOutputs(batches, *testing::PlainPolicy(), kernels::QuantMode::Standard());
  const auto got = receiver_->committed_tensors();
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, bytes] : expected) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(got.at(name) == bytes) << name;
  }
}

TEST(ShmSegmentTest, ReadPastATruncationIsAnErrorNamingTheSegment) {
  auto shm = testing::ShmSegment::Create("/wpub_hostile_read_" + std::to_string(getpid()), 8192);
  std::memset(shm->data(), 0x5a, 8192);
  auto segment = ShmSegment::Open(shm->name(), "model.w");
  ASSERT_TRUE(segment.ok()) << segment.status();
  EXPECT_EQ((*segment)->size(), 8192u);
  std::vector<uint8_t> dst(8192);
  ASSERT_TRUE((*segment)->ReadAt(0, absl::MakeSpan(dst), "model.w").ok());
  EXPECT_EQ(dst[8191], 0x5a);
  shm->Truncate(100);
  const absl::Status s = (*segment)->ReadAt(0, absl::MakeSpan(dst), "model.w");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::HasSubstr(s, "model.w")) << s;
  EXPECT_TRUE(testing::HasSubstr(s, shm->name())) << s;
  EXPECT_TRUE(testing::HasSubstr(s, "truncated")) << s;
  auto missing = ShmSegment::Open("wpub_no_such_segment_xyz", "model.w");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(HostileInputTest, AnInlineDeclarationTheHostCannotHoldIsResourceExhausted) {
  EngineOptions options;
  options.max_inline_bytes = uint64_t{1} << 44;  // 16 TiB: only the host's memory bounds it
  Make(options);
  auto session = engine_->Open(testing::Header(1));
  ASSERT_TRUE(session.ok()) << session.status();
  BatchInput batch;
  batch.megatron_name = "decoder.layers.0.self_attention.linear_proj.weight";
  TensorInput t;
  const Shape shape = {int64_t{1} << 20, int64_t{1} << 19};  // 2^39 bf16 = 1 TiB
  t.desc = TensorDesc{"model.layers.0.self_attn.o_proj.weight", DType::kBFloat16, shape};
  t.parts.push_back(TensorPart{InlineSource{}, shape});
  batch.tensors.push_back(t);
  const absl::Status s = (*session)->AddBatch(batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(testing::HasSubstr(s, "model.layers.0.self_attn.o_proj.weight")) << s;
  session->reset();
  ExpectServes(1);
}

TEST(HostBufferTest, ReservationsCostNothingUntilWrittenAndFailCleanly) {
  // 64 GiB of address space, never touched: reserved, not allocated.
  auto big = HostBuffer::Allocate(uint64_t{64} << 30, "model.w");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->size(), uint64_t{64} << 30);
  big->data()[0] = 1;
  big->data()[big->size() - 1] = 2;
  auto impossible = HostBuffer::Allocate(uint64_t{1} << 62, "model.huge");
  ASSERT_FALSE(impossible.ok());
  EXPECT_EQ(impossible.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(testing::HasSubstr(impossible.status(), "model.huge"));
  auto empty = HostBuffer::Allocate(0, "model.empty");
  ASSERT_TRUE(empty.ok());
  EXPECT_NE(empty->data(), nullptr);
  EXPECT_EQ(empty->size(), 0u);
}

}  // namespace
}  // namespace wpub::engine
