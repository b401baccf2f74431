// `wpubctl status`: the daemon's committed version, active publication, receivers (and how far
// each is behind), the retained copy, recent replays and reports. `wpubctl restore`: replay the
// retained committed version to every engine and every receiver behind it.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "core/common/status.h"
#include "server/wpubctl/publish_common.h"
#include "server/wpubctl/subcommand.h"

ABSL_FLAG(uint32_t, reports, 8, "How many recent reports `wpubctl status` lists.");
ABSL_FLAG(int32_t, restore_timeout_seconds, 600,
          "How long `wpubctl restore` waits for the daemon's replay to end.");

namespace wpub::wpubctl {
namespace {

absl::Status PrintStatus() {
  WPUB_ASSIGN_OR_RETURN(client::ClientOptions client_options, ClientOptionsFromFlags());
  WPUB_ASSIGN_OR_RETURN(auto client, client::PublisherClient::Create(client_options));
  WPUB_ASSIGN_OR_RETURN(wpub::v1::GetStatusResponse s,
                        client->GetStatus(absl::GetFlag(FLAGS_reports)));
  std::printf("daemon      %s at %s (%s backend, %s)\n", s.daemon_version().c_str(),
              client_options.target.c_str(), s.backend().c_str(),
              s.serving() ? "serving" : "shutting down");
  std::printf("committed   v%llu\n", static_cast<unsigned long long>(s.committed_version()));
  if (s.has_active()) {
    std::printf("active      v%llu (%s, model '%s', %.1f s)\n",
                static_cast<unsigned long long>(s.active().version()), s.active().state().c_str(),
                s.active().model_id().c_str(), s.active().age_seconds());
  } else {
    std::printf("active      none\n");
  }
  std::printf("receivers   %d\n", s.receivers_size());
  for (const auto& r : s.receivers()) {
    const uint64_t behind =
        r.held_version() < s.committed_version() ? s.committed_version() - r.held_version() : 0;
    std::printf(
        "  %-20s %-10s %-6s last committed v%llu, holds v%llu%s\n", r.name().c_str(),
        r.state().c_str(), r.transport().c_str(),
        static_cast<unsigned long long>(r.last_committed_version()),
        static_cast<unsigned long long>(r.held_version()),
        behind == 0
            ? ""
            : absl::StrFormat(" (%llu behind)", static_cast<unsigned long long>(behind)).c_str());
  }
  const wpub::v1::RetainedCopy& retained = s.retained();
  if (retained.version() != 0) {
    std::printf(
        "retained    v%llu in %s memory: %llu bytes, %u buckets, %llu bytes held (bound %s)\n",
        static_cast<unsigned long long>(retained.version()), retained.where().c_str(),
        static_cast<unsigned long long>(retained.bytes()), retained.buckets(),
        static_cast<unsigned long long>(retained.held_bytes()),
        retained.max_bytes() == 0
            ? "none"
            : absl::StrFormat("%llu bytes", static_cast<unsigned long long>(retained.max_bytes()))
                  .c_str());
  } else {
    std::printf("retained    nothing (%s)\n", retained.reason().c_str());
  }
  for (const wpub::v1::ReplayReport& r : s.recent_replays()) {
    std::printf("  %-8s v%-6llu %-10s %8.3f s %3d receivers  %s%s%s\n", r.kind().c_str(),
                static_cast<unsigned long long>(r.version()),
                r.completed() ? "completed" : (r.preempted() ? "preempted" : "failed"), r.seconds(),
                r.receivers_size(), r.trigger().c_str(), r.error().empty() ? "" : ": ",
                r.error().c_str());
  }
  if (s.has_publication_group()) {
    const wpub::v1::GroupSummary& g = s.publication_group();
    std::printf("group       '%s' v%llu, %u members, %s%s%s (slowest member %d, failed %d)\n",
                g.group().c_str(), static_cast<unsigned long long>(g.version()), g.members(),
                g.outcome().c_str(), g.error().empty() ? "" : ": ", g.error().c_str(),
                g.slowest_member(), g.failed_member());
    for (const wpub::v1::GroupMemberSummary& m : g.members_detail()) {
      std::printf(
          "  member %-3u %-28s %-12s %6llu tensors %12llu bytes out %3u buckets %8.3f s%s%s\n",
          m.member(), m.publisher().c_str(), m.state().c_str(),
          static_cast<unsigned long long>(m.tensors()),
          static_cast<unsigned long long>(m.bytes_out()), m.buckets(), m.seconds(),
          m.error().empty() ? "" : "  ", m.error().c_str());
    }
  }
  if (s.has_engine_group()) {
    const wpub::v1::EngineGroup& g = s.engine_group();
    std::printf("engines     %d, group '%s' (generation %llu, world size %u, %s, store %s)\n",
                g.engines_size(), g.group_name().c_str(),
                static_cast<unsigned long long>(g.generation()), g.world_size(),
                g.healthy() ? "healthy" : "not formed", g.store_address().c_str());
    for (const auto& e : g.engines()) {
      std::printf("  %-32s rank offset %-4u %u GPUs  %-9s pause %s\n", e.url().c_str(),
                  e.rank_offset(), e.gpus(), e.state().c_str(), e.pause().c_str());
    }
  }
  // How long each engine served nothing in the newest publication, and where that time went.
  for (int i = 0; i < s.recent_reports_size(); ++i) {
    const wpub::v1::PublicationReport& last = s.recent_reports(i);
    bool any = false;
    for (const wpub::v1::ReceiverOutcome& o : last.receivers()) any |= o.has_pause();
    if (!any) continue;
    std::printf(
        "paused      v%llu, per engine: served nothing for (waiting for wpub + transfer + "
        "the engine's finalization)\n",
        static_cast<unsigned long long>(last.version()));
    for (const wpub::v1::ReceiverOutcome& o : last.receivers()) {
      if (!o.has_pause()) continue;
      const wpub::v1::PauseWindow& w = o.pause();
      std::printf("  %-32s %-6s %8.3f s = %.3f + %.3f + %.3f%s\n", o.name().c_str(),
                  o.family().c_str(), w.seconds(), w.waiting(), w.transfer(), w.finalization(),
                  w.resumed() ? "" : "  (still paused)");
    }
    break;
  }
  if (s.recent_reports_size() > 0) {
    std::printf("\nrecent publications (newest first)\n%s", ReportTableHeader().c_str());
    for (const auto& r : s.recent_reports()) std::printf("%s", ReportTableRow(r).c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunStatus(const std::vector<std::string>& /*args*/) {
  absl::Status status = PrintStatus();
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl status: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

int RunRestore(const std::vector<std::string>& args) {
  absl::Status status = [&]() -> absl::Status {
    WPUB_ASSIGN_OR_RETURN(client::ClientOptions client_options, ClientOptionsFromFlags());
    WPUB_ASSIGN_OR_RETURN(auto client, client::PublisherClient::Create(client_options));
    WPUB_ASSIGN_OR_RETURN(
        wpub::v1::ReplayReport r,
        client->Restore(args.empty() ? "wpubctl restore" : args[0],
                        absl::Seconds(absl::GetFlag(FLAGS_restore_timeout_seconds))));
    std::printf("restore of v%llu %s in %.3f s: %u buckets, %llu bytes, %d receivers\n",
                static_cast<unsigned long long>(r.version()),
                r.completed() ? "completed" : (r.preempted() ? "preempted" : "failed"), r.seconds(),
                r.buckets(), static_cast<unsigned long long>(r.bytes()), r.receivers_size());
    for (const wpub::v1::ReceiverOutcome& o : r.receivers()) {
      std::printf("  %-32s %-8s%s%s%s\n", o.name().c_str(), o.state().c_str(),
                  o.dirty() ? " dirty" : "", o.error().empty() ? "" : "  ", o.error().c_str());
    }
    if (!r.completed()) return absl::AbortedError(r.error());
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    std::fprintf(stderr, "wpubctl restore: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace wpub::wpubctl
