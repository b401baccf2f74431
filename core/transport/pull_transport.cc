// The gRPC-pull transport's core half: subscriptions with event queues, buckets staged in host
// memory, acknowledgement bookkeeping. One mutex guards everything; waits use condition
// variables (one per receiver for Next, one for the engine's WaitAcknowledged).
#include "core/transport/pull_transport.h"

#include <errno.h>
#include <sys/random.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"

namespace wpub::transport {

namespace {
// Versions whose outcome a transport remembers for receivers that held them staged.
constexpr size_t kVersionsRemembered = 64;
}  // namespace
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

// Compares in time independent of where the strings differ, so a token cannot be guessed
// byte by byte from response times.
bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::chrono::steady_clock::time_point SteadyDeadline(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return std::chrono::steady_clock::now();
  if (left > absl::Hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(left);
}

}  // namespace

absl::Status ValidateReceiverName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (name.size() > kMaxReceiverNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", name.size(), " bytes, longer than ",
                                                   kMaxReceiverNameBytes, " ('",
                                                   absl::CHexEscape(name.substr(0, 32)), "...')"));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(name[i]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", absl::CHexEscape(name), "': byte ", i,
          " is not printable ASCII (only '!' to '~' are allowed; no spaces or control bytes)"));
    }
  }
  return absl::OkStatus();
}

struct Subscription::Hub {
  struct Receiver {
    std::string name;
    std::string instance;
    std::deque<ReceiverEvent> events;
    std::condition_variable cv;
    ReceiverState state = ReceiverState::kIdle;
    uint64_t last_committed_version = 0;
    uint64_t held_version = 0;  // as subscribed; raised by every commit
    absl::Time connected_at;
    bool closed = false;
    bool cancelled = false;
    bool dropped = false;
    // Subscription::Attach: the sink events go to, and whether it holds an item.
    SubscriptionSink* sink = nullptr;
    bool sink_busy = false;
  };
  struct Participant {
    uint64_t id = 0;
    std::string name;
    std::string instance;
    std::vector<bool> acked;
    size_t num_acked = 0;
    ReceiverFailure failure = ReceiverFailure::kNone;
    std::string error;
    bool committed = false;
  };

  explicit Hub(const PullTransportOptions& o) : options(o) {}

  const PullTransportOptions options;
  mutable std::mutex mu;
  std::condition_variable ack_cv;  // WaitAcknowledged
  std::map<uint64_t, std::shared_ptr<Receiver>> receivers;
  std::set<uint64_t> dropped_ids;
  uint64_t next_id = 1;
  uint64_t committed_version = 0;
  bool shutdown = false;

  bool in_flight = false;
  bool failed = false;  // a participant failed the publication in flight
  PublicationManifest manifest;
  std::vector<std::shared_ptr<const Bucket>> staged;
  std::vector<Participant> participants;
  uint64_t last_aborted_version = 0;
  // What receivers were last told of each recent version (true: commit), newest kept.
  std::map<uint64_t, bool> told;
  void Told(uint64_t version, bool committed) {
    told[version] = committed;
    while (told.size() > kVersionsRemembered) told.erase(told.begin());
  }
  // What this transport knows of `version`, held staged by a receiver that subscribes.
  std::pair<StagedDecision, std::string> StagedLocked(uint64_t version) const {
    if (version == 0) return {StagedDecision::kUnknown, ""};
    if (in_flight && manifest.version == version) {
      return {StagedDecision::kUnknown,
              absl::StrCat("version ", version, " is still being published here")};
    }
    if (auto it = told.find(version); it != told.end()) {
      return {it->second ? StagedDecision::kApply : StagedDecision::kDiscard,
              absl::StrCat("version ", version, it->second ? " committed" : " aborted", " here")};
    }
    if (version < committed_version) {
      return {StagedDecision::kDiscard, absl::StrCat("version ", committed_version,
                                                     " committed here since version ", version)};
    }
    return {StagedDecision::kUnknown, absl::StrCat("no record of version ", version, " here")};
  }
  std::vector<ReceiverOutcome> last_outcomes;

