// The gRPC-pull receiver: one subscription stream at a time (subscribing again when the daemon
// comes back), buckets pulled and acknowledged in order, the output file staged before the last
// acknowledgement and renamed into place on commit.
#include "clients/recv/receiver.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "clients/recv/receiver_impl.h"
#include "clients/recv/safetensors.h"
#include "clients/recv/staging.h"
#include "core/common/status.h"
#include "core/transport/checksum.h"
#include "wire/convert.h"
#include "wire/status_map.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::recv {
namespace {

// Whether a subscription that ended with `status` may be tried again: the daemon went away,
// restarted or dropped us for falling behind, as opposed to refusing this receiver.
bool DaemonWentAway(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace

absl::Span<const uint8_t> CommittedModel::TensorBytes(const std::string& name) const {
  for (const transport::BucketManifest& b : manifest.buckets) {
    for (const transport::ManifestTensor& t : b.tensors) {
      if (t.name == name) return absl::MakeConstSpan(buckets[b.index]).subspan(t.offset, t.nbytes);
    }
  }
  return {};
}

std::vector<const transport::ManifestTensor*> CommittedModel::Tensors() const {
  std::vector<const transport::ManifestTensor*> out;
  for (const transport::BucketManifest& b : manifest.buckets) {
    for (const transport::ManifestTensor& t : b.tensors) out.push_back(&t);
  }
  return out;
}

absl::Status WriteCommittedSafetensors(const CommittedModel& model, const std::string& path) {
  return WriteSafetensors(path, EntriesOf(model.manifest, model.buckets),
                          MetadataOf(model.manifest));
}

namespace {

// 16 hex digits from the kernel's randomness and the process id: unique per receiving process.
std::string NewInstance() {
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  return absl::StrCat(absl::Hex(r, absl::kZeroPad16));
}

}  // namespace

Receiver::Impl::Impl(ReceiverOptions options, std::shared_ptr<grpc::ChannelCredentials> credentials,
                     uint64_t held_at_start, uint64_t adopted)
    : options_(std::move(options)),
      stage_path_(StagePath(options_.output_path)),
      instance_(NewInstance()),
      held_at_start_(held_at_start),
      adopted_version_(adopted) {
  std::vector<std::string> targets = options_.targets;
  if (targets.empty()) targets.push_back(options_.target);
  for (const std::string& target : targets) {
    auto link = std::make_unique<Link>();
    link->target = target;
    grpc::ChannelArguments args;
    // Chunks are bounded by the daemon (4 MiB by default); leave ample room.
    args.SetMaxReceiveMessageSize(256 << 20);
    // A restarted daemon is found within a second, not after gRPC's default backoff (up to
    // 120 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    link->channel = grpc::CreateCustomChannel(target, credentials, args);
    link->stub = pb::Receivers::NewStub(link->channel);
    links_.push_back(std::move(link));
  }
}

Receiver::Impl::~Impl() {
  for (auto& link : links_) link->pending.reset();
  absl::MutexLock lock(&mu_);
  // A version held in doubt stays staged on disk: the next process adopts it and asks.
  if (adopted_version_ != 0 ||
      (assembly_ != nullptr && assembly_->complete() && assembly_->staged)) {
    return;
  }
  DiscardAssembly();
}

absl::Status Receiver::Impl::Run() {
  if (links_.size() == 1) return RunLink(*links_[0]);
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(links_.size());
  for (size_t i = 0; i < links_.size(); ++i) {
    threads.emplace_back([this, i, &results] {
      results[i] = RunLink(*links_[i]);
      Stop();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& r : results) {
    if (!r.ok()) return r;
  }
  return absl::OkStatus();
}

void Receiver::Impl::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  for (auto& link : links_) {
    if (link->context) link->context->TryCancel();
  }
}

std::shared_ptr<const CommittedModel> Receiver::Impl::committed() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

ReceiverStats Receiver::Impl::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

uint64_t Receiver::Impl::held_version() const {
  absl::MutexLock lock(&mu_);
  return std::max(held_at_start_, stats_.last_committed_version);
}

absl::Status Receiver::Impl::RunLink(Link& link) {
  absl::Time deadline = absl::Now() + options_.connect_timeout;
  bool resubscribing = false;
  while (true) {
    Session session = Subscribe(link, deadline, resubscribing);
    link.pending.reset();
    if (!session.retry) return session.status;
    if (session.accepted) {
      // A new outage: it gets the whole resubscribe budget.
      deadline = absl::Now() + options_.resubscribe_timeout;
      spdlog::warn(
          "[{}] the subscription to {} ended ({}); subscribing again for up to {}, holding v{}",
          options_.name, link.target, session.status.ToString(),
          absl::FormatDuration(options_.resubscribe_timeout), held_version());
    }
    resubscribing = true;
    absl::MutexLock lock(&mu_);
    // A short pause between attempts; Stop ends it at once.
    mu_.AwaitWithTimeout(absl::Condition(&stopped_), absl::Milliseconds(100));
    if (stopped_) return absl::OkStatus();
    if (absl::Now() >= deadline) return session.status;
  }
}

bool Receiver::Impl::WaitConnected(Link& link, absl::Time deadline) {
  while (true) {
    if (Stopped()) return false;
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (link.channel->WaitForConnected(
            absl::ToChronoTime(std::min(deadline, now + absl::Milliseconds(250))))) {
      return true;
    }
  }
}

bool Receiver::Impl::Stopped() const {
  absl::MutexLock lock(&mu_);
  return stopped_;
}

Receiver::Impl::Session Receiver::Impl::Subscribe(Link& link, absl::Time deadline,
                                                  bool resubscribing) {
  Session session;
  const bool retry_allowed = options_.resubscribe_timeout > absl::ZeroDuration();
  if (!WaitConnected(link, deadline)) {
    if (Stopped()) return session;
    session.status = absl::UnavailableError(
        absl::StrCat("cannot connect to wpubd at '", link.target, "' within ",
                     absl::FormatDuration(resubscribing ? options_.resubscribe_timeout
                                                        : options_.connect_timeout)));
    return session;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return session;
    link.context = std::make_unique<grpc::ClientContext>();
    Authorize(link.context.get());
  }
  pb::SubscribeRequest request;
  request.set_receiver_name(options_.name);
  request.add_transports("pull");
  request.set_held_version(held_version());
  request.set_instance(instance_);
  request.set_accepts_patches(options_.patches);
  {
    absl::MutexLock lock(&mu_);
    request.set_staged_version(StagedVersionLocked());
  }
  std::unique_ptr<grpc::ClientReader<pb::ReceiverEvent>> reader =
      link.stub->Subscribe(link.context.get(), request);
  pb::ReceiverEvent event;
  absl::Status outcome = absl::OkStatus();
  bool done = false;
  while (!done && reader->Read(&event)) {
    session.accepted = true;
    absl::StatusOr<bool> step = Handle(link, event);
    if (!step.ok()) {
      outcome = step.status();
      done = true;
    } else {
      done = *step;
    }
  }
  if (done) link.context->TryCancel();
  grpc::Status finish = reader->Finish();
  link.token.clear();
  absl::MutexLock lock(&mu_);
  if (!outcome.ok()) {
    session.status = outcome;
    return session;
  }
  if (done || stopped_) return session;
  session.status = finish.ok() ? absl::UnavailableError("the daemon ended the subscription")
                               : wire::ToAbslStatus(finish);
  // A name still taken while resubscribing is our own old stream, not yet gone.
  session.retry =
      retry_allowed && (session.accepted || resubscribing) &&
      (DaemonWentAway(session.status) || (resubscribing && absl::IsAlreadyExists(session.status)));
  return session;
}

void Receiver::Impl::Authorize(grpc::ClientContext* context) const {
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
}

absl::StatusOr<std::unique_ptr<Receiver>> Receiver::Create(const ReceiverOptions& options) {
  if (options.name.empty()) return absl::InvalidArgumentError("receiver name must not be empty");
  if (options.target.empty() && options.targets.empty()) {
    return absl::InvalidArgumentError("target must not be empty");
  }
  for (size_t i = 0; i < options.targets.size(); ++i) {
    if (options.targets[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "] is empty"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (options.targets[j] == options.targets[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("target ", options.targets[i], " is given twice"));
      }
    }
  }
  if (options.resubscribe_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("resubscribe_timeout must not be negative");
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      wire::ChannelCredentialsFor(options.tls);
  if (!credentials.ok()) return credentials.status();
  uint64_t held = 0, adopted = 0;
  if (!options.output_path.empty()) {
    WPUB_RETURN_IF_ERROR(CheckOutputWritable(
        options.output_path, absl::StrCat(options.output_path, ".probe-", ::getpid())));
    held = VersionInFile(options.output_path);
    adopted = AdoptOrphanedStaging(options.output_path, held, StagePath(options.output_path));
  }
  return std::unique_ptr<Receiver>(
      new Receiver(std::make_unique<Impl>(options, *std::move(credentials), held, adopted)));
}

Receiver::Receiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Receiver::~Receiver() = default;
absl::Status Receiver::Run() { return impl_->Run(); }
void Receiver::Stop() { impl_->Stop(); }
std::shared_ptr<const CommittedModel> Receiver::committed() const { return impl_->committed(); }
ReceiverStats Receiver::stats() const { return impl_->stats(); }
uint64_t Receiver::held_version() const { return impl_->held_version(); }

}  // namespace wpub::recv
