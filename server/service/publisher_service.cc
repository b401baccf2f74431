// Publish: header -> Engine::Open, batches -> AddBatch, chunks -> AppendInline, commit ->
// Commit. Every way a stream can be malformed ends with a status naming the field.
#include "server/service/publisher_service.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/common/log_context.h"
#include "server/common/log_escape.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

const char* KindName(pb::PublishRequest::KindCase kind) {
  switch (kind) {
    case pb::PublishRequest::kHeader:
      return "header";
    case pb::PublishRequest::kBatch:
      return "batch";
    case pb::PublishRequest::kChunk:
      return "chunk";
    case pb::PublishRequest::kCommit:
      return "commit";
    case pb::PublishRequest::kExpected:
      return "expected";
    case pb::PublishRequest::KIND_NOT_SET:
      break;
  }
  return "empty message";
}

// While Commit blocks, the sync API offers no cancellation callback: this watcher polls the
// RPC's cancellation flag and aborts the session, so a trainer that goes away mid-commit does
// not leave receivers waiting for the acknowledgement deadline.
class CancelWatcher {
 public:
  CancelWatcher(grpc::ServerContext* context, engine::PublicationSession* session)
      : thread_([this, context, session] {
          std::unique_lock lock(mu_);
          while (!done_) {
            if (context->IsCancelled()) {
              session->Abort(absl::CancelledError("the trainer cancelled the Publish RPC"));
              return;
            }
            cv_.wait_for(lock, std::chrono::milliseconds(20));
          }
        }) {}
  ~CancelWatcher() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Bounds the gaps of a Publish stream: while the handler waits in Read for the trainer's
// next message for longer than the idle timeout, it cancels the RPC (Read then returns false
// and the handler aborts the publication). Only the waits count, so the daemon's own work
// between reads (Open queueing behind another publication, AddBatch) never trips it.
class IdleWatchdog {
 public:
  IdleWatchdog(grpc::ServerContext* context, absl::Duration timeout)
      : timeout_(absl::ToChronoNanoseconds(timeout)), thread_([this, context] { Run(context); }) {}
  ~IdleWatchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Bracket one blocking Read.
  void BeginWait() {
    {
      std::lock_guard lock(mu_);
      waiting_ = true;
      deadline_ = std::chrono::steady_clock::now() + timeout_;
    }
    cv_.notify_all();
  }
  void EndWait() {
    std::lock_guard lock(mu_);
    waiting_ = false;
  }
  // True once the watchdog cancelled the RPC.
  bool fired() {
    std::lock_guard lock(mu_);
    return fired_;
  }

 private:
  void Run(grpc::ServerContext* context) {
    std::unique_lock lock(mu_);
    while (!done_ && !fired_) {
      if (!waiting_) {
        cv_.wait(lock);
      } else if (std::chrono::steady_clock::now() < deadline_) {
        cv_.wait_until(lock, deadline_);
      } else {
        fired_ = true;
        context->TryCancel();
      }
    }
  }

  const std::chrono::nanoseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool waiting_ = false;
  bool fired_ = false;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;  // last: starts after the state it reads is initialized
};

// Read with the watchdog armed for its duration.
bool ReadWatched(grpc::ServerReader<pb::PublishRequest>* reader, IdleWatchdog* watchdog,
                 pb::PublishRequest* request) {
  watchdog->BeginWait();
  const bool ok = reader->Read(request);
  watchdog->EndWait();
  return ok;
}

}  // namespace

PublisherService::PublisherService(engine::Engine* engine, ServiceOptions options,
                                   group::Coordinator* coordinator)
    : engine_(engine), options_(std::move(options)), coordinator_(coordinator) {}

void PublisherService::set_publisher_name(std::string name) {
  std::lock_guard lock(name_mu_);
  publisher_name_ = std::move(name);
}

std::string PublisherService::publisher_name() const {
  std::lock_guard lock(name_mu_);
  return publisher_name_;
}

