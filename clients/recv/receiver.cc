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
#include "clients/recv/safetensors.h"
#include "core/common/status.h"
#include "core/transport/checksum.h"
#include "wire/convert.h"
#include "wire/status_map.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::recv {
namespace {

namespace pb = ::wpub::v1;

// A publication being received.
struct Pending {
  transport::PublicationManifest manifest;
  std::vector<std::vector<uint8_t>> buckets;
  std::vector<bool> received;
  size_t num_received = 0;
  bool mismatch = false;  // a bucket failed its checksum: the publication will abort
  bool handed = false;    // complete: its manifest and buckets moved into the assembly
};

// The version being assembled from every member of its group (one member outside a group):
// each member's manifest and buckets, once all of them arrived and verified.
struct Assembly {
  uint64_t version = 0;
  uint32_t members = 1;
  std::map<uint32_t, Pending> parts;  // by member index
  bool staged = false;                // the output file is staged (Receiver::Impl::stage_path_)
  bool complete() const { return parts.size() == members; }
};

// The members' manifests as one: buckets in member order, re-indexed.
transport::PublicationManifest MergedManifest(const Assembly& a) {
  transport::PublicationManifest out;
  uint32_t next = 0;
  for (const auto& [member, part] : a.parts) {
    if (out.buckets.empty() && next == 0) {
      out.version = part.manifest.version;
      out.model_id = part.manifest.model_id;
      out.recipe = part.manifest.recipe;
      out.group = part.manifest.group;
      out.group_members = part.manifest.group_members;
    }
    for (transport::BucketManifest b : part.manifest.buckets) {
      b.index = next++;
      out.buckets.push_back(std::move(b));
    }
  }
  return out;
}

std::vector<SafetensorsEntry> EntriesOf(const transport::PublicationManifest& manifest,
                                        const std::vector<std::vector<uint8_t>>& buckets) {
  std::vector<SafetensorsEntry> entries;
  for (const transport::BucketManifest& b : manifest.buckets) {
    for (const transport::ManifestTensor& t : b.tensors) {
      entries.push_back({TensorDesc{t.name, t.dtype, t.shape},
                         absl::MakeConstSpan(buckets[b.index]).subspan(t.offset, t.nbytes)});
    }
  }
  return entries;
}

std::map<std::string, std::string> MetadataOf(const transport::PublicationManifest& manifest) {
  return {{"version", std::to_string(manifest.version)},
          {"model_id", manifest.model_id},
          {"recipe", manifest.recipe}};
}

// FAILED_PRECONDITION naming the path unless `path` is not a directory and a file (`probe`) can
// be created beside it: found at start-up rather than after the daemon counted us committed.
absl::Status CheckOutputWritable(const std::string& path, const std::string& probe) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("output '", path, "' is a directory; give a file path"));
  }
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "output '", path, "' is not writable: cannot create ", probe, ": ", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

// The version recorded in an existing output file (0: no file, or none recorded). Reads only
// the header.
uint64_t VersionInFile(const std::string& path) {
  absl::StatusOr<std::map<std::string, std::string>> metadata = ReadSafetensorsMetadata(path);
  if (!metadata.ok()) {
    if (!absl::IsNotFound(metadata.status())) {
      spdlog::warn("output {} is unreadable, so it holds no version: {}", path,
                   metadata.status().ToString());
    }
    return 0;
  }
  uint64_t version = 0;
  auto it = metadata->find("version");
  if (it == metadata->end() || !absl::SimpleAtoi(it->second, &version)) return 0;
  return version;
}

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

