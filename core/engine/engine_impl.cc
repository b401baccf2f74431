// Engine::Impl: creating the engine's parts, the CUDA IPC resolver's lock, recording reports,
// the observer's upkeep and the version floor beyond the committed version.
#include "core/engine/engine_impl.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/delta/bucket_patch.h"
#include "core/engine/cpu_backend.h"

namespace wpub::engine {
namespace {

absl::Status ValidateOptions(const EngineOptions& options) {
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
  if (!(options.patches.max_patch_fraction > 0 && options.patches.max_patch_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "patches.max_patch_fraction ", options.patches.max_patch_fraction, " is outside (0, 1]"));
  }
  if (options.patches.enabled && options.retain.where == transport::RetainWhere::kOff) {
    return absl::InvalidArgumentError(
        "--patches makes bucket patches from the retained copy: it needs --retain (host, "
        "pinned or device)");
  }
  return absl::OkStatus();
}

// How long a patch waits for the retained memory to have copied the bucket it diffs: the copy
// is enqueued right after the bucket is announced (the retained copy is the transport group's
// last member), so this bounds only a stalled publication.
constexpr absl::Duration kPatchStagingWait = absl::Seconds(30);

}  // namespace

// Patches against the retained committed version (core/delta/bucket_patch.h): a bucket laid
// out as the retained one (same size, same tensors at the same offsets) is diffed against it.
transport::PatchSource Engine::Impl::MakePatchSource(std::weak_ptr<Impl> weak,
                                                     const EngineOptions& options) {
  transport::PatchSource source;
  source.full_every = options.patches.full_every;
  source.base_version = [weak]() -> uint64_t {
    const std::shared_ptr<Impl> self = weak.lock();
    if (self == nullptr) return 0;
    const std::shared_ptr<const transport::RetainedVersion> r = self->retained().Retained();
    // A group version's copy is this member's part: a receiver holds the assembled version.
    return r == nullptr || !r->manifest.group.empty() ? 0 : r->manifest.version;
  };
  const delta::BucketPatchOptions patch{.max_patch_fraction = options.patches.max_patch_fraction,
                                        .threads = options.cpu_threads};
  // Where the version in flight stages (device or pinned retained memory), or null.
  auto staging_of = [weak](uint64_t version) -> std::shared_ptr<transport::RetainedBytes> {
    const std::shared_ptr<Impl> self = weak.lock();
    return self == nullptr ? nullptr : self->retained().StagingBytes(version);
  };
  source.can_defer = [weak](uint64_t version) {
    const std::shared_ptr<Impl> self = weak.lock();
    return self != nullptr && self->retained().Staging(version);
  };
  source.whole = [staging_of](const transport::Bucket& next)
      -> absl::StatusOr<std::shared_ptr<const transport::Bucket>> {
    const std::shared_ptr<transport::RetainedBytes> staging = staging_of(next.version);
    if (staging == nullptr) {
      return absl::UnavailableError(absl::StrCat("bucket ", next.manifest.index, " of v",
                                                 next.version, ": its version is not staging"));
    }
    return staging->StagedHostCopy(next.version, next.manifest, kPatchStagingWait);
  };
  source.make = [weak, patch, staging_of, whole = source.whole](
                    uint64_t base_version,
                    const transport::Bucket& next) -> std::shared_ptr<const transport::Bucket> {
    const std::shared_ptr<Impl> self = weak.lock();
    if (self == nullptr) return nullptr;
    const std::shared_ptr<const transport::RetainedVersion> r = self->retained().Retained();
    const uint32_t i = next.manifest.index;
    if (r == nullptr || r->manifest.version != base_version || i >= r->bucket_count()) {
      return nullptr;
    }
    const transport::BucketManifest& was = r->manifest.buckets[i];
    if (was.nbytes != next.manifest.nbytes || was.tensors != next.manifest.tensors) return nullptr;
    auto out = std::make_shared<transport::Bucket>();
    out->version = next.version;
    out->manifest = next.manifest;
    out->patch_base = base_version;
    // Where the copies live (device memory): diffed there, only the patch comes back.
    const std::shared_ptr<transport::RetainedBytes> staging =
        r->memory != nullptr ? staging_of(next.version) : nullptr;
    if (staging != nullptr) {
      absl::StatusOr<transport::RetainedPatch> made =
          staging->Patch(*r->memory, was, next.manifest, next.manifest.checksum,
                         patch.max_patch_fraction, kPatchStagingWait);
      if (made.ok()) {
        if (!made->made) return nullptr;
        out->bytes = std::move(made->bytes);
        return out;
      }
      if (!absl::IsUnimplemented(made.status())) {
        spdlog::warn("v{}: bucket {}'s patch in retained memory: {}; diffing host copies",
                     next.version, i, made.status().ToString());
      }
    }
    absl::StatusOr<std::shared_ptr<const transport::Bucket>> base = r->HostBucketAt(i);
    if (!base.ok()) {
      spdlog::warn("v{}: no patch for bucket {}: the retained bucket: {}", next.version, i,
                   base.status().ToString());
      return nullptr;
    }
    // A bucket the transport took without its bytes: read from the staging copy.
    std::shared_ptr<const transport::Bucket> next_bytes;
    if (next.bytes_deferred) {
      absl::StatusOr<std::shared_ptr<const transport::Bucket>> read = whole(next);
      if (!read.ok()) {
        spdlog::warn("v{}: no patch for bucket {}: its staged bytes: {}", next.version, i,
                     read.status().ToString());
        return nullptr;
      }
      next_bytes = *std::move(read);
    }
    delta::BucketPatchPlan plan = delta::DiffBucket(
        (*base)->span(), was.checksum, next_bytes != nullptr ? next_bytes->span() : next.span(),
        next.manifest.checksum, patch);
    if (plan.full) return nullptr;
    out->bytes = std::move(plan.patch);
    return out;
  };
  return source;
}

