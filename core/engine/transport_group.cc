// TransportGroup: one publication over several transports.
#include "core/engine/transport_group.h"

#include "absl/strings/str_join.h"

namespace wpub::engine {

TransportCapabilities TransportGroup::capabilities() const {
  TransportCapabilities c;
  c.host_buckets = false;
  c.acknowledges_checksums = true;
  std::vector<std::string> names;
  for (const Transport* t : members_) {
    const TransportCapabilities m = t->capabilities();
    names.push_back(m.name);
    c.host_buckets |= m.host_buckets;
    c.device_buckets |= m.device_buckets;
    c.receiver_paced |= m.receiver_paced;
    c.acknowledges_checksums &= m.acknowledges_checksums;
    if (m.max_bucket_bytes != 0 &&
        (c.max_bucket_bytes == 0 || m.max_bucket_bytes < c.max_bucket_bytes)) {
      c.max_bucket_bytes = m.max_bucket_bytes;
    }
  }
  c.name = absl::StrJoin(names, "+");
  return c;
}

absl::StatusOr<std::vector<std::string>> TransportGroup::Begin(
    const PublicationManifest& manifest) {
  std::vector<std::string> all;
  participants_.assign(members_.size(), 0);
  for (size_t i = 0; i < members_.size(); ++i) {
    absl::StatusOr<std::vector<std::string>> names = members_[i]->Begin(manifest);
    if (!names.ok()) {
      for (size_t j = 0; j < i; ++j) members_[j]->Abort(names.status().message());
      return names.status();
    }
    participants_[i] = names->size();
    all.insert(all.end(), names->begin(), names->end());
  }
  return all;
}

bool TransportGroup::host_only_participants() const {
  for (size_t i = 0; i < members_.size() && i < participants_.size(); ++i) {
    const TransportCapabilities c = members_[i]->capabilities();
    if (c.host_buckets && !c.device_buckets && participants_[i] > 0) return true;
  }
  return false;
}

absl::Status TransportGroup::Send(std::shared_ptr<const Bucket> bucket) {
  for (Transport* t : members_) {
    const TransportCapabilities c = t->capabilities();
    if (!c.host_buckets || (bucket->sent_direct && c.device_buckets)) continue;
    if (absl::Status s = t->Send(bucket); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TransportGroup::WaitAcknowledged(absl::Time deadline) {
  for (size_t i = 0; i < members_.size(); ++i) {
    if (i < participants_.size() && participants_[i] == 0) continue;
    if (absl::Status s = members_[i]->WaitAcknowledged(deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TransportGroup::Commit() {
  // Stops at the first member that cannot commit and aborts it and the members after it; the
  // ones before have already committed (the engine reports the publication as aborted and the
  // per-receiver outcomes say who applied it).
  for (size_t i = 0; i < members_.size(); ++i) {
    if (absl::Status s = members_[i]->Commit(); !s.ok()) {
      for (size_t j = i; j < members_.size(); ++j) members_[j]->Abort(s.message());
      return s;
    }
  }
  return absl::OkStatus();
}

void TransportGroup::Abort(absl::string_view reason) {
  for (Transport* t : members_) t->Abort(reason);
}

std::vector<ReceiverOutcome> TransportGroup::Outcomes() const {
  std::vector<ReceiverOutcome> all;
  for (const Transport* t : members_) {
    std::vector<ReceiverOutcome> o = t->Outcomes();
    all.insert(all.end(), o.begin(), o.end());
  }
  return all;
}

std::vector<ReceiverInfo> TransportGroup::Receivers() const {
  std::vector<ReceiverInfo> all;
  for (const Transport* t : members_) {
    std::vector<ReceiverInfo> r = t->Receivers();
    all.insert(all.end(), r.begin(), r.end());
  }
  return all;
}

}  // namespace wpub::engine