  // FAILED_PRECONDITION when `attempt` (0 is read as 1) is not the attempt of `version` in
  // flight: a receiver still working through an attempt that was aborted and begun again.
  absl::Status CheckAttempt(absl::string_view receiver, uint64_t version, uint32_t attempt) const {
    const uint32_t a = attempt == 0 ? 1 : attempt;
    if (in_flight && manifest.version == version && manifest.attempt != a) {
      return absl::FailedPreconditionError(
          absl::StrCat("receiver ", receiver, ": attempt ", a, " of version ", version,
                       " was aborted; attempt ", manifest.attempt, " is in flight"));
    }
    return absl::OkStatus();
  }

  Participant* FindParticipant(uint64_t id) {
    for (auto& p : participants) {
      if (p.id == id) return &p;
    }
    return nullptr;
  }

  std::vector<ReceiverOutcome> OutcomesLocked() const {
    if (!in_flight) return last_outcomes;
    std::vector<ReceiverOutcome> out;
    for (const auto& p : participants) {
      ReceiverOutcome o{p.name,      p.instance, ReceiverState::kReceiving,
                        p.committed, p.failure,  p.error};
      if (p.failure != ReceiverFailure::kNone) {
        o.state = p.failure == ReceiverFailure::kDisconnected ? ReceiverState::kLeft
                                                              : ReceiverState::kFailed;
      } else if (p.num_acked == manifest.buckets.size()) {
        o.state = ReceiverState::kStaged;
      }
      out.push_back(std::move(o));
    }
    return out;
  }

  void FailParticipant(Participant& p, ReceiverFailure failure, std::string error) {
    if (p.failure != ReceiverFailure::kNone) return;
    p.failure = failure;
    p.error = std::move(error);
    failed = true;
    if (auto it = receivers.find(p.id); it != receivers.end()) {
      it->second->state = ReceiverState::kFailed;
    }
    ack_cv.notify_all();
  }

  // Queues `event` for receiver `id`; drops a receiver whose queue overflows.
  void Push(uint64_t id, ReceiverEvent event) {
    auto it = receivers.find(id);
    if (it == receivers.end()) return;
    Receiver& r = *it->second;
    if (r.events.size() >= options.max_queued_events) {
      r.dropped = true;
      Wake(r);
      dropped_ids.insert(id);
      receivers.erase(it);
      if (in_flight) {
        if (Participant* p = FindParticipant(id)) {
          FailParticipant(*p, ReceiverFailure::kProtocol,
                          absl::StrCat("receiver ", p->name, " fell behind (",
                                       options.max_queued_events, " undelivered events)"));
        }
      }
      return;
    }
    r.events.push_back(std::move(event));
    Wake(r);
  }

  // What Next returns now for `r` (nullopt: nothing yet). Events queued before a shutdown are
  // still delivered (the commit or abort of the last publication must reach every receiver);
  // only an empty queue reports the shutdown.
  std::optional<absl::StatusOr<ReceiverEvent>> NextLocked(Receiver& r) {
    if (r.dropped) {
      return absl::ResourceExhaustedError(
          absl::StrCat("receiver ", r.name, " was dropped for falling behind"));
    }
    if (r.closed || r.cancelled) {
      return absl::CancelledError(absl::StrCat("subscription of receiver ", r.name, " is closed"));
    }
    if (!r.events.empty()) {
      ReceiverEvent event = std::move(r.events.front());
      r.events.pop_front();
      return event;
    }
    if (shutdown) {
      return absl::CancelledError(absl::StrCat("subscription of receiver ", r.name, " is closed"));
    }
    return std::nullopt;
  }

  // Something changed for `r`: wakes Next, or hands an idle sink what waits.
  void Wake(Receiver& r) {
    r.cv.notify_all();
    if (r.sink == nullptr || r.sink_busy) return;
    std::optional<absl::StatusOr<ReceiverEvent>> item = NextLocked(r);
    if (!item.has_value()) return;
    r.sink_busy = true;
    r.sink->Deliver(*std::move(item));
  }

