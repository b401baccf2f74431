// `wpubctl connect-engines --engines=http://h:p=2,...`: asks a running GPU-path wpubd to form its
// NCCL weight-update group with these SGLang engines (ConnectEngines) and prints the layout.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "core/common/status.h"
#include "core/engine/pause_policy.h"
#include "core/rollout/sglang_driver.h"
#include "server/wpubctl/publish_common.h"
#include "server/wpubctl/subcommand.h"

ABSL_FLAG(std::string, engines, "",
          "connect-engines: the engines, \"http://host:port=gpus,...\" (gpus defaults to 1), in "
          "rank order.");
ABSL_FLAG(std::string, group_name, "",
          "connect-engines: base name of the weight-update group (empty: the daemon's).");
ABSL_FLAG(std::string, pause, "",
          "connect-engines: the engines' pause policy, \"<in_flight>[:<cache>]\" (abort, wait, "
          "retract, keep; flush, keep), e.g. \"retract:keep\" (empty: the daemon's --pause).");
ABSL_FLAG(absl::Duration, join_timeout, absl::ZeroDuration(),
          "connect-engines: how long the engines have to join (0: the daemon's "
          "--engine_deadline).");

namespace wpub::wpubctl {
namespace {

absl::Status Connect() {
  WPUB_ASSIGN_OR_RETURN(std::vector<rollout::EngineSpec> specs,
                        rollout::ParseEngineSpecs(absl::GetFlag(FLAGS_engines)));
  wpub::v1::ConnectEnginesRequest request;
  for (const rollout::EngineSpec& e : specs) {
    wpub::v1::EngineEndpoint* ep = request.add_engines();
    ep->set_url(e.url);
    ep->set_kind(e.family);
    ep->set_gpus(e.gpus);
  }
  request.set_group_name(absl::GetFlag(FLAGS_group_name));
  if (const std::string text = absl::GetFlag(FLAGS_pause); !text.empty()) {
    // Read here for the syntax (the daemon checks what the engines' family can do).
    WPUB_ASSIGN_OR_RETURN(engine::PausePolicy pause, engine::ParsePausePolicy(text));
    request.mutable_pause()->set_in_flight(std::string(engine::InFlightName(pause.in_flight)));
    if (pause.cache != engine::PausePolicy::Cache::kDefault) {
      request.mutable_pause()->set_cache(std::string(engine::CacheName(pause.cache)));
    }
  }
  const absl::Duration join = absl::GetFlag(FLAGS_join_timeout);
  request.set_timeout_seconds(absl::ToDoubleSeconds(join));
  // The daemon's default join budget is 120 s: wait a little longer than whichever applies.
  const absl::Duration rpc =
      (join > absl::ZeroDuration() ? join : absl::Seconds(120)) + absl::Seconds(30);
  WPUB_ASSIGN_OR_RETURN(client::ClientOptions client_options, ClientOptionsFromFlags());
  WPUB_ASSIGN_OR_RETURN(auto client, client::PublisherClient::Create(client_options));
  WPUB_ASSIGN_OR_RETURN(wpub::v1::ConnectEnginesResponse r, client->ConnectEngines(request, rpc));
  std::printf("group       %s (generation %llu, world size %u)\n", r.group_name().c_str(),
              static_cast<unsigned long long>(r.generation()), r.world_size());
  for (const auto& e : r.engines()) {
    std::printf("  %-32s ranks %u..%u (%u GPUs) %s, pause %s\n", e.url().c_str(), e.rank_offset(),
                e.rank_offset() + e.gpus() - 1, e.gpus(), e.state().c_str(), e.pause().c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunConnectEngines(const std::vector<std::string>& /*args*/) {
  absl::Status status = Connect();
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl connect-engines: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace wpub::wpubctl