grpc::Status PublisherService::Publish(grpc::ServerContext* context,
                                       grpc::ServerReader<pb::PublishRequest>* reader,
                                       pb::PublicationReport* reply) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  const std::string idle_limit = absl::FormatDuration(options_.ingest_idle_timeout);
  std::optional<IdleWatchdog> watchdog(std::in_place, context, options_.ingest_idle_timeout);
  pb::PublishRequest request;
  if (!ReadWatched(reader, &*watchdog, &request)) {
    if (watchdog->fired()) {
      spdlog::warn("Publish from {} sent no header for {} (--ingest_idle_timeout): cancelled",
                   LogEscape(context->peer()), idle_limit);
      return {grpc::StatusCode::DEADLINE_EXCEEDED,
              absl::StrCat("no header within ", idle_limit, " (--ingest_idle_timeout)")};
    }
    if (context->IsCancelled()) return {grpc::StatusCode::CANCELLED, "Publish cancelled"};
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "empty Publish stream: the first message must be 'header'"};
  }
  if (request.kind_case() != pb::PublishRequest::kHeader) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("the first Publish message must be 'header', got '",
                         KindName(request.kind_case()), "'")};
  }
  absl::StatusOr<engine::PublicationHeader> header = wire::FromProto(request.header());
  if (!header.ok()) return wire::ToGrpcStatus(header.status());
  header->allow_non_finite = header->allow_non_finite || options_.allow_non_finite;
  // Every line of this publication on this thread carries its version (JSON logs).
  const LogField version_field("version", std::to_string(header->version));
  if (header->group.has_value() && header->group->publisher.empty()) {
    header->group->publisher = publisher_name();
  }
  absl::StatusOr<std::unique_ptr<engine::PublicationSession>> opened = engine_->Open(*header);
  if (!opened.ok()) {
    spdlog::warn("publish v{} refused: {}", header->version, LogEscape(opened.status().ToString()));
    return wire::ToGrpcStatus(opened.status());
  }
  std::unique_ptr<engine::PublicationSession> session = std::move(*opened);
  if (header->group.has_value()) {
    spdlog::info("publish v{} opened (model '{}', recipe '{}'), member {} of {} of group '{}'",
                 header->version, LogEscape(header->model_id), LogEscape(header->recipe),
                 header->group->member, header->group->members, LogEscape(header->group->group));
  } else {
    spdlog::info("publish v{} opened (model '{}', recipe '{}')", header->version,
                 LogEscape(header->model_id), LogEscape(header->recipe));
  }

  // Any early return below destroys the session, which aborts it (engine contract); an error
  // from the session itself has already ended the publication as FAILED.
  // Bad input ends the publication FAILED, a cancelled or timed-out stream ABORTED.
  auto fail = [&](absl::Status status) {
    spdlog::warn("publish v{} failed: {}", header->version, LogEscape(status.ToString()));
    if (absl::IsCancelled(status) || absl::IsDeadlineExceeded(status)) {
      session->Abort(status);
    } else {
      session->Fail(status);
    }
    return wire::ToGrpcStatus(status);
  };
  uint64_t messages = 1;
  bool committed = false;
  while (!committed) {
    if (!ReadWatched(reader, &*watchdog, &request)) {
      if (watchdog->fired()) {
        return fail(absl::DeadlineExceededError(absl::StrCat(
            "publication v", header->version, ": the trainer sent no message for ", idle_limit,
            " after message ", messages, " (--ingest_idle_timeout); aborted")));
      }
      if (context->IsCancelled()) {
        return fail(absl::CancelledError(
            absl::StrCat("the trainer cancelled publication v", header->version)));
      }
      return fail(absl::InvalidArgumentError(
          absl::StrCat("the Publish stream of v", header->version, " ended without 'commit'")));
    }
    ++messages;
    switch (request.kind_case()) {
      case pb::PublishRequest::kHeader:
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "duplicate 'header' (message ", messages, ") in publication v", header->version)));
      case pb::PublishRequest::kBatch: {
        absl::StatusOr<engine::BatchInput> batch = wire::FromProto(request.batch());
        if (!batch.ok()) return fail(batch.status());
        if (absl::Status s = session->AddBatch(std::move(*batch)); !s.ok()) return fail(s);
        break;
      }
      case pb::PublishRequest::kChunk: {
        const pb::Chunk& c = request.chunk();
        if (c.data().size() > options_.max_chunk_bytes) {
          return fail(absl::ResourceExhaustedError(absl::StrCat(
              "chunk.data of ", c.data().size(), " bytes exceeds the limit of ",
              options_.max_chunk_bytes, " bytes (batch ", c.batch_index(), ", tensor ",
              c.tensor_index(), ", part ", c.part_index(), "); split it into smaller chunks")));
        }
        absl::Status s = session->AppendInline(
            c.batch_index(), c.tensor_index(), c.part_index(), c.offset(),
            absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(c.data().data()),
                                c.data().size()));
        if (!s.ok()) return fail(s);
        break;
      }
      case pb::PublishRequest::kCommit:
        committed = true;
        break;
      case pb::PublishRequest::kExpected: {
        std::vector<std::string> names(request.expected().names().begin(),
                                       request.expected().names().end());
        if (absl::Status s = session->DeclareExpected(std::move(names)); !s.ok()) return fail(s);
        break;
      }
      case pb::PublishRequest::KIND_NOT_SET:
        return fail(absl::InvalidArgumentError(
            absl::StrCat("Publish message ", messages, " has no kind set")));
    }
  }

  watchdog.reset();  // Commit is the daemon's work: no idle bound, only cancellation
  absl::StatusOr<engine::PublicationReport> report;
  {
    CancelWatcher watcher(context, session.get());
    report = session->Commit();
  }
  if (!report.ok()) {
    spdlog::warn("publish v{} failed at commit: {}", header->version,
                 LogEscape(report.status().ToString()));
    return wire::ToGrpcStatus(report.status());
  }
  wire::ToProto(*report, reply);
  spdlog::info("publish v{} {}: {:.3f} s, {} bytes out, {} quantized, {} passed{}{}",
               report->version, engine::PublicationStatusName(report->status), report->wall_seconds,
               report->bytes_out, report->tensors_quantized, report->tensors_passthrough,
               report->error.empty() ? "" : ": ", LogEscape(report->error));
  for (const transport::ReceiverOutcome& o : report->receivers) {
    if (!o.pause.paused) continue;
    // One line per engine (in JSON logs: the engine and its pause window as fields).
    const LogField engine_field("engine", o.name);
    const LogField paused_field("paused_seconds", absl::StrFormat("%.6f", o.pause.seconds));
    spdlog::info(
        "publish v{}: {} engine {} served nothing for {:.3f} s{} (waiting for wpub {:.3f} s, "
        "transfer {:.3f} s, its own finalization {:.3f} s)",
        report->version, o.family, LogEscape(o.name), o.pause.seconds,
        o.pause.resumed ? "" : " and is still paused", o.pause.waiting, o.pause.transfer,
        o.pause.finalization);
  }
  if (report->status == engine::PublicationStatus::kCommitted && report->receivers.empty()) {
    // Committed to nobody: no engine or pull receiver held it. Counted in
    // wpub_publications_without_receivers_total (alert WpubCommittedToNoReceiver).
    spdlog::warn(
        "publish v{} committed to no receiver: no engine or pull receiver was connected, so no "
        "rollout engine holds this version (--min_receivers=N aborts such a publication)",
        report->version);
  }
  // An aborted publication (receiver failure, cancellation, shutdown) is still answered with
  // its report: the trainer needs the per-receiver outcome, and the status field says ABORTED.
  return grpc::Status::OK;
}