absl::StatusOr<std::shared_ptr<Engine::Impl>> Engine::Impl::Create(const EngineOptions& options,
                                                                   EngineObserver* observer,
                                                                   EngineComponents components) {
  WPUB_RETURN_IF_ERROR(ValidateOptions(options));
  Parts parts;
  WPUB_ASSIGN_OR_RETURN(parts.cache, policy::IgnoreSnapshotCache::Create({}));
  transport::PullTransportOptions pull = options.pull;
  pull.max_version = options.max_version;  // a receiver's claim is bounded as versions are
  WPUB_ASSIGN_OR_RETURN(parts.pull, transport::PullTransport::Create(pull));
  WPUB_ASSIGN_OR_RETURN(parts.retained, transport::RetainedCopy::Create(
                                            options.retain, std::move(components.retained_memory)));
  if (components.backend) {
    parts.backend = std::move(components.backend);
  } else {
    WPUB_ASSIGN_OR_RETURN(parts.backend, CpuBackend::Create({options.cpu_threads}));
  }
  parts.cuda_ipc = std::move(components.cuda_ipc);
  parts.connector = components.connector;
  parts.owned_connector = std::move(components.owned_connector);
  if (parts.connector == nullptr) parts.connector = parts.owned_connector.get();
  parts.group_joiner = components.group_joiner;
  std::vector<transport::Transport*> members;
  for (auto& t : components.transports) {
    if (!t) return absl::InvalidArgumentError("EngineComponents::transports holds a null entry");
    members.push_back(t.get());
    parts.extra_transports.push_back(std::move(t));
  }
  members.push_back(parts.pull.get());
  members.push_back(parts.retained.get());  // last: it copies what the others were sent
  WPUB_ASSIGN_OR_RETURN(parts.transports, transport::TransportGroup::Create(std::move(members)));
  parts.observer = observer;
  std::shared_ptr<Impl> impl(new Impl(options, std::move(parts)));
  impl->StartRefresher();
  // A pull receiver that subscribes holding less than the committed version is caught up.
  // Weak: a subscription on another thread may outlive the engine's parts.
  // So is a rollout engine that comes back from a restart holding less (the rollout group's
  // engine watch).
  const std::weak_ptr<Impl> weak = impl;
  impl->pull_->SetBehindListener([weak](const std::string& receiver, uint64_t held) {
    if (const std::shared_ptr<Impl> self = weak.lock()) {
      self->replayer_->Request(ReplayKind::kCatchUp,
                               absl::StrCat("receiver ", receiver, " subscribed holding v", held));
    }
  });
  if (options.patches.enabled) impl->pull_->SetPatchSource(MakePatchSource(weak, options));
  for (const auto& t : impl->extra_transports_) {
    if (options.patches.enabled) {
      // The engines of rollout groups that take patches get them against the retained version.
      t->SetEnginePatches(
          {.retained = [weak]() -> std::shared_ptr<const transport::RetainedVersion> {
             const std::shared_ptr<Impl> self = weak.lock();
             return self == nullptr ? nullptr : self->retained().Retained();
           },
           .max_patch_fraction = options.patches.max_patch_fraction,
           .full_every = options.patches.full_every,
           .threads = options.cpu_threads});
    }
    t->SetBehindListener([weak](const std::string& engine, uint64_t held) {
      if (const std::shared_ptr<Impl> self = weak.lock()) {
        self->replayer_->Request(ReplayKind::kCatchUp,
                                 absl::StrCat("engine ", engine, " came back holding v", held));
      }
    });
  }
  return impl;
}

