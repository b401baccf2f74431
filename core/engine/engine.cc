// Engine: creation, Open (header validation, version rules, one publication at a time with
// optional queueing), status, report history, metrics upkeep and shutdown.
#include "core/engine/engine.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/cpu_backend.h"
#include "core/engine/engine_impl.h"

namespace wpub::engine {
namespace {

std::chrono::steady_clock::time_point SteadyIn(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return std::chrono::steady_clock::now();
  if (d > absl::Hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(d);
}

// Why `url` is not http(s)://host[:port], or "" when it is.
std::string UrlProblem(const std::string& url) {
  if (url.empty()) return "the URL is empty";
  for (char c : url) {
    if (c <= ' ' || c == 0x7f) return "the URL holds whitespace or a control character";
  }
  size_t host = 0;
  if (absl::StartsWith(url, "http://")) {
    host = 7;
  } else if (absl::StartsWith(url, "https://")) {
    host = 8;
  } else {
    return "the URL must start with http:// or https://";
  }
  const std::string rest = url.substr(host);
  // The SGLang driver's HTTP client takes scheme://host:port only.
  if (rest.find_first_of("/?#") != std::string::npos) {
    return "the URL must be scheme://host[:port], without a path";
  }
  if (rest.empty() || rest[0] == ':') return "the URL has no host";
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && rest.back() != ']') {
    int port = 0;
    if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return "the URL's port is not in [1, 65535]";
    }
  }
  return "";
}

}  // namespace

absl::Status ValidateEngineConnectRequest(const EngineConnectRequest& request) {
  if (request.engines.empty()) return absl::InvalidArgumentError("engines: no engine given");
  std::set<std::string> seen;
  for (size_t i = 0; i < request.engines.size(); ++i) {
    const EngineEndpoint& e = request.engines[i];
    const std::string entry = absl::StrCat("engines[", i, "] '", e.url, "'");
    if (std::string why = UrlProblem(e.url); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", why));
    }
    if (e.gpus < 1 || e.gpus > 4096) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry, ": gpus is ", e.gpus, "; it must be in [1, 4096]"));
    }
    if (!seen.insert(e.url).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": the URL is given twice"));
    }
  }
  if (request.group_name.size() > 100) {
    return absl::InvalidArgumentError("group_name: longer than 100 characters");
  }
  for (char c : request.group_name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("group_name '", request.group_name,
                       "': only letters, digits, '_', '-' and '.' are allowed"));
    }
  }
  if (request.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout ", absl::FormatDuration(request.timeout), " is negative"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Engine::Impl

void Engine::Impl::Finish(const PublicationSession::State* state, const PublicationReport& report) {
  {
    std::lock_guard lock(mu);
    reports.push_front(report);
    while (reports.size() > std::max<size_t>(options.report_history, 1)) reports.pop_back();
    if (report.status == PublicationStatus::kCommitted) {
      committed_version = report.version;
      committed_model_id = report.model_id;
      committed_at = absl::Now();
    }
    if (active.get() == state) active.reset();
  }
  cv.notify_all();
  if (metrics) {
    metrics->RecordReport(report);
    RefreshMetrics();
  }
}

absl::Status Engine::Impl::CheckVersionFloor(uint64_t version,
                                             const std::optional<EngineGroupInfo>& group) const {
  uint64_t floor = committed_version;
  if (const std::optional<HeldVersion> held = transport->HighestHeldVersion()) {
    floor = std::max(floor, held->version);
  }
  if (group.has_value()) {
    if (version <= group->highest_engine_version) {
      std::string who;
      for (const ConnectedEngine& e : group->engines) {
        if (e.weight_version == group->highest_engine_version) who = e.url;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "version: ", version, " is not greater than version ", group->highest_engine_version,
          " that engine ", who.empty() ? std::string("(left the group)") : who,
          " serves; a restarted daemon must publish beyond what its engines hold"));
    }
    floor = std::max(floor, group->highest_engine_version);
  }
  if (version - floor > options.max_version_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "version: ", version, " is more than ", options.max_version_step, " above ", floor,
        " (the version to exceed); a jump that large would use up the version space"));
  }
  return absl::OkStatus();
}

void Engine::Impl::RefreshMetrics() {
  if (!metrics) return;
  metrics->SetIgnoreCacheCounters(cache->hits(), cache->misses());
  metrics->SetReceivers(transports->Receivers());
}