// The staging files (`<output>.staging-<pid>`) of receivers of this output that died before
// they committed or discarded them (killed between their last acknowledgement and the commit,
// say). The newest complete one holding a version above `held` is adopted -- renamed to `mine`,
// this process's staging file -- as a version in doubt, which the daemons decide once it
// subscribes (SubscribeRequest.staged_version); every other one is removed, so a full model's
// copy never stays on disk for good. A file whose process is still alive (another receiver
// writing the same output, which is the operator's mistake) is left alone. Returns the adopted
// version (0: none).
uint64_t AdoptOrphanedStaging(const std::string& output_path, uint64_t held,
                              const std::string& mine) {
  const std::filesystem::path out(output_path);
  const std::filesystem::path dir = out.has_parent_path() ? out.parent_path() : ".";
  const std::string prefix = out.filename().string() + ".staging-";
  std::vector<std::pair<uint64_t, std::filesystem::path>> orphans;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    int pid = 0;
    if (!absl::SimpleAtoi(name.substr(prefix.size()), &pid) || pid <= 0) continue;
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    orphans.emplace_back(VersionInFile(entry.path().string()), entry.path());
  }
  std::sort(orphans.begin(), orphans.end());
  uint64_t adopted = 0;
  if (!orphans.empty() && orphans.back().first > held) {
    std::error_code mv;
    std::filesystem::rename(orphans.back().second, mine, mv);
    if (!mv) {
      adopted = orphans.back().first;
      spdlog::warn(
          "{} holds v{}, staged by a receiver process that is gone and not known to "
          "have committed: kept as {} until a daemon says whether it committed",
          orphans.back().second.string(), adopted, mine);
      orphans.pop_back();
    }
  }
  for (const auto& [version, path] : orphans) {
    std::error_code rm;
    if (std::filesystem::remove(path, rm)) {
      spdlog::warn("removed {}: the staging file of a receiver process that is gone ({})",
                   path.string(),
                   version == 0 ? std::string("incomplete")
                                : absl::StrCat("v", version, ", not above v", held));
    }
  }
  return adopted;
}

// This process's staging file beside `output_path`.
std::string StagePath(const std::string& output_path) {
  return absl::StrCat(output_path, ".staging-", ::getpid());
}

// 16 hex digits from the kernel's randomness and the process id: unique per receiving process.
std::string NewInstance() {
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  return absl::StrCat(absl::Hex(r, absl::kZeroPad16));
}

}  // namespace

