// Bad input against a real wpubd with two real receivers: every malformed publication ends
// with a specific gRPC status code and a message naming the tensor or field, the daemon keeps
// serving, and both receivers stay on the previously committed version.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <optional>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/recv/safetensors.h"
#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

constexpr char kGate[] = "model.layers.1.mlp.experts.0.gate_proj.weight";
constexpr char kUp[] = "model.layers.1.mlp.experts.0.up_proj.weight";
constexpr char kFc1[] = "decoder.layers.1.mlp.experts.linear_fc1.weight0";

pb::PublishRequest Header(uint64_t version, const std::string& recipe = "nvfp4") {
  pb::PublishRequest r;
  *r.mutable_header() = MakeHeader(TestSettings(), version, recipe);
  return r;
}

pb::PublishRequest Commit() {
  pb::PublishRequest r;
  r.mutable_commit();
  return r;
}

// A tensor with one inline part of the full shape.
void AddInline(pb::Batch* b, const std::string& name, const std::string& dtype,
               std::vector<int64_t> shape) {
  pb::TensorDescriptor* t = b->add_tensors();
  t->set_name(name);
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  pb::TensorPart* p = t->add_parts();
  for (int64_t d : shape) p->add_shape(d);
  p->mutable_inline_();
}

pb::PublishRequest Batch(const std::string& megatron,
                         std::vector<std::pair<std::string, std::vector<int64_t>>> tensors,
                         const std::string& dtype = "bfloat16") {
  pb::PublishRequest r;
  r.mutable_batch()->set_megatron_name(megatron);
  for (auto& [name, shape] : tensors) AddInline(r.mutable_batch(), name, dtype, shape);
  return r;
}

pb::PublishRequest Chunk(uint64_t batch, uint32_t tensor, uint64_t offset, size_t n,
                         uint8_t fill = 0x3c) {
  pb::PublishRequest r;
  pb::Chunk* c = r.mutable_chunk();
  c->set_batch_index(batch);
  c->set_tensor_index(tensor);
  c->set_part_index(0);
  c->set_offset(offset);
  c->set_data(std::string(n, static_cast<char>(fill)));
  return r;
}

// A complete, valid gate/up batch (2 x [64, 128] bf16) with its chunks.
std::vector<pb::PublishRequest> ValidPairBatch(uint64_t batch_index) {
  std::vector<pb::PublishRequest> out = {Batch(kFc1, {{kGate, {64, 128}}, {kUp, {64, 128}}})};
  out.push_back(Chunk(batch_index, 0, 0, 64 * 128 * 2));
  out.push_back(Chunk(batch_index, 1, 0, 64 * 128 * 2));
  return out;
}

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    HarnessOptions options;
    options.receivers = 2;
    options.daemon_flags = {"--min_receivers=2"};
    auto h = DaemonHarness::Start(options);
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h).release();
    // v1: a good publication both receivers hold.
    std::vector<pb::PublishRequest> reqs = {Header(1)};
    for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
    reqs.push_back(Commit());
    absl::StatusOr<pb::PublicationReport> report = harness_->client().PublishRaw(reqs);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    for (int i = 0; i < 2; ++i) {
      auto file = WaitForFileVersion(harness_->recv_output(i), 1);
      ASSERT_TRUE(file.ok()) << file.status();
    }
  }
  static void TearDownTestSuite() {
    delete harness_;
    harness_ = nullptr;
  }

  void SetUp() override { ASSERT_NE(harness_, nullptr); }

  // Sends `requests`; expects `code` and every substring in the message; then checks that the
  // daemon still serves and nothing moved.
  // `reported_failed`: a publication the daemon opened must be reported FAILED (false where the
  // input is refused by gRPC itself, which the server only sees as a cancelled call: ABORTED).
  void ExpectRejected(const std::vector<pb::PublishRequest>& requests, absl::StatusCode code,
                      const std::vector<std::string>& substrings, bool reported_failed = true) {
    const int64_t before = absl::ToUnixNanos(absl::Now());
    absl::StatusOr<pb::PublicationReport> report = harness_->client().PublishRaw(requests);
    ASSERT_FALSE(report.ok()) << "accepted: status " << report->status() << " "
                              << report->error_message();
    EXPECT_EQ(report.status().code(), code) << report.status();
    for (const std::string& s : substrings) {
      EXPECT_NE(report.status().message().find(s), absl::string_view::npos)
          << "message \"" << report.status().message() << "\" does not name \"" << s << "\"";
    }
    // A call refused by gRPC itself reaches the daemon as a cancellation, after the client has
    // its error: the daemon aborts the publication it had opened asynchronously.
    WaitForNoActivePublication(absl::Seconds(10));
    // A publication the daemon had opened is reported FAILED (bad input), never ABORTED.
    if (std::optional<pb::PublicationReport> r = ReportSince(before)) {
      EXPECT_EQ(r->status(),
                reported_failed ? pb::PUBLICATION_STATUS_FAILED : pb::PUBLICATION_STATUS_ABORTED)
          << r->error_message();
    }
    ExpectStillServingAtV1();
  }

  // Polls GetStatus until no publication is active (at most `timeout`; the caller's checks then
  // report what is left).
  static void WaitForNoActivePublication(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      absl::StatusOr<pb::GetStatusResponse> s = harness_->client().GetStatus();
      if (s.ok() && !s->has_active()) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  // The newest report when it started at or after `unix_nanos`.
  static std::optional<pb::PublicationReport> ReportSince(int64_t unix_nanos) {
    auto reports = harness_->client().ListReports(1);
    EXPECT_TRUE(reports.ok()) << reports.status();
    if (!reports.ok() || reports->empty() || reports->front().start_unix_nanos() < unix_nanos) {
      return std::nullopt;
    }
    return reports->front();
  }

  void ExpectStillServingAtV1() {
    DaemonHarness& h = *harness_;
    EXPECT_TRUE(h.daemon().Running());
    absl::StatusOr<pb::GetStatusResponse> s = h.client().GetStatus();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(s->serving());
    EXPECT_EQ(s->committed_version(), 1u);
    EXPECT_FALSE(s->has_active());
    ASSERT_EQ(s->receivers_size(), 2);
    for (const auto& r : s->receivers()) {
      EXPECT_EQ(r.last_committed_version(), 1u) << r.name();
      EXPECT_NE(r.state(), "left") << r.name();
    }
    EXPECT_EQ(HealthCheck(h.target()).value_or(-1), 1);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(h.receiver(i).Running()) << "recv-" << i;
      absl::StatusOr<recv::SafetensorsFile> f = recv::ReadSafetensors(h.recv_output(i));
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(f->metadata["version"], "1");
    }
  }

  static DaemonHarness* harness_;
};

