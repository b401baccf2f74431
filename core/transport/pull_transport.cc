// The gRPC-pull transport's core half: the publication's side of the subscriptions -- receivers
// registered, buckets staged in host memory, acknowledgement bookkeeping, commit and abort.
// One mutex guards everything (pull_hub.h); waits use condition variables (one per receiver for
// Next, one for the engine's WaitAcknowledged). The receiver's side is subscription.cc.
#include "core/transport/pull_transport.h"

#include <errno.h>
#include <sys/random.h>

#include <cstring>

#include "absl/strings/escaping.h"
#include "core/transport/pull_hub.h"

namespace wpub::transport {
namespace {

// 256 bits: far beyond guessing, and the cost is one getrandom per subscription.
constexpr size_t kTokenBytes = 32;

// A subscription token: kTokenBytes from the kernel's CSPRNG, hex-encoded.
absl::StatusOr<std::string> NewToken() {
  std::string bytes(kTokenBytes, '\0');
  size_t filled = 0;
  while (filled < bytes.size()) {
    const ssize_t n = getrandom(bytes.data() + filled, bytes.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("cannot draw a subscription token: getrandom: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(bytes);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// PullTransport

absl::StatusOr<std::unique_ptr<PullTransport>> PullTransport::Create(
    const PullTransportOptions& options) {
  if (options.max_queued_events < 4) {
    return absl::InvalidArgumentError("pull.max_queued_events must be at least 4");
  }
  return std::unique_ptr<PullTransport>(
      new PullTransport(std::make_shared<Subscription::Hub>(options)));
}

PullTransport::PullTransport(std::shared_ptr<Subscription::Hub> hub) : hub_(std::move(hub)) {}

PullTransport::~PullTransport() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Subscription>> PullTransport::Subscribe(absl::string_view name,
                                                                       uint64_t held_version,
                                                                       absl::string_view instance,
                                                                       uint64_t staged_version,
                                                                       bool accepts_patches) {
  if (absl::Status s = ValidateReceiverName(name); !s.ok()) return s;
  if (!instance.empty()) {
    if (absl::Status s = ValidateReceiverName(instance, "instance"); !s.ok()) return s;
    if (instance.size() > kMaxReceiverInstanceBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "instance of receiver '", name, "': more than ", kMaxReceiverInstanceBytes, " bytes"));
    }
  }
  if (staged_version > hub_->options.max_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        "receiver '", name, "' claims to hold version ", staged_version,
        " staged, beyond any version a publication may have (", hub_->options.max_version, ")"));
  }
  if (held_version > hub_->options.max_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        "receiver '", name, "' claims to hold version ", held_version,
        ", beyond any version a publication may have (", hub_->options.max_version, ")"));
  }
  absl::StatusOr<std::string> token = NewToken();
  if (!token.ok()) return token.status();
  std::function<void(const std::string&, uint64_t)> behind;
  absl::StatusOr<std::unique_ptr<Subscription>> sub = SubscribeLocked(
      name, held_version, instance, staged_version, accepts_patches, *std::move(token), &behind);
  if (sub.ok() && behind) behind(std::string(name), held_version);
  return sub;
}

absl::StatusOr<std::unique_ptr<Subscription>> PullTransport::SubscribeLocked(
    absl::string_view name, uint64_t held_version, absl::string_view instance,
    uint64_t staged_version, bool accepts_patches, std::string token,
    std::function<void(const std::string&, uint64_t)>* behind) {
  HubLock lock(*hub_);
  if (hub_->shutdown) return absl::UnavailableError("the pull transport is shut down");
  for (const auto& [id, r] : hub_->receivers) {
    if (r->name == name) {
      return absl::AlreadyExistsError(
          absl::StrCat("a receiver named '", name, "' is already connected"));
    }
  }
  const uint64_t id = hub_->next_id++;
  auto r = std::make_shared<Subscription::Hub::Receiver>();
  r->name = std::string(name);
  r->connected_at = absl::Now();
  r->held_version = held_version;
  r->instance = std::string(instance);
  r->accepts_patches = accepts_patches;
  GroupInfoEvent info;
  info.receiver_name = r->name;
  info.transport = "pull";
  info.committed_version = hub_->committed_version;
  info.subscription_token = token;
  std::tie(info.staged, info.staged_reason) = hub_->StagedLocked(staged_version);
  r->events.push_back(std::move(info));
  hub_->receivers.emplace(id, std::move(r));
  if (held_version < hub_->committed_version) *behind = hub_->on_behind;
  return std::unique_ptr<Subscription>(
      new Subscription(hub_, std::string(name), id, std::move(token)));
}

