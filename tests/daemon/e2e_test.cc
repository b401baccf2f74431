// End to end with real processes: the built wpubd and two wpub-recv receivers; a synthetic
// GLM-like MoE published in several versions (inline chunks, shared memory, multi-part tensors,
// two NVFP4 recipes); every tensor each receiver saved equals the independent CPU reference
// byte for byte; versions advance; reports, status, health and scraped metrics agree.
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/recv/safetensors.h"
#include "kernels/nvfp4.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/reference.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

void ExpectFileEqualsReference(const recv::SafetensorsFile& file,
                               const ExpectedPublication& expected, const std::string& who) {
  EXPECT_EQ(file.tensors.size(), expected.tensors.size()) << who;
  size_t compared = 0;
  for (const auto& [name, want] : expected.tensors) {
    auto it = file.tensors.find(name);
    if (it == file.tensors.end()) {
      ADD_FAILURE() << who << ": tensor " << name << " missing";
      continue;
    }
    EXPECT_EQ(it->second.dtype, recv::SafetensorsDTypeName(want.desc.dtype)) << who << " " << name;
    EXPECT_EQ(it->second.shape, want.desc.shape) << who << " " << name;
    EXPECT_TRUE(it->second.bytes == want.bytes) << who << ": bytes of " << name << " differ";
    ++compared;
  }
  EXPECT_EQ(compared, expected.tensors.size());
}

struct Variant {
  std::string recipe;
  kernels::QuantMode mode;
  client::StreamOptions stream;
};