class Receiver::Impl {
 public:
  Impl(ReceiverOptions options, std::shared_ptr<grpc::ChannelCredentials> credentials,
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

  ~Impl() {
    for (auto& link : links_) link->pending.reset();
    absl::MutexLock lock(&mu_);
    // A version held in doubt stays staged on disk: the next process adopts it and asks.
    if (adopted_version_ != 0 ||
        (assembly_ != nullptr && assembly_->complete() && assembly_->staged)) {
      return;
    }
    DiscardAssembly();
  }

  // One subscription loop per daemon; the first that ends for good (or reaches
  // exit_after_versions) ends the others.
  absl::Status Run() {
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

  void Stop() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    for (auto& link : links_) {
      if (link->context) link->context->TryCancel();
    }
  }

  std::shared_ptr<const CommittedModel> committed() const {
    absl::MutexLock lock(&mu_);
    return committed_;
  }
  ReceiverStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  uint64_t held_version() const {
    absl::MutexLock lock(&mu_);
    return std::max(held_at_start_, stats_.last_committed_version);
  }

 private:
  // One daemon's subscription (a member of a group, or the only daemon).
  struct Link {
    std::string target;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<pb::Receivers::Stub> stub;
    std::unique_ptr<grpc::ClientContext> context;  // guarded by mu_ for Stop's TryCancel
    std::unique_ptr<Pending> pending;              // the link's thread only
    std::string token;  // the link's thread only: the subscription's, from group_info
    int64_t pulled_in_publication = 0;
  };

  // How one subscription ended.
  struct Session {
    absl::Status status;    // OK: exit_after_versions reached, or stopped
    bool accepted = false;  // the daemon accepted it (its group_info arrived)
    bool retry = false;     // subscribe again (within the resubscribe budget)
  };

  absl::Status RunLink(Link& link) {
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

  // Waits for the channel until `deadline`, in slices so Stop is noticed; false when stopped or
  // out of time.
  bool WaitConnected(Link& link, absl::Time deadline) {
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

  bool Stopped() const {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }

  // One Subscribe stream, from connecting to its end.
  Session Subscribe(Link& link, absl::Time deadline, bool resubscribing) {
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
                                 : server::ToAbslStatus(finish);
    // A name still taken while resubscribing is our own old stream, not yet gone.
    session.retry = retry_allowed && (session.accepted || resubscribing) &&
                    (DaemonWentAway(session.status) ||
                     (resubscribing && absl::IsAlreadyExists(session.status)));
    return session;
  }

  void Authorize(grpc::ClientContext* context) const {
    if (!options_.auth_token.empty()) {
      context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
    }
  }

  // Forgets the version being assembled and the file staged for it.
  void DiscardAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (assembly_ != nullptr && assembly_->staged) std::remove(stage_path_.c_str());
    assembly_.reset();
  }
  void DiscardAssembly(uint64_t version) {
    absl::MutexLock lock(&mu_);
    if (assembly_ != nullptr && assembly_->version == version) DiscardAssembly();
  }

  // Processes one event; true when Run should return (exit_after_versions reached).
  absl::StatusOr<bool> Handle(Link& link, const pb::ReceiverEvent& event) {
    switch (event.kind_case()) {
      case pb::ReceiverEvent::kGroupInfo: {
        const pb::GroupInfo& info = event.group_info();
        link.token = info.subscription_token();
        absl::MutexLock lock(&mu_);
        ++stats_.subscriptions;
        if (const uint64_t staged = StagedVersionLocked(); staged != 0) {
          if (info.staged() == pb::GroupInfo::STAGED_UNKNOWN) {
            spdlog::warn("[{}] holds v{} staged, in doubt: {} cannot say ({})", options_.name,
                         staged, link.target, info.staged_reason());
          } else {
            WPUB_RETURN_IF_ERROR(
                ResolveStagedLocked(staged, info.staged() == pb::GroupInfo::STAGED_APPLY,
                                    absl::StrCat(link.target, ": ", info.staged_reason())));
          }
        }
        spdlog::info("[{}] joined wpubd at {} (transport {}, committed version {}, holding v{})",
                     options_.name, link.target, event.group_info().transport(),
                     event.group_info().committed_version(),
                     std::max(held_at_start_, stats_.last_committed_version));
        return false;
      }
      case pb::ReceiverEvent::kManifest: {
        WPUB_ASSIGN_OR_RETURN(transport::PublicationManifest manifest,
                              server::FromProto(event.manifest()));
        link.pending = std::make_unique<Pending>();
        link.pending->buckets.resize(manifest.buckets.size());
        link.pending->received.assign(manifest.buckets.size(), false);
        for (const transport::BucketManifest& b : manifest.buckets) {
          if (b.index >= manifest.buckets.size()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "manifest of v", manifest.version, ": bucket index ", b.index, " out of range"));
          }
        }
        {
          absl::MutexLock lock(&mu_);
          // A version held staged in doubt is decided by where this daemon stands now.
          if (const uint64_t staged = StagedVersionLocked();
              staged != 0 && staged != manifest.version) {
            const uint64_t committed = event.manifest().committed_version();
            WPUB_RETURN_IF_ERROR(
                ResolveStagedLocked(staged, committed == staged,
                                    absl::StrCat(link.target, " begins v", manifest.version,
                                                 " with v", committed, " committed")));
          }
          // A version staged before a restart and published again: the new copy replaces it.
          if (adopted_version_ == manifest.version) adopted_version_ = 0;
          // A new version (or a new attempt) replaces what was assembled of another one.
          if (assembly_ != nullptr && (assembly_->version != manifest.version ||
                                       assembly_->parts.count(manifest.group_member) > 0)) {
            DiscardAssembly();
          }
        }
        link.pending->manifest = std::move(manifest);
        link.pulled_in_publication = 0;
        if (link.pending->manifest.buckets.empty()) WPUB_RETURN_IF_ERROR(HandOver(link));
        return false;
      }
      case pb::ReceiverEvent::kBucketReady: {
        const pb::BucketReady& ready = event.bucket_ready();
        if (link.pending == nullptr || link.pending->manifest.version != ready.version()) {
          return absl::InternalError(
              absl::StrCat("bucket_ready for v", ready.version(), " without its manifest"));
        }
        if (options_.leave_after_buckets >= 0 &&
            link.pulled_in_publication >= options_.leave_after_buckets) {
          spdlog::warn("[{}] leaving mid-publication v{} (fault injection)", options_.name,
                       ready.version());
          return absl::AbortedError("left mid-publication (leave_after_buckets)");
        }
        WPUB_RETURN_IF_ERROR(PullAndAck(link, ready.version(), ready.index()));
        ++link.pulled_in_publication;
        return false;
      }
      case pb::ReceiverEvent::kCommit:
        return OnCommit(link, event.commit().version());
      case pb::ReceiverEvent::kAbort: {
        spdlog::warn("[{}] v{} aborted ({}): {}", options_.name, event.abort().version(),
                     link.target, event.abort().reason());
        if (link.pending != nullptr && link.pending->manifest.version == event.abort().version()) {
          link.pending.reset();
        }
        DiscardAssembly(event.abort().version());
        absl::MutexLock lock(&mu_);
        ++stats_.aborts;
        return false;
      }
      case pb::ReceiverEvent::KIND_NOT_SET:
        break;
    }
    return absl::InternalError("an event without a kind");
  }