  // Ends the publication in flight, recording outcomes and releasing the staged buckets.
  void EndLocked(bool committed) {
    for (auto& p : participants) {
      p.committed = committed;
      if (auto it = receivers.find(p.id); it != receivers.end()) {
        Receiver& r = *it->second;
        if (committed) {
          r.last_committed_version = manifest.version;
          r.held_version = std::max(r.held_version, manifest.version);
        }
        if (p.failure == ReceiverFailure::kNone) r.state = ReceiverState::kIdle;
      }
    }
    last_outcomes = OutcomesLocked();
    if (committed) {
      for (auto& o : last_outcomes) o.state = ReceiverState::kStaged;
    }
    in_flight = false;
    staged.clear();
    ack_cv.notify_all();
  }

  std::optional<HeldVersion> HighestHeldLocked() const {
    std::optional<HeldVersion> best;
    for (const auto& [id, r] : receivers) {
      if (r->held_version != 0 && (!best || r->held_version > best->version)) {
        best = HeldVersion{r->name, r->held_version};
      }
    }
    return best;
  }

  absl::Status CheckVersionAheadLocked(uint64_t version) const {
    std::optional<HeldVersion> held = HighestHeldLocked();
    if (held && version <= held->version) {
      return absl::FailedPreconditionError(
          absl::StrCat("version: ", version, " is not greater than version ", held->version,
                       " held by receiver '", held->receiver, "'"));
    }
    return absl::OkStatus();
  }

