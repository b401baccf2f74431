// `wpubctl publish-synthetic`: publishes a synthetic MoE model (DeepSeek-V3/GLM/Qwen3/Mixtral
// naming, sizes from the model flags, deterministic data) to a running wpubd and prints each
// publication's report.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "server/wpubctl/model_flags.h"
#include "server/wpubctl/policy_flags.h"
#include "server/wpubctl/publish_common.h"
#include "server/wpubctl/subcommand.h"

ABSL_FLAG(uint64_t, version, 0,
          "Version of the first publication; 0 = one past the daemon's committed version.");
ABSL_FLAG(uint64_t, count, 1, "Number of consecutive versions to publish.");

namespace wpub::wpubctl {
namespace {

absl::Status PublishSynthetic() {
  WPUB_ASSIGN_OR_RETURN(synthetic::ModelShape shape, ModelShapeFromFlags());
  WPUB_ASSIGN_OR_RETURN(synthetic::SyntheticModel model, synthetic::SyntheticModel::Create(shape));
  WPUB_ASSIGN_OR_RETURN(policy::PolicySettings settings, PolicySettingsFromFlags(model));
  WPUB_ASSIGN_OR_RETURN(client::ClientOptions client_options, ClientOptionsFromFlags());
  WPUB_ASSIGN_OR_RETURN(client::StreamOptions stream, StreamOptionsFromFlags());
  WPUB_ASSIGN_OR_RETURN(auto client, client::PublisherClient::Create(client_options));
  uint64_t version = absl::GetFlag(FLAGS_version);
  if (version == 0) {
    WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse status, client->GetStatus());
    version = status.committed_version() + 1;
  }
  std::printf("publishing %s (%lld tensors, %s) to %s\n\n",
              std::string(synthetic::NamingStyleName(shape.style)).c_str(),
              static_cast<long long>(model.num_tensors()), HumanBytes(model.num_bytes()).c_str(),
              client_options.target.c_str());
  std::printf("%s", ReportTableHeader().c_str());
  const uint64_t count = absl::GetFlag(FLAGS_count);
  for (uint64_t i = 0; i < count; ++i, ++version) {
    client::PublishTimings timings;
    absl::StatusOr<wpub::v1::PublicationReport> report =
        client->Publish(HeaderFromSettings(model, settings, version), model.batches(),
                        client::SyntheticFiller(DataSeed(version)), stream, &timings);
    if (!report.ok()) {
      return absl::Status(report.status().code(),
                          absl::StrCat("v", version, ": ", report.status().message()));
    }
    std::printf("%s", ReportTableRow(*report).c_str());
    std::fflush(stdout);
    if (report->status() != wpub::v1::PUBLICATION_STATUS_COMMITTED) {
      return absl::AbortedError(absl::StrCat("v", version, " did not commit"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunPublishSynthetic(const std::vector<std::string>& /*args*/) {
  absl::Status status = PublishSynthetic();
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl publish-synthetic: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace wpub::wpubctl