DaemonHarness* BadInputTest::harness_ = nullptr;

TEST_F(BadInputTest, ServerDetectedBadInputIsReportedFailed) {
  // Found by the server layer after the publication opened (unknown dtype, a stream that ends
  // without commit): the report and the metrics say FAILED, as for the engine's own checks.
  for (const std::vector<pb::PublishRequest>& reqs :
       {std::vector<pb::PublishRequest>{Header(2), Batch(kFc1, {{kGate, {64, 128}}}, "bfloat17"),
                                        Commit()},
        std::vector<pb::PublishRequest>{Header(2), Batch(kFc1, {{kGate, {64, 128}}})}}) {
    const int64_t before = absl::ToUnixNanos(absl::Now());
    ASSERT_FALSE(harness_->client().PublishRaw(reqs).ok());
    std::optional<pb::PublicationReport> r = ReportSince(before);
    ASSERT_TRUE(r.has_value()) << "no report for the opened publication";
    EXPECT_EQ(r->version(), 2u);
    EXPECT_EQ(r->status(), pb::PUBLICATION_STATUS_FAILED) << r->error_message();
  }
  ExpectStillServingAtV1();
}

TEST_F(BadInputTest, UnknownDtype) {
  ExpectRejected({Header(2), Batch(kFc1, {{kGate, {64, 128}}}, "bfloat17"), Commit()},
                 absl::StatusCode::kInvalidArgument, {kGate, "bfloat17"});
}

TEST_F(BadInputTest, ShmLengthDoesNotMatchShape) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}});
  pb::ShmSource* shm = b.mutable_batch()->mutable_tensors(0)->mutable_parts(0)->mutable_shm();
  shm->set_name("/wpub-test-any");
  shm->set_length(64 * 128 * 2 - 2);
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kInvalidArgument,
                 {kGate, "does not match"});
}

TEST_F(BadInputTest, PartShapeDoesNotMatchTensorShape) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}});
  b.mutable_batch()->mutable_tensors(0)->mutable_parts(0)->set_shape(1, 64);
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kInvalidArgument, {kGate});
}

TEST_F(BadInputTest, ChunkOverflow) {
  std::vector<pb::PublishRequest> reqs = {Header(2)};
  for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
  reqs.push_back(Chunk(0, 1, 64 * 128 * 2 - 100, 200));
  reqs.push_back(Commit());
  ExpectRejected(reqs, absl::StatusCode::kInvalidArgument, {kUp, "overflow"});
}

