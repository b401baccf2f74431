// TransportGroup: one publication over several transports.
#include "core/transport/transport_group.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wpub::transport {

absl::StatusOr<std::unique_ptr<TransportGroup>> TransportGroup::Create(
    std::vector<Transport*> members) {
  if (members.empty()) return absl::InvalidArgumentError("a transport group needs a member");
  std::vector<TransportCapabilities> caps;
  for (const Transport* t : members) {
    if (t == nullptr) return absl::InvalidArgumentError("a transport group member is null");
    caps.push_back(t->capabilities());
  }
  size_t device_readers = 0;
  for (const TransportCapabilities& c : caps) {
    device_readers += Contains(c.accepts, BucketLocation::kDevice) ? 1 : 0;
  }
  for (const TransportCapabilities& c : caps) {
    // Beside another device reader it may have to take the host copy.
    if (device_readers > 1 && Contains(c.accepts, BucketLocation::kDevice) &&
        !Contains(c.accepts, BucketLocation::kHost)) {
      return absl::InvalidArgumentError(
          absl::StrCat("transport ", c.name,
                       " reads device buckets only, beside another device reader: it must take "
                       "host buckets too"));
    }
  }
  return std::unique_ptr<TransportGroup>(new TransportGroup(std::move(members), std::move(caps)));
}

TransportCapabilities TransportGroup::capabilities() const {
  TransportCapabilities c;
  c.accepts = 0;
  c.acknowledges_checksums = true;
  std::vector<std::string> names;
  for (const Transport* t : members_) {
    const TransportCapabilities m = t->capabilities();
    names.push_back(m.name);
    if (m.retains) continue;  // no receivers: says nothing of how they are reached
    c.accepts |= m.accepts;
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
  device_readers_.clear();
  for (size_t i = 0; i < members_.size(); ++i) {
    absl::StatusOr<std::vector<std::string>> names = members_[i]->Begin(manifest);
    if (!names.ok()) {
      for (size_t j = 0; j < i; ++j) members_[j]->Abort(names.status().message());
      return names.status();
    }
    participants_[i] = names->size();
    if (participants_[i] > 0 && device_readers_.size() < kMaxDeviceReaders &&
        Contains(caps_[i].accepts, BucketLocation::kDevice)) {
      device_readers_.push_back(i);
    }
    if (caps_[i].retains) continue;  // takes the buckets, counts as no participant
    all.insert(all.end(), names->begin(), names->end());
  }
  return all;
}

absl::Status TransportGroup::Send(std::shared_ptr<const Bucket> bucket) {
  // Members that take the bucket where it lives first (the retained copy's staging among them:
  // a member that defers the bytes is asked after the copy it would read them from was made),
  // then the ones that take host bytes, each in member order.
  std::vector<size_t> host_takers;
  for (size_t i = 0; i < members_.size(); ++i) {
    if (i < participants_.size() && participants_[i] == 0) continue;
    const TransportCapabilities& c = caps_[i];
    std::shared_ptr<const Bucket> given = bucket;
    bool takes_it_as_is = Contains(c.accepts, bucket->location);
    if (takes_it_as_is && bucket->location == BucketLocation::kDevice) {
      // The k-th device reader records the producer's k-th event; the first one the bucket's
      // own `done`. A reader the producer has no event for takes the host copy.
      const size_t k = static_cast<size_t>(
          std::find(device_readers_.begin(), device_readers_.end(), i) - device_readers_.begin());
      takes_it_as_is =
          k < device_readers_.size() && (k == 0 || bucket->device.reader_done[k] != nullptr);
      if (takes_it_as_is && k > 0) {
        auto own = std::make_shared<Bucket>(*bucket);
        own->device.done = bucket->device.reader_done[k];
        given = std::move(own);
      }
    }
    if (!takes_it_as_is) {
      if (bucket->location != BucketLocation::kDevice ||
          !Contains(c.accepts, BucketLocation::kHost) || !bucket->device.copy_to_host) {
        return absl::InternalError(absl::StrCat("transport ", c.name, " cannot take bucket ",
                                                bucket->manifest.index, " where it lives"));
      }
      host_takers.push_back(i);
      continue;
    }
    if (absl::Status s = members_[i]->Send(std::move(given)); !s.ok()) return s;
  }
  std::shared_ptr<const Bucket> host_copy;  // of the device bucket, made at most once
  std::shared_ptr<const Bucket> deferred;   // its manifest and checksum alone, at most once
  const bool has_checksum =
      bucket->device.checksum_to_host != nullptr || bucket->manifest.checksum != 0;
  for (const size_t i : host_takers) {
    Transport* t = members_[i];
    std::shared_ptr<const Bucket> given;
    if (has_checksum && t->DefersBytes(*bucket)) {
      if (deferred == nullptr) {
        auto d = std::make_shared<Bucket>();
        d->version = bucket->version;
        d->manifest = bucket->manifest;
        d->bytes_deferred = true;
        if (bucket->device.checksum_to_host) {
          absl::StatusOr<uint64_t> sum = bucket->device.checksum_to_host();
          if (!sum.ok()) return sum.status();
          d->manifest.checksum = *sum;
        }
        deferred = std::move(d);
      }
      given = deferred;
    } else {
      if (!host_copy) {
        absl::StatusOr<std::shared_ptr<const Bucket>> copied = bucket->device.copy_to_host();
        if (!copied.ok()) return copied.status();
        host_copy = *std::move(copied);
      }
      given = host_copy;
    }
    if (absl::Status s = t->Send(std::move(given)); !s.ok()) return s;
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

absl::Status TransportGroup::CommitDecided() {
  for (Transport* t : members_) {
    if (absl::Status s = t->CommitDecided(); !s.ok()) {
      spdlog::warn("a decided commit: a transport could not tell its receivers: {}", s.ToString());
    }
  }
  return absl::OkStatus();
}

void TransportGroup::MarkParticipantsDirty() {
  for (Transport* t : members_) t->MarkParticipantsDirty();
}

bool TransportGroup::HasReceiversApplyingOnReceipt() const {
  for (size_t i = 0; i < members_.size(); ++i) {
    if (caps_[i].applies_on_receipt && !members_[i]->Receivers().empty()) return true;
  }
  return false;
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

}  // namespace wpub::transport