std::optional<HeldVersion> PullTransport::HighestHeldVersion() const {
  HubLock lock(*hub_);
  return hub_->HighestHeldLocked();
}

absl::Status PullTransport::CheckVersionAhead(uint64_t version) const {
  HubLock lock(*hub_);
  return hub_->CheckVersionAheadLocked(version);
}

TransportCapabilities PullTransport::capabilities() const {
  TransportCapabilities c;
  c.name = "pull";
  c.accepts = kHostOnly;
  c.receiver_paced = true;
  c.acknowledges_checksums = true;
  return c;
}

void PullTransport::SetPatchSource(PatchSource source) {
  HubLock lock(*hub_);
  hub_->patches = std::move(source);
}

absl::StatusOr<std::vector<std::string>> PullTransport::Begin(const PublicationManifest& manifest) {
  // The version patches would be made against, asked outside the lock (the engine's copy).
  std::function<uint64_t()> base_of;
  {
    HubLock lock(*hub_);
    base_of = hub_->patches.base_version;
  }
  const uint64_t base = base_of ? base_of() : 0;
  HubLock lock(*hub_);
  if (hub_->shutdown) return absl::UnavailableError("the pull transport is shut down");
  if (hub_->in_flight) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pull transport: publication ", hub_->manifest.version, " is still in flight"));
  }
  // A replay of the committed version goes to the receivers behind it alone; anything else
  // must take every receiver forwards.
  if (!manifest.replay) {
    if (absl::Status s = hub_->CheckVersionAheadLocked(manifest.version); !s.ok()) return s;
  }
  hub_->in_flight = true;
  hub_->failed = false;
  hub_->manifest = manifest;
  hub_->staged.clear();
  hub_->participants.clear();
  // Patches: for a version after the one the copy holds (not a replay, nor a group version,
  // whose receivers assemble parts of several daemons), unless this is the full_every-th.
  // The count of committed publications in a row that offered patches moves at Commit: an
  // aborted attempt, its retry (which decides as it did) and a replay (it reaches only
  // receivers behind) leave it as it is.
  const uint32_t every = hub_->patches.full_every;
  const bool offer = base != 0 && hub_->patches.make && !manifest.replay &&
                     manifest.group.empty() && manifest.version > base &&
                     (every == 0 || hub_->offered_in_a_row + 1 < every);
  hub_->offered_now = offer;
  hub_->all_patched = false;
  hub_->patch_slots.clear();
  bool any_patched = false;  // a participant was offered patches
  std::vector<std::string> names;
  for (auto& [id, r] : hub_->receivers) {
    if (manifest.replay && r->held_version >= manifest.version) continue;
    Subscription::Hub::Participant p;
    p.id = id;
    p.name = r->name;
    p.instance = r->instance;
    p.acked.assign(manifest.buckets.size(), false);
    if (offer && r->accepts_patches && r->held_version == base) {
      p.patch_base = base;
      any_patched = true;
    }
    hub_->participants.push_back(std::move(p));
    r->state = ReceiverState::kReceiving;
    names.push_back(r->name);
  }
  hub_->all_patched = any_patched;
  for (const Subscription::Hub::Participant& p : hub_->participants) {
    if (p.patch_base == 0) hub_->all_patched = false;
  }
  if (any_patched) {
    for (size_t i = 0; i < manifest.buckets.size(); ++i) {
      hub_->patch_slots.push_back(std::make_shared<Subscription::Hub::PatchSlot>());
    }
  }
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    hub_->Push(p.id, ManifestEvent{manifest, hub_->committed_version, p.patch_base});
  }
  return names;
}