grpc::Status PublisherService::GetStatus(grpc::ServerContext* context,
                                         const pb::GetStatusRequest* request,
                                         pb::GetStatusResponse* reply) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  engine::EngineStatus status = engine_->GetStatus();
  wire::ToProto(status, reply);
  // last_reports is bounded by the engine; trim to what was asked for.
  while (static_cast<uint32_t>(reply->recent_reports_size()) > request->max_reports()) {
    reply->mutable_recent_reports()->RemoveLast();
  }
  reply->set_daemon_version(options_.daemon_version);
  if (coordinator_ != nullptr) {
    if (std::optional<engine::GroupSummary> g = coordinator_->LastRound()) {
      wire::ToProto(*g, reply->mutable_publication_group());
    }
  }
  if (std::optional<engine::RolloutGroupInfo> group = engine_->EngineGroup()) {
    wire::ToProto(*group, reply->mutable_engine_group());
    // The engines are the NCCL transport's receivers.
    for (pb::ReceiverInfo& r : *reply->mutable_receivers()) {
      for (const engine::RolloutEngineInfo& e : group->engines) {
        if (e.url == r.name()) r.set_transport("nccl");
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status PublisherService::ConnectEngines(grpc::ServerContext* context,
                                              const pb::ConnectEnginesRequest* request,
                                              pb::ConnectEnginesResponse* reply) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  absl::StatusOr<engine::RolloutConnectRequest> r = wire::FromProto(*request);
  if (!r.ok()) return wire::ToGrpcStatus(r.status());
  std::vector<std::string> names;
  for (const engine::RolloutEndpoint& e : r->engines)
    names.push_back(absl::StrCat(e.url, "=", e.gpus));
  spdlog::info("ConnectEngines: {} (group '{}')", LogEscape(absl::StrJoin(names, ",")),
               LogEscape(r->group_name));
  absl::StatusOr<engine::RolloutGroupInfo> group = engine_->ConnectEngines(*r);
  if (!group.ok()) {
    spdlog::warn("ConnectEngines refused or failed: {}", LogEscape(group.status().ToString()));
    return wire::ToGrpcStatus(group.status());
  }
  wire::ToProto(*group, reply);
  spdlog::info("ConnectEngines: group {} (generation {}, world size {}) formed",
               LogEscape(group->group_name), group->generation, group->world_size);
  return grpc::Status::OK;
}

grpc::Status PublisherService::Restore(grpc::ServerContext* context,
                                       const pb::RestoreRequest* request, pb::ReplayReport* reply) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  std::string reason = request->reason().empty() ? "wpubctl restore" : request->reason();
  if (reason.size() > 256) reason.resize(256);
  spdlog::info("Restore asked: {}", LogEscape(reason));
  absl::StatusOr<engine::ReplayReport> report = engine_->Restore(std::move(reason));
  if (!report.ok()) {
    spdlog::warn("Restore refused: {}", LogEscape(report.status().ToString()));
    return wire::ToGrpcStatus(report.status());
  }
  wire::ToProto(*report, reply);
  return grpc::Status::OK;
}

grpc::Status PublisherService::ListReports(grpc::ServerContext* context,
                                           const pb::ListReportsRequest* request,
                                           pb::ListReportsResponse* reply) {
  if (grpc::Status auth = CheckAuth(options_, *context); !auth.ok()) return auth;
  size_t limit = request->limit() == 0 ? options_.default_report_limit : request->limit();
  for (const engine::PublicationReport& r : engine_->RecentReports(limit)) {
    wire::ToProto(r, reply->add_reports());
  }
  return grpc::Status::OK;
}

}  // namespace wpub::server
