// The receiver's half of the pull transport: a subscription's events (read with Next or pushed
// to a sink), its reads of staged buckets and its acknowledgements, over the state it shares
// with the transport (pull_hub.h).
#include "absl/strings/escaping.h"
#include "core/common/secure_compare.h"
#include "core/transport/pull_hub.h"

namespace wpub::transport {

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

// ---------------------------------------------------------------------------------------------
// Subscription

Subscription::Subscription(std::shared_ptr<Hub> hub, std::string name, uint64_t id,
                           std::string token)
    : hub_(std::move(hub)), name_(std::move(name)), id_(id), token_(std::move(token)) {}

Subscription::~Subscription() {
  Detach();
  Close();
}

absl::Status Subscription::CheckToken(absl::string_view token) const {
  if (SecureEquals(std::string_view(token.data(), token.size()), token_)) return absl::OkStatus();
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
  HubLock lock(*hub_);
  auto it = hub_->receivers.find(id_);
  if (it == hub_->receivers.end()) return EndedStatus();
  std::shared_ptr<Hub::Receiver> r = it->second;
  std::optional<absl::StatusOr<ReceiverEvent>> item;
  r->cv.wait_until(lock.lock(), pull_internal::SteadyDeadline(absl::Now() + timeout),
                   [&] { return (item = hub_->NextLocked(*r)).has_value(); });
  if (!item.has_value()) {
    return absl::DeadlineExceededError(absl::StrCat("no event for receiver ", name_));
  }
  return *std::move(item);
}

void Subscription::Attach(SubscriptionSink* sink) {
  HubLock lock(*hub_);
  auto it = hub_->receivers.find(id_);
  if (it == hub_->receivers.end()) {
    // Gone already: the end, handed over once the lock is released like any item.
    hub_->Hand(id_, sink, EndedStatus());
    return;
  }
  it->second->sink = sink;
  it->second->sink_busy = false;
  hub_->Wake(id_, *it->second);
}

std::optional<absl::StatusOr<ReceiverEvent>> Subscription::Take() {
  HubLock lock(*hub_);
  auto it = hub_->receivers.find(id_);
  // Gone (closed, dropped): it was busy when that happened, so the end is told here.
  if (it == hub_->receivers.end()) return EndedStatus();
  std::optional<absl::StatusOr<ReceiverEvent>> item = hub_->NextLocked(*it->second);
  if (!item.has_value()) it->second->sink_busy = false;
  return item;
}

void Subscription::Detach() {
  HubLock lock(*hub_);
  if (auto it = hub_->receivers.find(id_); it != hub_->receivers.end()) {
    it->second->sink = nullptr;
  }
  // A delivery taken before (handed over by another thread now) ends before this returns.
  hub_->delivered_cv.wait(lock.lock(), [&] { return !hub_->delivering.contains(id_); });
}

absl::StatusOr<std::shared_ptr<const Bucket>> Subscription::ReadBucket(
    absl::string_view token, uint64_t version, uint32_t index, uint32_t attempt, bool patch) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  std::shared_ptr<const Bucket> bucket;
  std::shared_ptr<Hub::PatchSlot> slot;
  uint64_t base = 0;
  std::function<std::shared_ptr<const Bucket>(uint64_t, const Bucket&)> make;
  std::function<absl::StatusOr<std::shared_ptr<const Bucket>>(const Bucket&)> whole;
  {
    HubLock lock(*hub_);
    WPUB_RETURN_IF_ERROR(hub_->CheckAttempt(name_, version, attempt));
    if (!hub_->in_flight || hub_->manifest.version != version) {
      if (version != 0 && version == hub_->last_aborted_version) {
        return absl::AbortedError(absl::StrCat("version ", version, " was aborted"));
      }
      return absl::NotFoundError(absl::StrCat("version ", version, " is not in flight"));
    }
    if (index >= hub_->staged.size()) {
      return absl::NotFoundError(
          absl::StrCat("bucket ", index, " of version ", version, " is not staged"));
    }
    bucket = hub_->staged[index];
    if (index < hub_->patch_slots.size()) slot = hub_->patch_slots[index];
    const Hub::Participant* p = hub_->FindParticipant(id_);
    if (bucket->bytes_deferred) {
      // Read from where the engine keeps the version: for this publication's receivers only.
      if (p == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("receiver ", name_, " does not take part in publication ", version));
      }
      whole = hub_->patches.whole;  // Send checked it and the slot are there
    }
    if (patch && p != nullptr && p->patch_base != 0 && slot != nullptr) {
      base = p->patch_base;
      make = hub_->patches.make;
    }
  }
  if (make) {
    // The first reader makes the patch; the others wait for it (the lock is the slot's alone).
    std::lock_guard made(slot->mu);
    if (!slot->made) {
      slot->patch = make(base, *bucket);
      slot->made = true;
    }
    if (slot->patch != nullptr) return slot->patch;
  }
  if (!bucket->bytes_deferred) return bucket;
  // Taken without its bytes: read whole from where the engine keeps the version, once.
  std::lock_guard read(slot->mu);
  if (!slot->whole_read) {
    slot->whole = whole(*bucket);
    slot->whole_read = true;
  }
  return slot->whole;
}

absl::Status Subscription::Ack(absl::string_view token, uint64_t version, uint32_t index,
                               uint64_t checksum, uint32_t attempt) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  HubLock lock(*hub_);
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
  HubLock lock(*hub_);
  hub_->Leave(id_, /*closed=*/true);
}

void Subscription::Cancel() {
  HubLock lock(*hub_);
  if (auto it = hub_->receivers.find(id_); it != hub_->receivers.end()) {
    it->second->cancelled = true;
    hub_->Wake(id_, *it->second);
  }
}

}  // namespace wpub::transport
