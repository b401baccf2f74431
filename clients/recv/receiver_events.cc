// The events of one subscription (wpub-recv's Receiver): group info, manifests, buckets pulled,
// checked and acknowledged in order, commits and aborts.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "clients/recv/receiver_impl.h"
#include "core/common/status.h"
#include "core/delta/bucket_patch.h"
#include "core/transport/checksum.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::recv {

absl::StatusOr<bool> Receiver::Impl::Handle(Link& link, const pb::ReceiverEvent& event) {
  switch (event.kind_case()) {
    case pb::ReceiverEvent::kGroupInfo: {
      const pb::GroupInfo& info = event.group_info();
      link.token = info.subscription_token();
      absl::MutexLock lock(&mu_);
      ++stats_.subscriptions;
      if (const uint64_t staged = StagedVersionLocked(); staged != 0) {
        if (info.staged() == pb::GroupInfo::STAGED_UNKNOWN) {
          spdlog::warn("[{}] holds v{} staged, in doubt: {} cannot say ({})", options_.name, staged,
                       link.target, info.staged_reason());
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
                            wire::FromProto(event.manifest()));
      link.pending = std::make_unique<Pending>();
      link.pending->buckets.resize(manifest.buckets.size());
      link.pending->checksums.assign(manifest.buckets.size(), 0);
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
      link.pending->patch_base = options_.patches ? event.manifest().patch_base() : 0;
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
      spdlog::warn("[{}] v{} aborted ({}): {}", options_.name, event.abort().version(), link.target,
                   event.abort().reason());
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

absl::StatusOr<bool> Receiver::Impl::Pull(Link& link, uint64_t version, uint32_t index,
                                          uint64_t* expected_checksum, uint64_t* received,
                                          std::optional<uint64_t>* rebuilt_checksum) {
  Pending& pending = *link.pending;
  // A patch needs this bucket of the base in memory (a version held from an output file at
  // start is not: it is pulled whole).
  std::shared_ptr<const CommittedModel> base;
  if (pending.patch_base != 0) {
    absl::MutexLock lock(&mu_);
    if (committed_ != nullptr && committed_->manifest.version == pending.patch_base &&
        index < committed_->buckets.size()) {
      base = committed_;
    }
  }
  if (base != nullptr) {
    absl::StatusOr<bool> patched =
        PullPatched(link, version, index, *base, expected_checksum, received, rebuilt_checksum);
    if (!patched.ok() || *patched) return patched;
    // The daemon sent the bucket whole, or the patch did not apply: pulled whole below.
  }
  return PullWhole(link, version, index, expected_checksum, received);
}

pb::PullBucketRequest Receiver::Impl::PullRequest(const Link& link, uint64_t version,
                                                  uint32_t index, bool patch) const {
  pb::PullBucketRequest request;
  request.set_receiver_name(options_.name);
  request.set_version(version);
  request.set_index(index);
  request.set_chunk_bytes(options_.chunk_bytes);
  request.set_subscription_token(link.token);
  request.set_attempt(link.pending->manifest.attempt);
  request.set_patch(patch);
  return request;
}

absl::StatusOr<bool> Receiver::Impl::PullPatched(Link& link, uint64_t version, uint32_t index,
                                                 const CommittedModel& base,
                                                 uint64_t* expected_checksum, uint64_t* received,
                                                 std::optional<uint64_t>* rebuilt_checksum) {
  Pending& pending = *link.pending;
  const transport::BucketManifest& bm = pending.manifest.buckets[index];
  const absl::Time t_pull = absl::Now();
  grpc::ClientContext context;
  Authorize(&context);
  std::unique_ptr<grpc::ClientReader<pb::BucketChunk>> reader =
      link.stub->PullBucket(&context, PullRequest(link, version, index, /*patch=*/true));
  pb::BucketChunk chunk;
  std::vector<uint8_t> data;
  uint64_t patch_base = 0, checksum = bm.checksum, size = 0, got = 0;
  while (reader->Read(&chunk)) {
    if (chunk.offset() == 0) {
      patch_base = chunk.patch_base();
      size = patch_base != 0 ? chunk.nbytes() : bm.nbytes;
      if (chunk.checksum() != 0) checksum = chunk.checksum();
      // A patch is never larger than the bucket it makes (the daemon sends it whole then).
      if (size > std::max<uint64_t>(bm.nbytes, delta::kBucketPatchHeaderBytes)) {
        context.TryCancel();
        reader->Finish();
        spdlog::warn(
            "[{}] bucket {} of v{}: a patch of {} bytes for a bucket of {}; pulling it "
            "whole",
            options_.name, index, version, size, bm.nbytes);
        return false;
      }
      data.assign(size, 0);
    }
    if (chunk.offset() + chunk.data().size() > data.size()) {
      context.TryCancel();
      reader->Finish();
      return absl::DataLossError(absl::StrCat("bucket ", index, " of v", version,
                                              ": chunk beyond the ", data.size(), " bytes"));
    }
    std::copy(chunk.data().begin(), chunk.data().end(), data.begin() + chunk.offset());
    got += chunk.data().size();
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) {
    spdlog::warn("[{}] pulling bucket {} of v{} from {}: {}", options_.name, index, version,
                 link.target, status.error_message());
    return absl::StatusOr<bool>(false);
  }
  *received += got;
  *expected_checksum = checksum;
  if (got != size) data.clear();  // short: fails its check (whole) or its application (patch)
  if (patch_base == 0) {          // sent whole: the bytes are the bucket
    pending.buckets[index] = std::move(data);
    return true;
  }
  const absl::Time t_rebuild = absl::Now();
  uint64_t rebuilt_sum = 0;
  std::vector<uint8_t> rebuilt = TakeSpare(index, bm.nbytes);
  const absl::Status applied =
      patch_base == base.manifest.version
          ? delta::ApplyBucketPatchInto(
                data, base.buckets[index], &rebuilt,
                {.threads = options_.patch_threads,
                 .base_checksum = index < base.checksums.size()
                                      ? std::optional<uint64_t>(base.checksums[index])
                                      : std::nullopt,
                 .checksum = &rebuilt_sum})
          : absl::FailedPreconditionError(absl::StrCat("a patch against v", patch_base));
  if (!applied.ok() || delta::PatchTargetChecksum(data) != checksum) {
    spdlog::warn(
        "[{}] bucket {} of v{}: the patch against v{} did not apply ({}); pulling it "
        "whole",
        options_.name, index, version, base.manifest.version,
        applied.ok() ? "checksum" : applied.ToString());
    return false;
  }
  pending.buckets[index] = std::move(rebuilt);
  *rebuilt_checksum = rebuilt_sum;
  {
    const absl::Time t_done = absl::Now();
    absl::MutexLock lock(&mu_);
    ++stats_.patched_buckets;
    stats_.patch_pull_seconds += absl::ToDoubleSeconds(t_rebuild - t_pull);
    stats_.patch_rebuild_seconds += absl::ToDoubleSeconds(t_done - t_rebuild);
  }
  return true;
}

std::vector<uint8_t> Receiver::Impl::TakeSpare(uint32_t index, uint64_t nbytes) {
  absl::MutexLock lock(&mu_);
  if (index < spare_.size() && spare_[index].size() == nbytes) return std::move(spare_[index]);
  return {};
}

absl::StatusOr<bool> Receiver::Impl::PullWhole(Link& link, uint64_t version, uint32_t index,
                                               uint64_t* expected_checksum, uint64_t* received) {
  Pending& pending = *link.pending;
  const transport::BucketManifest& bm = pending.manifest.buckets[index];
  std::vector<uint8_t>& bytes = pending.buckets[index];
  bytes = TakeSpare(index, bm.nbytes);  // every byte is written (or the bucket is cleared)
  if (bytes.size() != bm.nbytes) bytes.assign(bm.nbytes, 0);
  grpc::ClientContext context;
  Authorize(&context);
  std::unique_ptr<grpc::ClientReader<pb::BucketChunk>> reader =
      link.stub->PullBucket(&context, PullRequest(link, version, index, /*patch=*/false));
  pb::BucketChunk chunk;
  // The manifest is announced before packing; the daemon sends the packed bucket's checksum
  // with the first chunk.
  *expected_checksum = bm.checksum;
  uint64_t got = 0;
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
    got += chunk.data().size();
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) {
    spdlog::warn("[{}] pulling bucket {} of v{} from {}: {}", options_.name, index, version,
                 link.target, status.error_message());
    return false;
  }
  *received += got;
  if (got != bm.nbytes) bytes.clear();  // short: fails its check, the publication aborts
  return true;
}

absl::Status Receiver::Impl::PullAndAck(Link& link, uint64_t version, uint32_t index) {
  if (index >= link.pending->buckets.size()) {
    return absl::InternalError(absl::StrCat("bucket ", index, " of v", version, " unknown"));
  }
  uint64_t expected_checksum = 0;
  uint64_t received = 0;  // bytes on the wire (a patch's, and the bucket's when pulled again)
  std::optional<uint64_t> rebuilt_checksum;  // of a bucket rebuilt from a patch
  WPUB_ASSIGN_OR_RETURN(
      bool pulled, Pull(link, version, index, &expected_checksum, &received, &rebuilt_checksum));
  if (!pulled) return absl::OkStatus();
  Pending& pending = *link.pending;
  std::vector<uint8_t>& bytes = pending.buckets[index];
  const uint64_t nbytes = pending.manifest.buckets[index].nbytes;
  if (options_.corrupt_bucket == static_cast<int64_t>(index) && !bytes.empty()) {
    bytes[bytes.size() / 2] ^= 0x5A;
    rebuilt_checksum.reset();
  }
  const uint64_t checksum = rebuilt_checksum.has_value()
                                ? *rebuilt_checksum
                                : transport::Checksum(bytes.data(), bytes.size());
  const bool match = checksum == expected_checksum && bytes.size() == nbytes;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.buckets;
    stats_.bytes += received;
    if (!match) ++stats_.checksum_mismatches;
  }
  if (match) pending.checksums[index] = checksum;
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

}  // namespace wpub::recv