absl::Status PullTransport::Send(std::shared_ptr<const Bucket> bucket) {
  HubLock lock(*hub_);
  if (!hub_->in_flight || bucket->version != hub_->manifest.version) {
    return absl::CancelledError(
        absl::StrCat("pull transport: version ", bucket->version, " is not in flight"));
  }
  const uint32_t index = bucket->manifest.index;
  if (index != hub_->staged.size() || index >= hub_->manifest.buckets.size()) {
    return absl::InternalError(absl::StrCat("pull transport: bucket ", index,
                                            " sent out of order (expected ", hub_->staged.size(),
                                            ")"));
  }
  if (bucket->bytes_deferred) {
    if (!hub_->all_patched || !hub_->patches.whole || !bucket->bytes.empty() ||
        index >= hub_->patch_slots.size()) {
      return absl::InternalError(absl::StrCat(
          "pull transport: bucket ", index,
          " came without its bytes, but a participant takes it whole or nothing can read it"));
    }
  } else if (bucket->bytes.size() != bucket->manifest.nbytes) {
    return absl::InternalError(absl::StrCat("pull transport: bucket ", index, " holds ",
                                            bucket->bytes.size(), " bytes, manifest says ",
                                            bucket->manifest.nbytes));
  }
  hub_->staged.push_back(bucket);
  BucketReadyEvent ready;
  ready.version = bucket->version;
  ready.attempt = hub_->manifest.attempt;
  ready.index = index;
  ready.nbytes = bucket->manifest.nbytes;
  ready.checksum = bucket->manifest.checksum;
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    if (p.failure == ReceiverFailure::kNone) hub_->Push(p.id, ready);
  }
  return absl::OkStatus();
}

bool PullTransport::DefersBytes(const Bucket& bucket) {
  std::function<bool(uint64_t)> can;
  {
    HubLock lock(*hub_);
    if (!hub_->in_flight || bucket.version != hub_->manifest.version || !hub_->all_patched ||
        !hub_->patches.whole || bucket.manifest.index >= hub_->patch_slots.size()) {
      return false;
    }
    can = hub_->patches.can_defer;
  }
  return can && can(bucket.version);
}

absl::Status PullTransport::WaitAcknowledged(absl::Time deadline) {
  HubLock lock(*hub_);
  if (!hub_->in_flight) return absl::CancelledError("pull transport: nothing in flight");
  const uint64_t version = hub_->manifest.version;
  const size_t num_buckets = hub_->manifest.buckets.size();
  auto all_acked = [&] {
    if (hub_->staged.size() != num_buckets) return false;
    for (const auto& p : hub_->participants) {
      if (p.num_acked != num_buckets) return false;
    }
    return true;
  };
  hub_->ack_cv.wait_until(lock.lock(), pull_internal::SteadyDeadline(deadline), [&] {
    return !hub_->in_flight || hub_->manifest.version != version || hub_->failed || all_acked();
  });
  if (!hub_->in_flight || hub_->manifest.version != version) {
    return absl::CancelledError(absl::StrCat("publication ", version, " was aborted"));
  }
  if (hub_->failed) {
    std::vector<std::string> why;
    for (const auto& p : hub_->participants) {
      if (p.failure != ReceiverFailure::kNone) why.push_back(p.error);
    }
    return absl::AbortedError(absl::StrJoin(why, "; "));
  }
  if (all_acked()) return absl::OkStatus();
  std::vector<std::string> late;
  for (auto& p : hub_->participants) {
    if (p.num_acked != num_buckets) {
      late.push_back(absl::StrCat(p.name, " (", p.num_acked, "/", num_buckets, " buckets)"));
      hub_->FailParticipant(p, ReceiverFailure::kTimeout,
                            absl::StrCat("receiver ", p.name, " acknowledged ", p.num_acked, " of ",
                                         num_buckets, " buckets before the deadline"));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "publication ", version, ": acknowledgements missing from ", absl::StrJoin(late, ", ")));
}