  void Leave(uint64_t id, bool closed) {
    auto it = receivers.find(id);
    if (it == receivers.end()) return;
    it->second->closed = closed;
    Wake(*it->second);
    const std::string name = it->second->name;
    receivers.erase(it);
    if (in_flight) {
      if (Participant* p = FindParticipant(id)) {
        FailParticipant(
            *p, ReceiverFailure::kDisconnected,
            absl::StrCat("receiver ", name, " disconnected during publication ", manifest.version));
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Subscription

Subscription::Subscription(std::shared_ptr<Hub> hub, std::string name, uint64_t id,
                           std::string token)
    : hub_(std::move(hub)), name_(std::move(name)), id_(id), token_(std::move(token)) {}

Subscription::~Subscription() { Close(); }

absl::Status Subscription::CheckToken(absl::string_view token) const {
  if (TokensEqual(token, token_)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "receiver '", name_,
      "': ", token.empty() ? "no subscription token given" : "wrong subscription token",
      " (use the token of the receiver's own subscription, sent in its group_info)"));
}

// The end of a subscription whose receiver is no longer registered (closed or dropped).
absl::Status Subscription::EndedStatus() const {
  if (hub_->dropped_ids.count(id_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("receiver ", name_, " was dropped for falling behind"));
  }
  return absl::CancelledError(absl::StrCat("subscription of receiver ", name_, " is closed"));
}

absl::StatusOr<ReceiverEvent> Subscription::Next(absl::Duration timeout) {
  std::unique_lock lock(hub_->mu);
  auto it = hub_->receivers.find(id_);
  if (it == hub_->receivers.end()) return EndedStatus();
  std::shared_ptr<Hub::Receiver> r = it->second;
  std::optional<absl::StatusOr<ReceiverEvent>> item;
  r->cv.wait_until(lock, SteadyDeadline(absl::Now() + timeout),
                   [&] { return (item = hub_->NextLocked(*r)).has_value(); });
  if (!item.has_value()) {
    return absl::DeadlineExceededError(absl::StrCat("no event for receiver ", name_));
  }
  return *std::move(item);
}

void Subscription::Attach(SubscriptionSink* sink) {
  std::lock_guard lock(hub_->mu);
  auto it = hub_->receivers.find(id_);
  if (it == hub_->receivers.end()) {
    sink->Deliver(EndedStatus());
    return;
  }
  it->second->sink = sink;
  it->second->sink_busy = false;
  hub_->Wake(*it->second);
}

std::optional<absl::StatusOr<ReceiverEvent>> Subscription::Take() {
  std::lock_guard lock(hub_->mu);
  auto it = hub_->receivers.find(id_);
  // Gone (closed, dropped): it was busy when that happened, so the end is told here.
  if (it == hub_->receivers.end()) return EndedStatus();
  std::optional<absl::StatusOr<ReceiverEvent>> item = hub_->NextLocked(*it->second);
  if (!item.has_value()) it->second->sink_busy = false;
  return item;
}

void Subscription::Detach() {
  std::lock_guard lock(hub_->mu);
  if (auto it = hub_->receivers.find(id_); it != hub_->receivers.end()) {
    it->second->sink = nullptr;
  }
}

absl::StatusOr<std::shared_ptr<const Bucket>> Subscription::ReadBucket(absl::string_view token,
                                                                       uint64_t version,
                                                                       uint32_t index,
                                                                       uint32_t attempt) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  std::lock_guard lock(hub_->mu);
  WPUB_RETURN_IF_ERROR(hub_->CheckAttempt(name_, version, attempt));
  if (hub_->in_flight && hub_->manifest.version == version) {
    if (index < hub_->staged.size()) return hub_->staged[index];
    return absl::NotFoundError(
        absl::StrCat("bucket ", index, " of version ", version, " is not staged"));
  }
  if (version != 0 && version == hub_->last_aborted_version) {
    return absl::AbortedError(absl::StrCat("version ", version, " was aborted"));
  }
  return absl::NotFoundError(absl::StrCat("version ", version, " is not in flight"));
}

absl::Status Subscription::Ack(absl::string_view token, uint64_t version, uint32_t index,
                               uint64_t checksum, uint32_t attempt) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  std::lock_guard lock(hub_->mu);
  // Before anything else: a late acknowledgement of an aborted attempt of this version must
  // never count for the retry (the receiver discarded those bytes when it saw the abort).
  WPUB_RETURN_IF_ERROR(hub_->CheckAttempt(name_, version, attempt));
  if (!hub_->in_flight || hub_->manifest.version != version) {
    return absl::InvalidArgumentError(absl::StrCat("receiver ", name_, " acknowledged version ",
                                                   version, ", which is not in flight"));
  }
  Hub::Participant* p = hub_->FindParticipant(id_);
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("receiver ", name_, " does not take part in publication ", version));
  }
  if (index >= hub_->staged.size()) {
    return absl::InvalidArgumentError(absl::StrCat("receiver ", name_, " acknowledged bucket ",
                                                   index, " of version ", version,
                                                   ", which was not sent"));
  }
  if (p->failure != ReceiverFailure::kNone) return absl::OkStatus();
  const uint64_t expected = hub_->staged[index]->manifest.checksum;
  if (checksum != expected) {
    hub_->FailParticipant(
        *p, ReceiverFailure::kChecksum,
        absl::StrCat("receiver ", name_, " acknowledged bucket ", index, " of version ", version,
                     " with checksum ", checksum, ", expected ", expected));
    return absl::OkStatus();
  }
  if (!p->acked[index]) {
    p->acked[index] = true;
    ++p->num_acked;
    if (p->num_acked == hub_->manifest.buckets.size()) {
      if (auto it = hub_->receivers.find(id_); it != hub_->receivers.end()) {
        it->second->state = ReceiverState::kStaged;
      }
      hub_->ack_cv.notify_all();
    }
  }
  return absl::OkStatus();
}

void Subscription::Close() {
  std::lock_guard lock(hub_->mu);
  hub_->Leave(id_, /*closed=*/true);
}

void Subscription::Cancel() {
  std::lock_guard lock(hub_->mu);
  if (auto it = hub_->receivers.find(id_); it != hub_->receivers.end()) {
    it->second->cancelled = true;
    hub_->Wake(*it->second);
  }
}

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
                                                                       uint64_t staged_version) {
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
  std::lock_guard lock(hub_->mu);
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
  GroupInfoEvent info{r->name, "pull", hub_->committed_version, *token};
  std::tie(info.staged, info.staged_reason) = hub_->StagedLocked(staged_version);
  r->events.push_back(std::move(info));
  hub_->receivers.emplace(id, std::move(r));
  return std::unique_ptr<Subscription>(
      new Subscription(hub_, std::string(name), id, *std::move(token)));
}

std::optional<HeldVersion> PullTransport::HighestHeldVersion() const {
  std::lock_guard lock(hub_->mu);
  return hub_->HighestHeldLocked();
}

