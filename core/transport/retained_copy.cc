// RetainedCopy: the committed version's buckets, staged per publication, promoted at commit.
#include "core/transport/retained_copy.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace wpub::transport {

absl::StatusOr<RetainWhere> ParseRetainWhere(absl::string_view text) {
  if (text == "off") return RetainWhere::kOff;
  if (text == "host") return RetainWhere::kHost;
  return absl::InvalidArgumentError(absl::StrCat("retain: '", text, "' is not one of off, host"));
}

RetainedCopy::RetainedCopy(RetainedCopyOptions options)
    : options_(options),
      reason_(options.where == RetainWhere::kOff
                  ? "the retained copy is off (--retain=off)"
                  : "no version committed since the daemon started") {}

std::shared_ptr<const RetainedVersion> RetainedCopy::Retained() const {
  std::lock_guard lock(mu_);
  return retained_;
}

RetainedCopyInfo RetainedCopy::Info() const {
  std::lock_guard lock(mu_);
  RetainedCopyInfo info;
  info.where = options_.where;
  info.max_bytes = options_.max_bytes;
  info.over_bound = over_bound_;
  if (retained_) {
    info.version = retained_->manifest.version;
    info.bytes = retained_->bytes;
    info.buckets = static_cast<uint32_t>(retained_->buckets.size());
  } else {
    info.reason = reason_;
  }
  return info;
}

void RetainedCopy::Drop(absl::string_view why) {
  std::lock_guard lock(mu_);
  if (retained_) {
    spdlog::info("retained copy of v{} dropped: {}", retained_->manifest.version, std::string(why));
  }
  retained_.reset();
  reason_ = std::string(why);
}

TransportCapabilities RetainedCopy::capabilities() const {
  TransportCapabilities c;
  c.name = "retained";
  c.accepts = kHostOnly;
  c.acknowledges_checksums = false;
  c.retains = true;
  return c;
}

absl::StatusOr<std::vector<std::string>> RetainedCopy::Begin(const PublicationManifest& manifest) {
  std::lock_guard lock(mu_);
  if (in_flight_) {
    return absl::FailedPreconditionError(absl::StrCat("retained copy: publication ",
                                                      staged_ ? staged_->manifest.version : 0,
                                                      " is still in flight"));
  }
  staged_.reset();
  staging_ = false;
  if (options_.where == RetainWhere::kOff || manifest.replay) return std::vector<std::string>{};
  in_flight_ = true;
  staged_ = std::make_shared<RetainedVersion>();
  staged_->manifest = manifest;
  staging_ = options_.max_bytes == 0 || manifest.total_bytes() <= options_.max_bytes;
  if (!staging_) {
    spdlog::warn(
        "v{}: {} bytes are over the retained copy's bound of {} bytes (--retain_max_bytes):"
        " if it commits, nothing is retained",
        manifest.version, manifest.total_bytes(), options_.max_bytes);
  }
  return std::vector<std::string>{"retained copy"};
}

absl::Status RetainedCopy::Send(std::shared_ptr<const Bucket> bucket) {
  std::lock_guard lock(mu_);
  if (!in_flight_ || bucket->version != staged_->manifest.version) {
    return absl::CancelledError(
        absl::StrCat("retained copy: version ", bucket->version, " is not in flight"));
  }
  if (!staging_) return absl::OkStatus();
  if (bucket->location != BucketLocation::kHost) {
    return absl::InternalError(absl::StrCat("retained copy: bucket ", bucket->manifest.index,
                                            " of v", bucket->version, " is not in host memory"));
  }
  const uint32_t index = bucket->manifest.index;
  if (index != staged_->buckets.size() || index >= staged_->manifest.buckets.size() ||
      bucket->bytes.size() != bucket->manifest.nbytes) {
    return absl::InternalError(absl::StrCat("retained copy: bucket ", index, " of v",
                                            bucket->version, " out of order or of the wrong size (",
                                            bucket->bytes.size(), " bytes, manifest says ",
                                            bucket->manifest.nbytes, ")"));
  }
  staged_->bytes += bucket->manifest.nbytes;
  // The manifest the bucket carries has its checksum (a device bucket's host copy too).
  staged_->manifest.buckets[index] = bucket->manifest;
  staged_->buckets.push_back(std::move(bucket));
  return absl::OkStatus();
}

absl::Status RetainedCopy::WaitAcknowledged(absl::Time) { return absl::OkStatus(); }

absl::Status RetainedCopy::Commit() {
  std::lock_guard lock(mu_);
  if (!in_flight_) return absl::OkStatus();
  in_flight_ = false;
  std::shared_ptr<RetainedVersion> staged = std::move(staged_);
  const uint64_t version = staged->manifest.version;
  if (!staging_ || staged->buckets.size() != staged->manifest.buckets.size()) {
    // The committed version is not here: an older copy must not stand in for it.
    retained_.reset();
    ++over_bound_;
    reason_ = staging_ ? absl::StrCat("v", version, " committed without every bucket retained")
                       : absl::StrCat("v", version, " (", staged->manifest.total_bytes(),
                                      " bytes) is over the bound of ", options_.max_bytes,
                                      " bytes (--retain_max_bytes)");
    spdlog::warn("retained copy: nothing retained: {}", reason_);
    return absl::OkStatus();
  }
  staged->committed_at = absl::Now();
  retained_ = std::move(staged);
  reason_.clear();
  return absl::OkStatus();
}

void RetainedCopy::Abort(absl::string_view) {
  std::lock_guard lock(mu_);
  in_flight_ = false;
  staging_ = false;
  staged_.reset();
}

}  // namespace wpub::transport