TEST_F(BadInputTest, MissingChunk) {
  ExpectRejected({Header(2), Batch(kFc1, {{kGate, {64, 128}}, {kUp, {64, 128}}}),
                  Chunk(0, 0, 0, 64 * 128 * 2), Chunk(0, 1, 0, 64 * 128), Commit()},
                 absl::StatusCode::kInvalidArgument, {kUp});
}

TEST_F(BadInputTest, LastDimNotMultipleOf16) {
  const std::string down = "model.layers.1.mlp.experts.0.down_proj.weight";
  ExpectRejected(
      {Header(2), Batch("decoder.layers.1.mlp.experts.linear_fc2.weight0", {{down, {128, 40}}}),
       Chunk(0, 0, 0, 128 * 40 * 2), Commit()},
      absl::StatusCode::kInvalidArgument, {down, "16"});
}

TEST_F(BadInputTest, IncompleteGateUpPair) {
  ExpectRejected(
      {Header(2), Batch(kFc1, {{kGate, {64, 128}}}), Chunk(0, 0, 0, 64 * 128 * 2), Commit()},
      absl::StatusCode::kInvalidArgument, {kGate});
}

TEST_F(BadInputTest, DuplicateGateUpPair) {
  // gate_proj and w1 are both "gate" for the base model.layers.1.mlp.experts.0.
  const std::string w1 = "model.layers.1.mlp.experts.0.w1.weight";
  ExpectRejected(
      {Header(2), Batch(kFc1, {{kGate, {64, 128}}, {w1, {64, 128}}, {kUp, {64, 128}}}), Commit()},
      absl::StatusCode::kInvalidArgument, {"model.layers.1.mlp.experts.0"});
}

TEST_F(BadInputTest, InvalidRegexRule) {
  pb::PublishRequest h = Header(2);
  h.mutable_header()->set_quantization_config_json(
      R"({"quant_algo": "NVFP4", "ignore": ["lm_head", "re:model\\.layers\\.(unclosed"]})");
  ExpectRejected({h, Commit()}, absl::StatusCode::kInvalidArgument, {"(unclosed"});
}

TEST_F(BadInputTest, NonIncreasingVersion) {
  ExpectRejected({Header(1), Commit()}, absl::StatusCode::kFailedPrecondition,
                 {"version", "committed version 1"});
}

TEST_F(BadInputTest, VersionZero) {
  ExpectRejected({Header(0), Commit()}, absl::StatusCode::kInvalidArgument, {"version"});
}

TEST_F(BadInputTest, BatchBeforeHeader) {
  ExpectRejected({Batch(kFc1, {{kGate, {64, 128}}}), Commit()}, absl::StatusCode::kInvalidArgument,
                 {"header", "batch"});
}

TEST_F(BadInputTest, CommitWithoutHeader) {
  ExpectRejected({Commit()}, absl::StatusCode::kInvalidArgument, {"header", "commit"});
}

TEST_F(BadInputTest, DuplicateHeader) {
  ExpectRejected({Header(2), Header(3), Commit()}, absl::StatusCode::kInvalidArgument,
                 {"duplicate", "header"});
}

TEST_F(BadInputTest, StreamEndsWithoutCommit) {
  std::vector<pb::PublishRequest> reqs = {Header(2)};
  for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
  ExpectRejected(reqs, absl::StatusCode::kInvalidArgument, {"commit"});
}

TEST_F(BadInputTest, MissingShmSegment) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}, {kUp, {64, 128}}});
  for (int t = 0; t < 2; ++t) {
    pb::ShmSource* shm = b.mutable_batch()->mutable_tensors(t)->mutable_parts(0)->mutable_shm();
    shm->set_name(absl::StrCat("/wpub-test-missing-", getpid()));
    shm->set_length(64 * 128 * 2);
  }
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kNotFound,
                 {kGate, absl::StrCat("wpub-test-missing-", getpid())});
}

TEST_F(BadInputTest, ShmRangeBeyondSegment) {
  const std::string name = absl::StrCat("/wpub-test-small-", getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}, {kUp, {64, 128}}});
  for (int t = 0; t < 2; ++t) {
    pb::ShmSource* shm = b.mutable_batch()->mutable_tensors(t)->mutable_parts(0)->mutable_shm();
    shm->set_name(name);
    shm->set_length(64 * 128 * 2);
  }
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kOutOfRange, {kGate, name});
  shm_unlink(name.c_str());
}

