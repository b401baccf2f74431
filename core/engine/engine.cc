// Engine, the public face of Engine::Impl: Open (header validation and version rules; the slot
// and its queueing are the ledger's), ConnectEngines, status, report history and shutdown.
#include "core/engine/engine.h"

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/engine_impl.h"

namespace wpub::engine {
// ---------------------------------------------------------------------------------------------
// Engine

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       EngineObserver* observer) {
  return Create(options, observer, EngineComponents{});
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       EngineObserver* observer,
                                                       EngineComponents components) {
  WPUB_ASSIGN_OR_RETURN(std::shared_ptr<Impl> impl,
                        Impl::Create(options, observer, std::move(components)));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() { impl_->Shutdown(); }

absl::StatusOr<std::unique_ptr<PublicationSession>> Engine::Open(const PublicationHeader& header) {
  const EngineOptions& options = impl_->options();
  if (header.version == 0) {
    return absl::InvalidArgumentError("version: must be >= 1 (0 means nothing committed)");
  }
  if (header.version > options.max_version) {
    return absl::InvalidArgumentError(absl::StrCat("version: ", header.version,
                                                   " exceeds the largest version allowed, ",
                                                   options.max_version));
  }
  WPUB_ASSIGN_OR_RETURN(ParsedRecipe recipe, ParseRecipeString(header.recipe));
  const uint64_t bucket_bytes =
      header.bucket_bytes == 0 ? options.bucket_bytes : header.bucket_bytes;
  if (bucket_bytes < options.min_bucket_bytes || bucket_bytes > options.max_bucket_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_bytes: ", bucket_bytes, " is outside [",
                                                   options.min_bucket_bytes, ", ",
                                                   options.max_bucket_bytes, "]"));
  }
  absl::StatusOr<policy::PolicySettings> settings = policy::ParseHeaderSettings(
      header.policy_json, header.quantization_config_json, recipe.recipe);
  if (!settings.ok()) {
    return absl::Status(settings.status().code(),
                        absl::StrCat("policy: ", settings.status().message()));
  }
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::Policy::Create(*std::move(settings), impl_->cache());
  impl_->RefreshObserver();
  if (!policy.ok()) {
    return absl::Status(policy.status().code(),
                        absl::StrCat("policy: ", policy.status().message()));
  }

  if (header.group.has_value()) {
    WPUB_RETURN_IF_ERROR(ValidateGroupMembership(*header.group));
    if (impl_->group_joiner() == nullptr) {
      return absl::FailedPreconditionError(
          "this daemon takes no part in publication groups (no group joiner)");
    }
  }
  // Read before taking the slot (the ledger's lock is not held while calling the connector).
  const std::optional<RolloutGroupInfo> group = EngineGroup();
  const auto admit = [&](uint64_t committed_version) -> absl::StatusOr<PublicationLedger::Active> {
    // A receiver may hold a newer version than this engine committed (a daemon restart).
    WPUB_RETURN_IF_ERROR(impl_->pull().CheckVersionAhead(header.version));
    WPUB_RETURN_IF_ERROR(impl_->CheckVersionFloor(header.version, committed_version, group));
    // The previous publication ended (its Execute returned before it freed the slot).
    impl_->EndCudaIpcPublication();
    return std::make_shared<PublicationSession::State>(impl_, header, std::move(recipe),
                                                       *std::move(policy), bucket_bytes);
  };
  WPUB_ASSIGN_OR_RETURN(
      std::shared_ptr<PublicationSession::State> state,
      impl_->ledger().Acquire(header.version, header.queue, header.queue_timeout, admit));
  if (header.group.has_value()) {
    // The slot is this version's: join its group (a refusal ends the publication FAILED).
    WPUB_RETURN_IF_ERROR(state->JoinGroup(state));
  }
  return std::unique_ptr<PublicationSession>(new PublicationSession(header.version, state));
}