TEST(DaemonEndToEnd, SyntheticMoeToTwoReceiversByteExactOverSeveralVersions) {
  HarnessOptions options;
  options.receivers = 2;
  // Small buckets so a publication spans many of them; every receiver must take part.
  options.daemon_flags = {"--min_receivers=2", "--bucket_bytes=131072"};
  auto harness = DaemonHarness::Start(options);
  ASSERT_TRUE(harness.ok()) << harness.status();
  DaemonHarness& h = **harness;

  absl::StatusOr<synthetic::SyntheticModel> model = synthetic::SyntheticModel::Create(
      synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
  ASSERT_TRUE(model.ok()) << model.status();
  const policy::PolicySettings settings = TestSettings();

  std::vector<Variant> variants(4);
  variants[0].recipe = "nvfp4";
  variants[0].mode = kernels::QuantMode::Standard();
  variants[0].stream.chunk_bytes = 64 << 10;
  variants[1].recipe = "nvfp4";
  variants[1].mode = kernels::QuantMode::Standard();
  variants[1].stream.source = client::PayloadSource::kShm;
  variants[2].recipe = "nvfp4_4over6:mse-e256-exact";
  variants[2].mode =
      kernels::QuantMode::FourOverSix(kernels::ErrMetric::kMSE, 256, kernels::ErrKind::kExact);
  variants[2].stream.parts = 2;
  variants[2].stream.concat_dim = 1;
  variants[2].stream.chunk_bytes = 4096;
  variants[3].recipe = "nvfp4";
  variants[3].mode = kernels::QuantMode::Standard();
  variants[3].stream.source = client::PayloadSource::kShm;
  variants[3].stream.parts = 2;
  variants[3].stream.concat_dim = 0;

  double wall_sum = 0;
  uint64_t bytes_out_sum = 0, quantized_sum = 0, passthrough_sum = 0;
  for (size_t i = 0; i < variants.size(); ++i) {
    const uint64_t version = 10 + 5 * i;  // strictly increasing, not contiguous
    const uint64_t seed = 1000 + version;
    SCOPED_TRACE(absl::StrCat("v", version, " recipe ", variants[i].recipe));
    absl::StatusOr<ExpectedPublication> expected =
        ComputeExpected(*model, settings, variants[i].mode, seed);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ASSERT_GT(expected->quantized, 0u);
    ASSERT_GT(expected->ignored, 0u);

    absl::StatusOr<pb::PublicationReport> report =
        h.client().Publish(MakeHeader(settings, version, variants[i].recipe), model->batches(),
                           client::SyntheticFiller(seed), variants[i].stream);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    EXPECT_EQ(report->version(), version);
    EXPECT_EQ(report->error_code(), 0);
    EXPECT_EQ(report->tensors().quantized(), expected->quantized);
    EXPECT_EQ(report->tensors().passthrough(), expected->passthrough);
    EXPECT_EQ(report->tensors().ignored(), expected->ignored);
    EXPECT_EQ(report->bytes_in(), expected->input_bytes);
    EXPECT_EQ(report->bytes_out(), expected->output_bytes);
    EXPECT_GT(report->num_buckets(), 1u);
    EXPECT_EQ(report->host_syncs(), 0u);  // the CPU path never synchronizes with a device
    EXPECT_GT(report->wall_seconds(), 0);
    ASSERT_EQ(report->receivers_size(), 2);
    for (const auto& r : report->receivers()) {
      EXPECT_TRUE(r.committed()) << r.name() << ": " << r.error();
    }
    wall_sum += report->wall_seconds();
    bytes_out_sum += report->bytes_out();
    quantized_sum += report->tensors().quantized();
    passthrough_sum += report->tensors().passthrough();

    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<recv::SafetensorsFile> file = WaitForFileVersion(h.recv_output(r), version);
      ASSERT_TRUE(file.ok()) << file.status();
      EXPECT_EQ(file->metadata["model_id"], "small-glm");
      ExpectFileEqualsReference(*file, *expected, absl::StrCat("recv-", r));
    }
    absl::StatusOr<pb::GetStatusResponse> status = h.client().GetStatus(4);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->committed_version(), version);
    EXPECT_FALSE(status->has_active());
    EXPECT_TRUE(status->serving());
  }

  // Reports (newest first) agree with what Publish returned and with the metrics.
  absl::StatusOr<std::vector<pb::PublicationReport>> reports = h.client().ListReports(16);
  ASSERT_TRUE(reports.ok()) << reports.status();
  ASSERT_EQ(reports->size(), variants.size());
  EXPECT_EQ(reports->front().version(), 25u);
  EXPECT_EQ(reports->back().version(), 10u);

  absl::StatusOr<std::map<std::string, double>> metrics = ScrapeMetrics(h.metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto metric = [&](const std::string& key) {
    auto it = metrics->find(key);
    EXPECT_NE(it, metrics->end()) << "metric " << key << " missing";
    return it == metrics->end() ? -1.0 : it->second;
  };
  EXPECT_EQ(metric("wpub_publications_total{status=\"committed\"}"), 4);
  EXPECT_EQ(metric("wpub_last_committed_version"), 25);
  EXPECT_EQ(metric("wpub_publication_seconds_count"), 4);
  EXPECT_NEAR(metric("wpub_publication_seconds_sum"), wall_sum, 1e-6 * (1 + wall_sum));
  EXPECT_EQ(metric("wpub_tensors_total{action=\"quantized\"}"), quantized_sum);
  EXPECT_EQ(metric("wpub_tensors_total{action=\"passthrough\"}"), passthrough_sum);
  EXPECT_EQ(metric("wpub_host_syncs_total"), 0);
  double published = 0;
  for (const auto& [key, value] : *metrics) {
    if (key.rfind("wpub_published_bytes_total{", 0) == 0) published += value;
  }
  EXPECT_EQ(published, static_cast<double>(bytes_out_sum));
  uint64_t nvfp4_bytes = 0;
  for (const auto& r : *reports) {
    auto it = r.bytes_out_by_format().find("nvfp4");
    if (it != r.bytes_out_by_format().end()) nvfp4_bytes += it->second;
  }
  EXPECT_GT(nvfp4_bytes, 0u);
  EXPECT_EQ(metric("wpub_published_bytes_total{format=\"nvfp4\"}"), nvfp4_bytes);

  // Health checking is served, for the server and for each service.
  EXPECT_EQ(HealthCheck(h.target()).value_or(-1), 1);
  EXPECT_EQ(HealthCheck(h.target(), "wpub.v1.Publisher").value_or(-1), 1);
  EXPECT_EQ(HealthCheck(h.target(), "wpub.v1.Receivers").value_or(-1), 1);

  // SIGTERM with nothing in flight: a clean exit 0; the receivers keep the last version.
  EXPECT_EQ(h.daemon().Stop(absl::Seconds(30)), 0);
}

}  // namespace
}  // namespace wpub::testing
