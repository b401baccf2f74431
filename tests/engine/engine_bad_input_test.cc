// Bad input: every case ends the publication with a specific status code and a message naming
// the tensor or field; the engine keeps serving, receivers keep the previous version, and the
// next publication commits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "core/engine/engine.h"
#include "core/transport/testing/inproc_receiver.h"
#include "tests/engine/engine_test_util.h"

namespace wpub::engine {
namespace {

using testing::Header;

const char kGate[] = "model.layers.1.mlp.experts.0.gate_proj.weight";
const char kUp[] = "model.layers.1.mlp.experts.0.up_proj.weight";
const char kFc1[] = "decoder.layers.1.mlp.experts.linear_fc1.weight0";

TensorInput Inline(const std::string& name, Shape shape, DType dtype = DType::kBFloat16) {
  TensorInput t;
  t.desc = TensorDesc{name, dtype, shape};
  t.parts = {TensorPart{InlineSource{}, shape}};
  return t;
}

BatchInput PairBatch(int64_t k = 64) {
  return BatchInput{kFc1, {Inline(kGate, {32, k}), Inline(kUp, {32, k})}};
}

// Opens `header`, adds `batches`, fills every inline part with small finite values (unless
// `fill` is false), and commits. Returns the first error.
absl::Status Run(Engine& engine, const PublicationHeader& header, std::vector<BatchInput> batches,
                 bool fill = true, float value = 0.5f) {
  auto session = engine.Open(header);
  if (!session.ok()) return session.status();
  for (size_t b = 0; b < batches.size(); ++b) {
    if (absl::Status s = (*session)->AddBatch(batches[b]); !s.ok()) return s;
  }
  if (fill) {
    for (size_t b = 0; b < batches.size(); ++b) {
      for (size_t t = 0; t < batches[b].tensors.size(); ++t) {
        const TensorInput& in = batches[b].tensors[t];
        for (size_t p = 0; p < in.parts.size(); ++p) {
          if (!std::holds_alternative<InlineSource>(in.parts[p].source)) continue;
          const int64_t n = NumElements(in.parts[p].shape);
          std::vector<uint8_t> bytes(static_cast<size_t>(n * DTypeSize(in.desc.dtype)));
          if (in.desc.dtype == DType::kBFloat16) {
            uint32_t bits;
            std::memcpy(&bits, &value, 4);
            const uint16_t h = static_cast<uint16_t>(bits >> 16);
            for (int64_t i = 0; i < n; ++i) std::memcpy(bytes.data() + 2 * i, &h, 2);
          }
          if (absl::Status s = (*session)->AppendInline(b, static_cast<uint32_t>(t),
                                                        static_cast<uint32_t>(p), 0, bytes);
              !s.ok()) {
            return s;
          }
        }
      }
    }
  }
  auto report = (*session)->Commit();
  if (!report.ok()) return report.status();
  return absl::InternalError("committed: " + std::string(PublicationStatusName(report->status)));
}

struct BadCase {
  std::string name;
  std::function<absl::Status(Engine&, const std::string& shm)> run;
  absl::StatusCode code;
  std::vector<std::string> mentions;  // substrings the message must contain
};

std::vector<BadCase> Cases() {
  std::vector<BadCase> c;
  c.push_back({"unknown_dtype",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[0].desc.dtype = static_cast<DType>(200);
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "unknown dtype"}});
  c.push_back({"shape_mismatch",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[1].parts[0].shape = {32, 48};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kUp, "[32, 48]"}});
  c.push_back({"parts_do_not_sum_to_shape",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[0].parts = {TensorPart{InlineSource{}, {16, 64}},
                                       TensorPart{InlineSource{}, {8, 64}}};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "sum to 24"}});
  c.push_back({"byte_count_mismatch",
               [](Engine& e, const std::string& shm) {
                 BatchInput b = PairBatch();
                 b.tensors[0].parts[0].source = ShmSource{shm, 0, 4095};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "4095", "4096"}});
  c.push_back({"chunk_overflow",
               [](Engine& e, const std::string&) -> absl::Status {
                 auto s = e.Open(Header(2));
                 if (!s.ok()) return s.status();
                 if (auto st = (*s)->AddBatch(PairBatch()); !st.ok()) return st;
                 std::vector<uint8_t> chunk(100);
                 return (*s)->AppendInline(0, 1, 0, 4000, chunk);
               },
               absl::StatusCode::kInvalidArgument,
               {kUp, "chunk overflow"}});
  c.push_back({"missing_chunk",
               [](Engine& e, const std::string&) -> absl::Status {
                 auto s = e.Open(Header(2));
                 if (!s.ok()) return s.status();
                 if (auto st = (*s)->AddBatch(PairBatch()); !st.ok()) return st;
                 std::vector<uint8_t> all(4096), half(2048);
                 if (auto st = (*s)->AppendInline(0, 0, 0, 0, all); !st.ok()) return st;
                 if (auto st = (*s)->AppendInline(0, 1, 0, 0, half); !st.ok()) return st;
                 return (*s)->Commit().status();
               },
               absl::StatusCode::kInvalidArgument,
               {kUp, "missing from offset 2048"}});
  c.push_back({"k_not_multiple_of_16",
               [](Engine& e, const std::string&) { return Run(e, Header(2), {PairBatch(40)}); },
               absl::StatusCode::kInvalidArgument,
               {"divisible by 16", kGate}});
  c.push_back({"incomplete_pair",
               [](Engine& e, const std::string&) {
                 return Run(e, Header(2), {BatchInput{kFc1, {Inline(kGate, {32, 64})}}});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate}});
  c.push_back({"duplicate_gate",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors.push_back(Inline("model.layers.1.mlp.experts.0.w1.weight", {32, 64}));
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {"model.layers.1.mlp.experts.0"}});
  c.push_back({"invalid_regex_rule",
               [](Engine& e, const std::string&) {
                 PublicationHeader h = Header(2);
                 h.quantization_config_json = R"({"quant_algo": "NVFP4", "ignore": ["re:(a"]})";
                 return Run(e, h, {PairBatch()});
               },
               absl::StatusCode::kInvalidArgument,
               {"re:(a"}});
  c.push_back({"non_increasing_version",
               [](Engine& e, const std::string&) { return Run(e, Header(1), {PairBatch()}); },
               absl::StatusCode::kFailedPrecondition,
               {"version", "committed version 1"}});
  c.push_back({"version_zero",
               [](Engine& e, const std::string&) { return Run(e, Header(0), {PairBatch()}); },
               absl::StatusCode::kInvalidArgument,
               {"version"}});
  c.push_back({"missing_shm_segment",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[0].parts[0].source = ShmSource{"wpub_missing_segment_zz", 0, 4096};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kNotFound,
               {kGate, "wpub_missing_segment_zz"}});
  c.push_back({"shm_name_traversal",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[0].parts[0].source = ShmSource{"../../etc/passwd", 0, 4096};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "../../etc/passwd"}});
  c.push_back({"shm_range_beyond_segment",
               [](Engine& e, const std::string& shm) {
                 BatchInput b = PairBatch();
                 b.tensors[0].parts[0].source = ShmSource{shm, (1 << 16) - 100, 4096};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kOutOfRange,
               {kGate, "exceeds shared-memory segment"}});
  c.push_back(
      {"unsupported_recipe",
       [](Engine& e, const std::string&) { return Run(e, Header(2, "mxfp8"), {PairBatch()}); },
       absl::StatusCode::kInvalidArgument,
       {"recipe 'mxfp8'"}});
  c.push_back({"empty_publication",
               [](Engine& e, const std::string&) { return Run(e, Header(2), {}); },
               absl::StatusCode::kInvalidArgument,
               {"publication 2", "empty"}});
  c.push_back({"empty_batch",
               [](Engine& e, const std::string&) {
                 return Run(e, Header(2), {BatchInput{kFc1, {}}});
               },
               absl::StatusCode::kInvalidArgument,
               {kFc1, "no tensors"}});
  c.push_back({"duplicate_tensor_names",
               [](Engine& e, const std::string&) {
                 return Run(e, Header(2), {PairBatch(), PairBatch()});
               },
               absl::StatusCode::kInvalidArgument,
               {"duplicate tensor name", kGate}});
  c.push_back({"cuda_ipc_on_cpu_path",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[1].parts[0].source = CudaIpcSource{};
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kUnimplemented,
               {std::string("CUDA IPC ingestion needs the GPU backend; tensor ") + kUp}});
  c.push_back({"non_finite_weights",
               [](Engine& e, const std::string&) {
                 return Run(e, Header(2), {PairBatch()}, true, INFINITY);
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "non-finite"}});
  c.push_back({"concat_dim_out_of_range",
               [](Engine& e, const std::string&) {
                 BatchInput b = PairBatch();
                 b.tensors[0].concat_dim = 2;
                 return Run(e, Header(2), {b});
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "concat_dim 2"}});
  c.push_back({"inline_chunk_for_shm_part",
               [](Engine& e, const std::string& shm) -> absl::Status {
                 auto s = e.Open(Header(2));
                 if (!s.ok()) return s.status();
                 BatchInput b = PairBatch();
                 b.tensors[0].parts[0].source = ShmSource{shm, 0, 4096};
                 if (auto st = (*s)->AddBatch(b); !st.ok()) return st;
                 std::vector<uint8_t> chunk(16);
                 return (*s)->AppendInline(0, 0, 0, 0, chunk);
               },
               absl::StatusCode::kInvalidArgument,
               {kGate, "not an inline part"}});
  c.push_back({"bucket_size_out_of_range",
               [](Engine& e, const std::string&) {
                 PublicationHeader h = Header(2);
                 h.bucket_bytes = 3;
                 return Run(e, h, {PairBatch()});
               },
               absl::StatusCode::kInvalidArgument,
               {"bucket_bytes"}});
  c.push_back({"unknown_policy_key",
               [](Engine& e, const std::string&) {
                 PublicationHeader h = Header(2);
                 h.policy_json = R"({"first_last_layers_bf17": true})";
                 return Run(e, h, {PairBatch()});
               },
               absl::StatusCode::kInvalidArgument,
               {"first_last_layers_bf17"}});
  c.push_back(
      {"inline_limit",
       [](Engine& e, const std::string&) {
         return Run(e, Header(2), {BatchInput{kFc1, {Inline("big.weight", {4096, 1024})}}}, false);
       },
       absl::StatusCode::kOutOfRange,
       {"inline bytes"}});
  c.push_back({"concurrent_publisher",
               [](Engine& e, const std::string&) -> absl::Status {
                 auto first = e.Open(Header(2));
                 if (!first.ok()) return first.status();
                 return e.Open(Header(3)).status();
               },
               absl::StatusCode::kFailedPrecondition,
               {"version 2 is active"}});
  return c;
}