Engine::Impl::Impl(const EngineOptions& options, Parts parts)
    : options_(options),
      cache_(std::move(parts.cache)),
      pull_(std::move(parts.pull)),
      retained_(std::move(parts.retained)),
      extra_transports_(std::move(parts.extra_transports)),
      transports_(std::move(parts.transports)),
      cuda_ipc_(std::move(parts.cuda_ipc)),
      owned_connector_(std::move(parts.owned_connector)),
      connector_(parts.connector),
      group_joiner_(parts.group_joiner),
      backend_(std::move(parts.backend)),
      observer_(parts.observer),
      ledger_(options.report_history, options.status_reports),
      replayer_(std::make_unique<Replayer>(this, options.report_history)) {}

Engine::Impl::~Impl() {
  replayer_->Stop();
  StopRefresher();
}

void Engine::Impl::StartRefresher() {
  if (observer_ == nullptr) return;
  refresher_ = std::thread([this] {
    std::unique_lock lock(refresher_mu_);
    while (!stop_refresher_) {
      refresher_cv_.wait_for(lock, std::chrono::milliseconds(500));
      if (stop_refresher_) break;
      lock.unlock();
      RefreshObserver();
      lock.lock();
    }
  });
}

void Engine::Impl::StopRefresher() {
  {
    std::lock_guard lock(refresher_mu_);
    stop_refresher_ = true;
  }
  refresher_cv_.notify_all();
  if (refresher_.joinable()) refresher_.join();
}

void Engine::Impl::Shutdown() {
  ledger_.BeginShutdown();
  replayer_->Stop();
  StopRefresher();
  pull_->Shutdown();
  EndCudaIpcPublication();
}

CudaIpcResolveFn Engine::Impl::ResolveFn() {
  if (!cuda_ipc_) return nullptr;
  return [this](const CudaIpcSource& source, uint64_t bytes, absl::string_view tensor) {
    std::lock_guard lock(ipc_mu_);
    return cuda_ipc_->Resolve(source, bytes, tensor);
  };
}

void Engine::Impl::EndCudaIpcPublication() {
  if (!cuda_ipc_) return;
  std::lock_guard lock(ipc_mu_);
  cuda_ipc_->EndPublication();
}

void Engine::Impl::Record(const PublicationSession::State* holder,
                          const PublicationReport& report) {
  ledger_.Record(holder, report);
  if (observer_ != nullptr) {
    observer_->OnReport(report);
    RefreshObserver();
  }
  // An abort left engines holding part of it: restore them to the committed version.
  if (report.status == PublicationStatus::kAborted && !report.group.has_value()) {
    std::vector<std::string> dirty;
    for (const transport::ReceiverOutcome& o : report.receivers) {
      if (o.dirty) dirty.push_back(o.name);
    }
    if (!dirty.empty() && retained_->Retained() != nullptr) {
      replayer_->Request(ReplayKind::kRestore,
                         absl::StrCat("v", report.version, " aborted leaving ",
                                      absl::StrJoin(dirty, ", "), " dirty"));
    }
  }
}

void Engine::Impl::OnReplay(const ReplayReport& report) {
  if (observer_ == nullptr) return;
  observer_->OnReplay(report);
  RefreshObserver();
}

void Engine::Impl::RefreshObserver() {
  if (observer_ == nullptr) return;
  observer_->OnState({.ignore_cache_hits = cache_->hits(),
                      .ignore_cache_misses = cache_->misses(),
                      .receivers = transports_->Receivers()});
}

absl::Status Engine::Impl::CheckVersionFloor(uint64_t version, uint64_t committed_version,
                                             const std::optional<RolloutGroupInfo>& group) const {
  uint64_t floor = committed_version;
  if (const std::optional<transport::HeldVersion> held = pull_->HighestHeldVersion()) {
    floor = std::max(floor, held->version);
  }
  if (group.has_value()) {
    if (version <= group->highest_engine_version) {
      std::string who;
      for (const RolloutEngineInfo& e : group->engines) {
        if (e.weight_version == group->highest_engine_version) who = e.url;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "version: ", version, " is not greater than version ", group->highest_engine_version,
          " that engine ", who.empty() ? std::string("(left the group)") : who,
          " serves; a restarted daemon must publish beyond what its engines hold"));
    }
    floor = std::max(floor, group->highest_engine_version);
  }
  if (version - floor > options_.max_version_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "version: ", version, " is more than ", options_.max_version_step, " above ", floor,
        " (the version to exceed); a jump that large would use up the version space"));
  }
  return absl::OkStatus();
}

}  // namespace wpub::engine