  // Pulls bucket `index` into the link's pending version; false (after logging) when the pull
  // failed, e.g. because the publication was aborted meanwhile (its abort event follows).
  absl::StatusOr<bool> Pull(Link& link, uint64_t version, uint32_t index,
                            uint64_t* expected_checksum, uint64_t* received) {
    Pending& pending = *link.pending;
    const transport::BucketManifest& bm = pending.manifest.buckets[index];
    std::vector<uint8_t>& bytes = pending.buckets[index];
    bytes.assign(bm.nbytes, 0);
    grpc::ClientContext context;
    Authorize(&context);
    pb::PullBucketRequest request;
    request.set_receiver_name(options_.name);
    request.set_version(version);
    request.set_index(index);
    request.set_chunk_bytes(options_.chunk_bytes);
    request.set_subscription_token(link.token);
    request.set_attempt(pending.manifest.attempt);
    std::unique_ptr<grpc::ClientReader<pb::BucketChunk>> reader =
        link.stub->PullBucket(&context, request);
    pb::BucketChunk chunk;
    // The manifest is announced before packing; the daemon sends the packed bucket's checksum
    // with the first chunk.
    *expected_checksum = bm.checksum;
    *received = 0;
    while (reader->Read(&chunk)) {
      if (chunk.offset() == 0 && chunk.checksum() != 0) *expected_checksum = chunk.checksum();
      if (chunk.offset() + chunk.data().size() > bytes.size()) {
        context.TryCancel();
        reader->Finish();
        return absl::DataLossError(absl::StrCat("bucket ", index, " of v", version,
                                                ": chunk beyond the manifest's ", bm.nbytes,
                                                " bytes"));
      }
      std::copy(chunk.data().begin(), chunk.data().end(), bytes.begin() + chunk.offset());
      *received += chunk.data().size();
    }
    grpc::Status status = reader->Finish();
    if (!status.ok()) {
      spdlog::warn("[{}] pulling bucket {} of v{} from {}: {}", options_.name, index, version,
                   link.target, status.error_message());
      return false;
    }
    return true;
  }