absl::Status PullTransport::Commit() {
  HubLock lock(*hub_);
  if (!hub_->in_flight) return absl::FailedPreconditionError("pull transport: nothing in flight");
  if (hub_->failed) {
    return absl::FailedPreconditionError("pull transport: a receiver failed; cannot commit");
  }
  const uint64_t version = hub_->manifest.version;
  for (const auto& p : hub_->participants) {
    if (p.num_acked != hub_->manifest.buckets.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("pull transport: receiver ", p.name, " has not acknowledged everything"));
    }
  }
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    hub_->Push(p.id, CommitEvent{version});
  }
  hub_->committed_version = version;
  hub_->Told(version, true);
  if (!hub_->manifest.replay) {
    hub_->offered_in_a_row = hub_->offered_now ? hub_->offered_in_a_row + 1 : 0;
  }
  hub_->EndLocked(/*committed=*/true);
  return absl::OkStatus();
}

absl::Status PullTransport::CommitDecided() {
  HubLock lock(*hub_);
  if (!hub_->in_flight) return absl::FailedPreconditionError("pull transport: nothing in flight");
  const uint64_t version = hub_->manifest.version;
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    if (p.failure == ReceiverFailure::kNone) hub_->Push(p.id, CommitEvent{version});
  }
  hub_->committed_version = version;
  hub_->Told(version, true);
  hub_->offered_in_a_row = 0;  // a group version: every receiver took it whole
  hub_->EndLocked(/*committed=*/true);
  // The ones that left (or fell behind) after acknowledging everything were not told.
  for (ReceiverOutcome& o : hub_->last_outcomes) {
    if (o.failure == ReceiverFailure::kNone) continue;
    o.committed = false;
    o.state =
        o.failure == ReceiverFailure::kDisconnected ? ReceiverState::kLeft : ReceiverState::kFailed;
    absl::StrAppend(&o.error, "; version ", version,
                    " committed after it acknowledged every bucket, and it was not told to apply "
                    "it");
  }
  return absl::OkStatus();
}

void PullTransport::Abort(absl::string_view reason) {
  HubLock lock(*hub_);
  if (!hub_->in_flight) return;
  const uint64_t version = hub_->manifest.version;
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    hub_->Push(p.id, AbortEvent{version, hub_->manifest.attempt, std::string(reason)});
  }
  // A replay's version committed: what receivers were told of it stays "commit".
  if (!hub_->manifest.replay) {
    hub_->last_aborted_version = version;
    hub_->Told(version, false);
  }
  hub_->EndLocked(/*committed=*/false);
}

std::vector<ReceiverOutcome> PullTransport::Outcomes() const {
  HubLock lock(*hub_);
  return hub_->OutcomesLocked();
}

std::vector<ReceiverInfo> PullTransport::Receivers() const {
  HubLock lock(*hub_);
  std::vector<ReceiverInfo> out;
  for (const auto& [id, r] : hub_->receivers) {
    out.push_back(ReceiverInfo{r->name, r->state, r->last_committed_version, r->connected_at,
                               r->held_version});
  }
  return out;
}

void PullTransport::SetBehindListener(BehindListener listener) {
  HubLock lock(*hub_);
  hub_->on_behind = std::move(listener);
}

uint64_t PullTransport::committed_version() const {
  HubLock lock(*hub_);
  return hub_->committed_version;
}

void PullTransport::set_committed_version(uint64_t version) {
  HubLock lock(*hub_);
  hub_->committed_version = version;
}

void PullTransport::Shutdown(bool abort_in_flight) {
  HubLock lock(*hub_);
  if (hub_->in_flight) {
    const uint64_t version = hub_->manifest.version;
    for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
      if (!abort_in_flight) break;
      hub_->Push(p.id, AbortEvent{version, hub_->manifest.attempt, "transport shut down"});
    }
    if (!hub_->manifest.replay) {
      hub_->last_aborted_version = version;
      if (abort_in_flight) hub_->Told(version, false);
    }
    hub_->EndLocked(false);
  }
  hub_->shutdown = true;
  for (auto& [id, r] : hub_->receivers) hub_->Wake(id, *r);
}

}  // namespace wpub::transport