absl::StatusOr<RolloutGroupInfo> Engine::ConnectEngines(const RolloutConnectRequest& request) {
  WPUB_RETURN_IF_ERROR(ValidateRolloutConnectRequest(request));
  if (impl_->connector() == nullptr) {
    return absl::FailedPreconditionError(
        "this daemon has no GPU path: ConnectEngines needs wpubd built with CUDA and NCCL and "
        "started with --gpu_path (or --engines)");
  }
  WPUB_RETURN_IF_ERROR(impl_->ledger().BeginConnecting());
  // No engine lock while the connector probes and waits for the engines' joins: GetStatus
  // keeps answering, and Open sees the slot taken.
  absl::StatusOr<RolloutGroupInfo> group = impl_->connector()->Connect(request);
  impl_->ledger().EndConnecting();
  impl_->RefreshObserver();
  // Engines that joined holding less than the committed version are caught up.
  if (group.ok() && !group->engines.empty() && impl_->retained().Retained() != nullptr) {
    impl_->replayer().Request(ReplayKind::kCatchUp, "engines joined (ConnectEngines)");
  }
  return group;
}

absl::StatusOr<ReplayReport> Engine::Restore(std::string trigger) {
  return impl_->replayer().Run(ReplayKind::kRestore, std::move(trigger));
}

std::optional<RolloutGroupInfo> Engine::EngineGroup() const {
  if (impl_->connector() == nullptr) return std::nullopt;
  return impl_->connector()->Group();
}

EngineStatus Engine::GetStatus() const {
  PublicationLedger::Snapshot ledger = impl_->ledger().GetSnapshot();
  EngineStatus s;
  s.committed_version = ledger.committed_version;
  s.committed_model_id = std::move(ledger.committed_model_id);
  s.committed_at = ledger.committed_at;
  s.shutting_down = ledger.shutting_down;
  s.queued_publications = ledger.queued;
  s.last_reports = std::move(ledger.last_reports);
  if (const auto& active = ledger.active) {
    s.active =
        ActivePublication{active->version(),        active->model_id(),    active->state(),
                          active->opened_at(),      active->num_batches(), active->num_tensors(),
                          active->bytes_ingested(), active->bytes_sent(),  active->buckets_sent()};
  }
  s.receivers = impl_->transports().Receivers();
  s.backend = std::string(impl_->backend().name());
  s.backend_held_bytes = impl_->backend().held_bytes();
  s.retained = impl_->retained().Info();
  s.last_replays = impl_->replayer().Recent(impl_->options().status_reports);
  return s;
}

std::vector<PublicationReport> Engine::RecentReports(size_t n) const {
  return impl_->ledger().Recent(n);
}

transport::PullTransport* Engine::pull_transport() { return &impl_->pull(); }

void Engine::BeginShutdown() { impl_->ledger().BeginShutdown(); }

absl::Status Engine::Drain(absl::Time deadline) {
  BeginShutdown();
  impl_->replayer().Stop();  // a replay in progress is preempted
  const std::shared_ptr<PublicationSession::State> active =
      impl_->ledger().WaitUntilIdle(deadline - absl::Now());
  absl::Status result = absl::OkStatus();
  if (active && active->prepared()) {
    // A group version in doubt here: only its leader decides it. Its receivers are told
    // nothing (they hold it and learn the decision from the group's other members); the vote
    // stops asking when the group joiner shuts down.
    result = absl::UnavailableError(absl::StrCat(
        "group version ", active->version(),
        " was in doubt at shutdown (prepared, the leader's decision not yet known here); its "
        "receivers learn the decision from the group's other members"));
    impl_->pull().Shutdown(/*abort_in_flight=*/false);
    return result;
  }
  if (active) {
    result = absl::DeadlineExceededError(absl::StrCat(
        "publication ", active->version(), " did not finish before the shutdown deadline"));
    active->Stop(result, PublicationStatus::kAborted);
    // An abort during Commit is finished by the Commit thread, which returns promptly.
    impl_->ledger().WaitUntilIdle(absl::Seconds(10));
  }
  impl_->transports().Abort("the engine is shutting down");
  impl_->pull().Shutdown();
  return result;
}

}  // namespace wpub::engine