TEST_F(BadInputTest, ChunkAboveDaemonLimit) {
  // 5 MiB of data: under the gRPC message limit (8 MiB) but over the 4 MiB chunk bound.
  ExpectRejected({Header(2), Batch(kFc1, {{kGate, {2048, 2048}}, {kUp, {2048, 2048}}}),
                  Chunk(0, 0, 0, 5 << 20), Commit()},
                 absl::StatusCode::kResourceExhausted, {"chunk.data", "tensor 0"});
}

TEST_F(BadInputTest, MessageAboveGrpcLimit) {
  ExpectRejected({Header(2), Batch(kFc1, {{kGate, {4096, 2048}}, {kUp, {4096, 2048}}}),
                  Chunk(0, 0, 0, 9 << 20), Commit()},
                 absl::StatusCode::kResourceExhausted, {}, /*reported_failed=*/false);
}

TEST_F(BadInputTest, UnsupportedRecipe) {
  ExpectRejected({Header(2, "int4_awq"), Commit()}, absl::StatusCode::kInvalidArgument,
                 {"recipe", "int4_awq"});
}

TEST_F(BadInputTest, EmptyPublication) {
  ExpectRejected({Header(2), Commit()}, absl::StatusCode::kInvalidArgument, {"empty"});
}

TEST_F(BadInputTest, DuplicateTensorNames) {
  std::vector<pb::PublishRequest> reqs = {Header(2)};
  for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
  for (auto& r : ValidPairBatch(1)) reqs.push_back(r);
  reqs.push_back(Commit());
  ExpectRejected(reqs, absl::StatusCode::kInvalidArgument, {"duplicate", kGate});
}

TEST_F(BadInputTest, CudaIpcSourceIsUnimplementedOnTheCpuPath) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}, {kUp, {64, 128}}});
  for (int t = 0; t < 2; ++t) {
    pb::CudaIpcSource* ipc =
        b.mutable_batch()->mutable_tensors(t)->mutable_parts(0)->mutable_cuda_ipc();
    ipc->set_handle(std::string(64, '\x01'));
    ipc->set_device_uuid("GPU-00000000-0000-0000-0000-000000000000");
    ipc->set_length(64 * 128 * 2);
  }
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kUnimplemented, {kGate, "CUDA IPC"});
}

TEST_F(BadInputTest, CudaIpcHandleOfWrongSize) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}});
  b.mutable_batch()->mutable_tensors(0)->mutable_parts(0)->mutable_cuda_ipc()->set_handle("xx");
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kInvalidArgument,
                 {kGate, "cuda_ipc.handle"});
}

TEST_F(BadInputTest, NonFiniteWeightsRejectedByDefault) {
  // bf16 0x7fc0 is NaN.
  std::vector<pb::PublishRequest> reqs = {Header(2)};
  for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
  pb::PublishRequest nan = Chunk(0, 1, 256, 2);
  nan.mutable_chunk()->set_data(std::string("\xc0\x7f", 2));
  reqs.push_back(nan);
  reqs.push_back(Commit());
  ExpectRejected(reqs, absl::StatusCode::kInvalidArgument, {kUp});
}

TEST_F(BadInputTest, BucketSizeOutOfRange) {
  pb::PublishRequest h = Header(2);
  h.mutable_header()->set_bucket_bytes(1);
  ExpectRejected({h, Commit()}, absl::StatusCode::kInvalidArgument, {"bucket_bytes"});
}

TEST_F(BadInputTest, ConcatDimOutOfRange) {
  pb::PublishRequest b = Batch(kFc1, {{kGate, {64, 128}}});
  b.mutable_batch()->mutable_tensors(0)->set_concat_dim(2);
  ExpectRejected({Header(2), b, Commit()}, absl::StatusCode::kInvalidArgument,
                 {kGate, "concat_dim"});
}

// (ctest runs every test in its own process, so this one's commit of v2 affects no other.)
TEST_F(BadInputTest, AfterARejectionTheNextGoodVersionCommits) {
  ExpectRejected({Header(2), Commit()}, absl::StatusCode::kInvalidArgument, {"empty"});
  std::vector<pb::PublishRequest> reqs = {Header(2)};
  for (auto& r : ValidPairBatch(0)) reqs.push_back(r);
  reqs.push_back(Commit());
  absl::StatusOr<pb::PublicationReport> report = harness_->client().PublishRaw(reqs);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  EXPECT_TRUE(harness_->WaitForReceiversAt(2).ok());
}

}  // namespace
}  // namespace wpub::testing