  absl::Status PullAndAck(Link& link, uint64_t version, uint32_t index) {
    if (index >= link.pending->buckets.size()) {
      return absl::InternalError(absl::StrCat("bucket ", index, " of v", version, " unknown"));
    }
    uint64_t expected_checksum = 0;
    uint64_t received = 0;
    WPUB_ASSIGN_OR_RETURN(bool pulled, Pull(link, version, index, &expected_checksum, &received));
    if (!pulled) return absl::OkStatus();
    Pending& pending = *link.pending;
    std::vector<uint8_t>& bytes = pending.buckets[index];
    const uint64_t nbytes = pending.manifest.buckets[index].nbytes;
    if (options_.corrupt_bucket == static_cast<int64_t>(index) && !bytes.empty()) {
      bytes[bytes.size() / 2] ^= 0x5A;
    }
    const uint64_t checksum = transport::Checksum(bytes.data(), bytes.size());
    const bool match = checksum == expected_checksum && received == nbytes;
    {
      absl::MutexLock lock(&mu_);
      ++stats_.buckets;
      stats_.bytes += received;
      if (!match) ++stats_.checksum_mismatches;
    }
    if (!match) {
      pending.mismatch = true;
      spdlog::error("[{}] bucket {} of v{}: checksum {:016x} != daemon's {:016x} ({} of {} bytes)",
                    options_.name, index, version, checksum, expected_checksum, received, nbytes);
    }
    if (!pending.received[index]) {
      pending.received[index] = true;
      ++pending.num_received;
    }
    // The last acknowledgement lets the daemon commit: before it, the version must be one this
    // receiver can apply. A receiver that cannot leaves unacknowledged, so the publication
    // aborts.
    if (!pending.mismatch && !pending.handed && pending.num_received == pending.buckets.size()) {
      WPUB_RETURN_IF_ERROR(HandOver(link));
    }
    // Acknowledge with what was computed: the daemon judges, and aborts on a mismatch.
    grpc::ClientContext ack_context;
    Authorize(&ack_context);
    pb::AckRequest ack;
    ack.set_receiver_name(options_.name);
    ack.set_version(version);
    ack.set_index(index);
    ack.set_checksum(checksum);
    ack.set_subscription_token(link.token);
    ack.set_attempt(pending.manifest.attempt);
    pb::AckResponse ack_response;
    grpc::Status ack_status = link.stub->Ack(&ack_context, ack, &ack_response);
    if (!ack_status.ok()) {
      spdlog::warn("[{}] ack of bucket {} of v{} to {}: {}", options_.name, index, version,
                   link.target, ack_status.error_message());
    }
    return absl::OkStatus();
  }

  // The link's version arrived whole and verified: its manifest and buckets join the assembly;
  // when that completes the version (every member's part), the output is staged.
  absl::Status HandOver(Link& link) {
    Pending& pending = *link.pending;
    const uint64_t version = pending.manifest.version;
    absl::MutexLock lock(&mu_);
    if (assembly_ == nullptr || assembly_->version != version) {
      DiscardAssembly();
      assembly_ = std::make_unique<Assembly>();
      assembly_->version = version;
      assembly_->members = pending.manifest.group_members;
    }
    Pending part;
    part.manifest = pending.manifest;
    part.buckets = std::move(pending.buckets);
    pending.buckets.assign(part.buckets.size(), {});
    pending.handed = true;
    assembly_->parts[pending.manifest.group_member] = std::move(part);
    if (!assembly_->complete()) return absl::OkStatus();
    if (absl::Status staged = StageOutput(); !staged.ok()) {
      return absl::Status(staged.code(),
                          absl::StrCat("cannot stage v", version, " for --output ",
                                       options_.output_path, ": ", staged.message(),
                                       "; left without acknowledging its last bucket, so the "
                                       "publication aborts"));
    }
    return absl::OkStatus();
  }