TEST(EngineBadInputTest, EveryCaseFailsCleanlyAndTheEngineKeepsServing) {
  EngineOptions options;
  options.bucket_bytes = 4096;
  options.min_bucket_bytes = 1024;
  options.max_inline_bytes = 4 << 20;
  auto engine = Engine::Create(options, nullptr);
  ASSERT_TRUE(engine.ok());
  auto receiver =
      transport::testing::InprocReceiver::Start((*engine)->pull_transport(), {.name = "r"});
  ASSERT_TRUE(receiver.ok());
  auto shm = testing::ShmSegment::Create("/wpub_engine_bad_" + std::to_string(getpid()), 1 << 16);

  const auto good = testing::ModelBatches(synthetic::ModelShape::Tiny(), 1);
  {
    auto session = (*engine)->Open(Header(1));
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE(testing::Send(**session, good).ok());
    auto report = (*session)->Commit();
    ASSERT_TRUE(report.ok() && report->status == PublicationStatus::kCommitted);
    ASSERT_TRUE((*receiver)->WaitForOutcome(1, absl::Seconds(10)));
  }
  const auto v1 = (*receiver)->committed_tensors();

  const std::vector<BadCase> cases = Cases();
  EXPECT_GE(cases.size(), 15u);
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status s = c.run(**engine, shm->name());
    EXPECT_EQ(s.code(), c.code) << s;
    for (const std::string& m : c.mentions) {
      EXPECT_TRUE(testing::HasSubstr(s, m)) << "'" << m << "' not in: " << s;
    }
    const EngineStatus st = (*engine)->GetStatus();
    EXPECT_EQ(st.committed_version, 1u);
    EXPECT_FALSE(st.active.has_value());
    EXPECT_EQ((*receiver)->committed_version(), 1u);
  }
  EXPECT_TRUE((*receiver)->committed_tensors() == v1);
  // Failures that reached the transport were discarded by the receiver (its abort event arrives
  // on the receiver's own thread: wait for it).
  EXPECT_TRUE((*receiver)->WaitForAborts(2, 1, absl::Seconds(10)));
  const auto aborted = (*receiver)->aborted_versions();
  EXPECT_EQ(std::count(aborted.begin(), aborted.end(), 2u), 1);  // the non-finite case

  // Still serving: version 2 commits.
  auto session = (*engine)->Open(Header(2));
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(
      testing::Send(**session, testing::ModelBatches(synthetic::ModelShape::Tiny(), 2)).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
  // Version 2 already has an outcome (the aborted case above): wait for its commit itself.
  ASSERT_TRUE((*receiver)->WaitForCommitted(2, absl::Seconds(10)));
  EXPECT_EQ((*receiver)->committed_version(), 2u);
}

TEST(EngineBadInputTest, NonFiniteWeightsCommitWhenAllowed) {
  auto engine = Engine::Create(EngineOptions{}, nullptr);
  ASSERT_TRUE(engine.ok());
  PublicationHeader h = Header(1);
  h.allow_non_finite = true;
  auto session = (*engine)->Open(h);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->AddBatch(PairBatch()).ok());
  std::vector<uint8_t> nan_bytes(4096, 0xFF);  // bf16 0xFFFF = NaN
  std::vector<uint8_t> ok_bytes(4096, 0x3F);
  ASSERT_TRUE((*session)->AppendInline(0, 0, 0, 0, nan_bytes).ok());
  ASSERT_TRUE((*session)->AppendInline(0, 1, 0, 0, ok_bytes).ok());
  auto report = (*session)->Commit();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status, PublicationStatus::kCommitted);
  EXPECT_EQ(report->non_finite, 2048u);
}

}  // namespace
}  // namespace wpub::engine