// ---------------------------------------------------------------------------------------------
// Engine

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       prometheus::Registry* registry) {
  return Create(options, registry, EngineComponents{});
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       prometheus::Registry* registry,
                                                       EngineComponents components) {
  if (options.min_bucket_bytes == 0 || options.min_bucket_bytes > options.max_bucket_bytes) {
    return absl::InvalidArgumentError("min_bucket_bytes must be in [1, max_bucket_bytes]");
  }
  if (options.bucket_bytes < options.min_bucket_bytes ||
      options.bucket_bytes > options.max_bucket_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_bytes ", options.bucket_bytes,
                                                   " is outside [", options.min_bucket_bytes, ", ",
                                                   options.max_bucket_bytes, "]"));
  }
  if (options.ack_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ack_deadline must be positive");
  }
  if (options.cpu_threads < 1) return absl::InvalidArgumentError("cpu_threads must be >= 1");
  if (options.max_attempts < 1) return absl::InvalidArgumentError("max_attempts must be >= 1");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  WPUB_ASSIGN_OR_RETURN(impl->cache, policy::IgnoreSnapshotCache::Create({}));
  WPUB_ASSIGN_OR_RETURN(impl->transport, PullTransport::Create(options.pull));
  if (components.backend) {
    impl->backend = std::move(components.backend);
  } else {
    WPUB_ASSIGN_OR_RETURN(impl->backend, CpuBackend::Create({options.cpu_threads}));
  }
  impl->cuda_ipc = std::move(components.cuda_ipc);
  impl->connector = components.connector;
  std::vector<Transport*> members;
  for (auto& t : components.transports) {
    if (!t) return absl::InvalidArgumentError("EngineComponents::transports holds a null entry");
    members.push_back(t.get());
    impl->extra_transports.push_back(std::move(t));
  }
  members.push_back(impl->transport.get());
  WPUB_ASSIGN_OR_RETURN(impl->transports, TransportGroup::Create(std::move(members)));
  if (registry != nullptr) {
    WPUB_ASSIGN_OR_RETURN(impl->metrics, metrics::EngineMetrics::Create(registry));
    Impl* raw = impl.get();
    // wpub_engines{state} follows receivers that connect or leave between publications.
    impl->refresher = std::thread([raw] {
      std::unique_lock lock(raw->mu);
      while (!raw->stop_refresher) {
        raw->cv.wait_for(lock, std::chrono::milliseconds(500));
        if (raw->stop_refresher) break;
        lock.unlock();
        raw->RefreshMetrics();
        lock.lock();
      }
    });
  }
  return std::unique_ptr<Engine>(new Engine(std::shared_ptr<Impl>(std::move(impl))));
}

Engine::Engine(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->shutting_down = true;
    impl_->stop_refresher = true;
  }
  impl_->cv.notify_all();
  if (impl_->refresher.joinable()) impl_->refresher.join();
  impl_->transport->Shutdown();
  if (impl_->cuda_ipc) {
    std::lock_guard ipc_lock(impl_->ipc_mu);
    impl_->cuda_ipc->EndPublication();
  }
}

absl::StatusOr<std::unique_ptr<PublicationSession>> Engine::Open(const PublicationHeader& header) {
  if (header.version == 0) {
    return absl::InvalidArgumentError("version: must be >= 1 (0 means nothing committed)");
  }
  if (header.version > impl_->options.max_version) {
    return absl::InvalidArgumentError(absl::StrCat("version: ", header.version,
                                                   " exceeds the largest version allowed, ",
                                                   impl_->options.max_version));
  }
  WPUB_ASSIGN_OR_RETURN(ParsedRecipe recipe, ParseRecipeString(header.recipe));
  const uint64_t bucket_bytes =
      header.bucket_bytes == 0 ? impl_->options.bucket_bytes : header.bucket_bytes;
  if (bucket_bytes < impl_->options.min_bucket_bytes ||
      bucket_bytes > impl_->options.max_bucket_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_bytes: ", bucket_bytes, " is outside [",
                                                   impl_->options.min_bucket_bytes, ", ",
                                                   impl_->options.max_bucket_bytes, "]"));
  }
  absl::StatusOr<policy::PolicySettings> settings = policy::ParseHeaderSettings(
      header.policy_json, header.quantization_config_json, recipe.recipe);
  if (!settings.ok()) {
    return absl::Status(settings.status().code(),
                        absl::StrCat("policy: ", settings.status().message()));
  }
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::Policy::Create(*std::move(settings), impl_->cache.get());
  impl_->RefreshMetrics();
  if (!policy.ok()) {
    return absl::Status(policy.status().code(),
                        absl::StrCat("policy: ", policy.status().message()));
  }

  // Read before taking the engine lock (it is never held while calling into a transport).
  const std::optional<EngineGroupInfo> group = EngineGroup();
  std::shared_ptr<PublicationSession::State> state;
  {
    std::unique_lock lock(impl_->mu);
    if (impl_->shutting_down) return absl::UnavailableError("the engine is shutting down");
    if (impl_->active || impl_->connecting) {
      // What holds the slot, for the messages below.
      const auto holder = [&] {
        return impl_->active ? absl::StrCat("publication version ", impl_->active->version())
                             : std::string("ConnectEngines (forming the engine group)");
      };
      if (!header.queue) {
        return absl::FailedPreconditionError(
            absl::StrCat(holder(), " is active; version ", header.version, " must wait for it"));
      }
      const bool freed = impl_->cv.wait_until(lock, SteadyIn(header.queue_timeout), [&] {
        return (!impl_->active && !impl_->connecting) || impl_->shutting_down;
      });
      if (impl_->shutting_down) return absl::UnavailableError("the engine is shutting down");
      if (!freed) {
        return absl::DeadlineExceededError(absl::StrCat("version ", header.version, " queued for ",
                                                        absl::FormatDuration(header.queue_timeout),
                                                        " behind ", holder()));
      }
    }
    if (header.version <= impl_->committed_version) {
      return absl::FailedPreconditionError(
          absl::StrCat("version: ", header.version, " is not greater than the committed version ",
                       impl_->committed_version));
    }
    // A receiver may hold a newer version than this engine committed (a daemon restart).
    WPUB_RETURN_IF_ERROR(impl_->transport->CheckVersionAhead(header.version));
    WPUB_RETURN_IF_ERROR(impl_->CheckVersionFloor(header.version, group));
    if (impl_->cuda_ipc) {
      // The previous publication ended (its Execute returned before it released the slot).
      std::lock_guard ipc_lock(impl_->ipc_mu);
      impl_->cuda_ipc->EndPublication();
    }
    state = std::make_shared<PublicationSession::State>(impl_, header, std::move(recipe),
                                                        *std::move(policy), bucket_bytes);
    impl_->active = state;
  }
  return std::unique_ptr<PublicationSession>(new PublicationSession(header.version, state));
}