  std::vector<SafetensorsEntry> AssemblyEntries() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<SafetensorsEntry> entries;
    for (const auto& [member, part] : assembly_->parts) {
      std::vector<SafetensorsEntry> e = EntriesOf(part.manifest, part.buckets);
      entries.insert(entries.end(), e.begin(), e.end());
    }
    return entries;
  }

  // Writes the assembled version to stage_path_ (fsynced), when there is an output file.
  absl::Status StageOutput() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.output_path.empty() || assembly_->staged) return absl::OkStatus();
    WPUB_RETURN_IF_ERROR(
        StageSafetensors(stage_path_, AssemblyEntries(), MetadataOf(MergedManifest(*assembly_))));
    assembly_->staged = true;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> OnCommit(Link& link, uint64_t version) {
    absl::MutexLock lock(&mu_);
    if (stats_.last_committed_version == version && committed_ != nullptr) {
      // Another member of the group told us first: applied already.
      return options_.exit_after_versions != 0 && stats_.commits >= options_.exit_after_versions;
    }
    const bool group = link.pending != nullptr && link.pending->manifest.group_members > 1;
    if (assembly_ == nullptr || assembly_->version != version || !assembly_->complete()) {
      const std::string what = assembly_ == nullptr || assembly_->version != version
                                   ? std::string("nothing of it is held")
                                   : absl::StrCat("only ", assembly_->parts.size(), " of its ",
                                                  assembly_->members, " members' parts are held");
      if (!group) {
        return absl::InternalError(
            absl::StrCat("commit of v", version, " from ", link.target, " but ", what));
      }
      // Never apply a part of a group version: keep the previous one.
      spdlog::error("[{}] commit of v{} from {} but {}: not applied", options_.name, version,
                    link.target, what);
      if (assembly_ != nullptr && assembly_->version == version) DiscardAssembly();
      return false;
    }
    WPUB_RETURN_IF_ERROR(ApplyLocked());
    if (link.pending != nullptr && link.pending->manifest.version == version) link.pending.reset();
    return options_.exit_after_versions != 0 && stats_.commits >= options_.exit_after_versions;
  }

  // Applies the complete assembly (its version committed): publishes its staged file, makes it
  // the committed model.
  absl::Status ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t version = assembly_->version;
    if (!options_.output_path.empty()) {
      // Staged before the last acknowledgement; a publication without buckets is staged here.
      WPUB_RETURN_IF_ERROR(StageOutput());
      absl::Status published = PublishStagedFile(stage_path_, options_.output_path);
      if (!published.ok()) {
        DiscardAssembly();
        return published;
      }
      assembly_->staged = false;
    }
    auto model = std::make_shared<CommittedModel>();
    model->manifest = MergedManifest(*assembly_);
    for (auto& [member, part] : assembly_->parts) {
      for (auto& b : part.buckets) model->buckets.push_back(std::move(b));
    }
    assembly_.reset();
    spdlog::info("[{}] committed v{} ({} buckets, {} bytes)", options_.name, version,
                 model->buckets.size(), model->manifest.total_bytes());
    committed_ = std::move(model);
    ++stats_.commits;
    stats_.last_committed_version = version;
    return absl::OkStatus();
  }

  // The version this receiver holds staged without knowing its outcome (SubscribeRequest.
  // staged_version): a complete assembly, or a staging file adopted at start; 0 when none.
  uint64_t StagedVersionLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (assembly_ != nullptr && assembly_->complete()) return assembly_->version;
    return adopted_version_;
  }

  // A daemon said what became of the version held staged (`apply`: it committed; otherwise it
  // did not, or a later one committed). `why` for the log.
  absl::Status ResolveStagedLocked(uint64_t version, bool apply, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (version == 0 || StagedVersionLocked() != version) return absl::OkStatus();
    if (adopted_version_ == version) {
      adopted_version_ = 0;
      if (!apply) {
        std::remove(stage_path_.c_str());
        spdlog::warn("[{}] discarded v{}, staged before this process started: {}", options_.name,
                     version, why);
        return absl::OkStatus();
      }
      WPUB_RETURN_IF_ERROR(PublishStagedFile(stage_path_, options_.output_path));
      spdlog::info("[{}] applied v{}, staged before this process started: {}", options_.name,
                   version, why);
      ++stats_.commits;
      stats_.last_committed_version = version;
      return absl::OkStatus();
    }
    if (!apply) {
      spdlog::warn("[{}] discarded v{}, held staged: {}", options_.name, version, why);
      DiscardAssembly();
      ++stats_.aborts;
      return absl::OkStatus();
    }
    spdlog::info("[{}] v{}, held staged, committed: {}", options_.name, version, why);
    return ApplyLocked();
  }

  const ReceiverOptions options_;
  const std::string stage_path_;  // beside output_path, so the commit is one rename
  // This process's instance, the same at every daemon it subscribes to (SubscribeRequest).
  const std::string instance_;
  const uint64_t held_at_start_;  // the version in output_path's metadata at start
  std::vector<std::unique_ptr<Link>> links_;

  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Assembly> assembly_ ABSL_GUARDED_BY(mu_);
  // A complete version staged by this receiver's previous process (stage_path_ holds it), its
  // outcome not yet known: 0 when none.
  uint64_t adopted_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const CommittedModel> committed_ ABSL_GUARDED_BY(mu_);
  ReceiverStats stats_ ABSL_GUARDED_BY(mu_);
};

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
      client::ChannelCredentialsFor(options.tls);
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