absl::Status PullTransport::CheckVersionAhead(uint64_t version) const {
  std::lock_guard lock(hub_->mu);
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

absl::StatusOr<std::vector<std::string>> PullTransport::Begin(const PublicationManifest& manifest) {
  std::lock_guard lock(hub_->mu);
  if (hub_->shutdown) return absl::UnavailableError("the pull transport is shut down");
  if (hub_->in_flight) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pull transport: publication ", hub_->manifest.version, " is still in flight"));
  }
  if (absl::Status s = hub_->CheckVersionAheadLocked(manifest.version); !s.ok()) return s;
  hub_->in_flight = true;
  hub_->failed = false;
  hub_->manifest = manifest;
  hub_->staged.clear();
  hub_->participants.clear();
  std::vector<std::string> names;
  for (auto& [id, r] : hub_->receivers) {
    Subscription::Hub::Participant p;
    p.id = id;
    p.name = r->name;
    p.instance = r->instance;
    p.acked.assign(manifest.buckets.size(), false);
    hub_->participants.push_back(std::move(p));
    r->state = ReceiverState::kReceiving;
    names.push_back(r->name);
  }
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    hub_->Push(p.id, ManifestEvent{manifest, hub_->committed_version});
  }
  return names;
}

absl::Status PullTransport::Send(std::shared_ptr<const Bucket> bucket) {
  std::lock_guard lock(hub_->mu);
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
  if (bucket->bytes.size() != bucket->manifest.nbytes) {
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

absl::Status PullTransport::WaitAcknowledged(absl::Time deadline) {
  std::unique_lock lock(hub_->mu);
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
  hub_->ack_cv.wait_until(lock, SteadyDeadline(deadline), [&] {
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
  std::lock_guard lock(hub_->mu);
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
  hub_->EndLocked(/*committed=*/true);
  return absl::OkStatus();
}

absl::Status PullTransport::CommitDecided() {
  std::lock_guard lock(hub_->mu);
  if (!hub_->in_flight) return absl::FailedPreconditionError("pull transport: nothing in flight");
  const uint64_t version = hub_->manifest.version;
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    if (p.failure == ReceiverFailure::kNone) hub_->Push(p.id, CommitEvent{version});
  }
  hub_->committed_version = version;
  hub_->Told(version, true);
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
  std::lock_guard lock(hub_->mu);
  if (!hub_->in_flight) return;
  const uint64_t version = hub_->manifest.version;
  for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
    hub_->Push(p.id, AbortEvent{version, hub_->manifest.attempt, std::string(reason)});
  }
  hub_->last_aborted_version = version;
  hub_->Told(version, false);
  hub_->EndLocked(/*committed=*/false);
}

std::vector<ReceiverOutcome> PullTransport::Outcomes() const {
  std::lock_guard lock(hub_->mu);
  return hub_->OutcomesLocked();
}

std::vector<ReceiverInfo> PullTransport::Receivers() const {
  std::lock_guard lock(hub_->mu);
  std::vector<ReceiverInfo> out;
  for (const auto& [id, r] : hub_->receivers) {
    out.push_back(ReceiverInfo{r->name, r->state, r->last_committed_version, r->connected_at});
  }
  return out;
}

uint64_t PullTransport::committed_version() const {
  std::lock_guard lock(hub_->mu);
  return hub_->committed_version;
}

void PullTransport::set_committed_version(uint64_t version) {
  std::lock_guard lock(hub_->mu);
  hub_->committed_version = version;
}

void PullTransport::Shutdown(bool abort_in_flight) {
  std::lock_guard lock(hub_->mu);
  if (hub_->in_flight) {
    const uint64_t version = hub_->manifest.version;
    for (const auto& p : std::vector<Subscription::Hub::Participant>(hub_->participants)) {
      if (!abort_in_flight) break;
      hub_->Push(p.id, AbortEvent{version, hub_->manifest.attempt, "transport shut down"});
    }
    hub_->last_aborted_version = version;
    if (abort_in_flight) hub_->Told(version, false);
    hub_->EndLocked(false);
  }
  hub_->shutdown = true;
  for (auto& [id, r] : hub_->receivers) hub_->Wake(*r);
}

}  // namespace wpub::transport