absl::StatusOr<EngineGroupInfo> Engine::ConnectEngines(const EngineConnectRequest& request) {
  WPUB_RETURN_IF_ERROR(ValidateEngineConnectRequest(request));
  if (impl_->connector == nullptr) {
    return absl::FailedPreconditionError(
        "this daemon has no GPU path: ConnectEngines needs wpubd built with CUDA and NCCL and "
        "started with --gpu_path (or --engines)");
  }
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->shutting_down) return absl::UnavailableError("the engine is shutting down");
    if (impl_->active) {
      return absl::FailedPreconditionError(
          absl::StrCat("publication version ", impl_->active->version(),
                       " is active; ConnectEngines must wait until it ends"));
    }
    if (impl_->connecting) {
      return absl::FailedPreconditionError("another ConnectEngines is in progress");
    }
    impl_->connecting = true;
  }
  // No engine lock while the connector probes and waits for the engines' joins: GetStatus
  // keeps answering, and Open sees `connecting`.
  absl::StatusOr<EngineGroupInfo> group = impl_->connector->Connect(request);
  {
    std::lock_guard lock(impl_->mu);
    impl_->connecting = false;
  }
  impl_->cv.notify_all();
  impl_->RefreshMetrics();
  return group;
}

std::optional<EngineGroupInfo> Engine::EngineGroup() const {
  if (impl_->connector == nullptr) return std::nullopt;
  return impl_->connector->Group();
}

EngineStatus Engine::GetStatus() const {
  EngineStatus s;
  std::shared_ptr<PublicationSession::State> active;
  {
    std::lock_guard lock(impl_->mu);
    s.committed_version = impl_->committed_version;
    s.committed_model_id = impl_->committed_model_id;
    s.committed_at = impl_->committed_at;
    s.shutting_down = impl_->shutting_down;
    for (size_t i = 0; i < impl_->reports.size() && i < impl_->options.status_reports; ++i) {
      s.last_reports.push_back(impl_->reports[i]);
    }
    active = impl_->active;
  }
  if (active) {
    s.active = ActivePublication{active->version(),   active->model_id(),    active->state(),
                                 active->opened_at(), active->num_batches(), active->num_tensors()};
  }
  s.receivers = impl_->transports->Receivers();
  s.backend = std::string(impl_->backend->name());
  return s;
}

std::vector<PublicationReport> Engine::RecentReports(size_t n) const {
  std::lock_guard lock(impl_->mu);
  const size_t k = std::min(n, impl_->reports.size());
  return std::vector<PublicationReport>(impl_->reports.begin(), impl_->reports.begin() + k);
}

PullTransport* Engine::pull_transport() { return impl_->transport.get(); }

void Engine::BeginShutdown() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->shutting_down = true;
  }
  impl_->cv.notify_all();
}

absl::Status Engine::Drain(absl::Time deadline) {
  BeginShutdown();
  std::shared_ptr<PublicationSession::State> active;
  {
    std::unique_lock lock(impl_->mu);
    impl_->cv.wait_until(lock, SteadyIn(deadline - absl::Now()), [&] { return !impl_->active; });
    active = impl_->active;
  }
  absl::Status result = absl::OkStatus();
  if (active) {
    result = absl::DeadlineExceededError(absl::StrCat(
        "publication ", active->version(), " did not finish before the shutdown deadline"));
    active->Abort(result);
    // An abort during Commit is finished by the Commit thread, which returns promptly.
    std::unique_lock lock(impl_->mu);
    impl_->cv.wait_for(lock, std::chrono::seconds(10), [&] { return !impl_->active; });
  }
  impl_->transports->Abort("the engine is shutting down");
  impl_->transport->Shutdown();
  return result;
}

}  // namespace wpub::engine
