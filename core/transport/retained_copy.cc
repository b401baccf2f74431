// RetainedCopy: the committed version's buckets, staged per publication, promoted at commit.
#include "core/transport/retained_copy.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace wpub::transport {
namespace {

bool InMemory(RetainWhere where) {
  return where == RetainWhere::kDevice || where == RetainWhere::kPinned;
}

}  // namespace

absl::StatusOr<RetainWhere> ParseRetainWhere(absl::string_view text) {
  if (text == "off") return RetainWhere::kOff;
  if (text == "host") return RetainWhere::kHost;
  if (text == "device") return RetainWhere::kDevice;
  if (text == "pinned") return RetainWhere::kPinned;
  return absl::InvalidArgumentError(
      absl::StrCat("retain: '", text, "' is not one of off, host, device, pinned"));
}

absl::Status RetainedVersion::CheckIndex(size_t i) const {
  if (i < manifest.buckets.size()) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("v", manifest.version, " has ", manifest.buckets.size(),
                                            " buckets, not ", i + 1));
}

absl::StatusOr<std::shared_ptr<const Bucket>> RetainedVersion::BucketAt(size_t i) const {
  if (absl::Status s = CheckIndex(i); !s.ok()) return s;
  if (memory != nullptr) return memory->Emit(manifest.version, manifest.buckets[i]);
  return buckets[i];
}

absl::StatusOr<std::shared_ptr<const Bucket>> RetainedVersion::HostBucketAt(size_t i) const {
  if (absl::Status s = CheckIndex(i); !s.ok()) return s;
  if (memory != nullptr) return memory->HostCopy(manifest.version, manifest.buckets[i]);
  return buckets[i];
}

absl::StatusOr<std::unique_ptr<RetainedCopy>> RetainedCopy::Create(
    RetainedCopyOptions options, std::shared_ptr<RetainedMemory> memory) {
  if (InMemory(options.where)) {
    if (memory == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--retain=", RetainWhereName(options.where),
          " keeps the copy in GPU-path memory: it needs the GPU path (--gpu_path or --engines)"));
    }
    if (memory->where() != options.where) {
      return absl::InvalidArgumentError(
          absl::StrCat("retained copy: --retain=", RetainWhereName(options.where),
                       " given memory of kind ", RetainWhereName(memory->where())));
    }
  } else {
    memory.reset();  // host buckets are kept by reference
  }
  return std::unique_ptr<RetainedCopy>(new RetainedCopy(options, std::move(memory)));
}

RetainedCopy::RetainedCopy(RetainedCopyOptions options, std::shared_ptr<RetainedMemory> memory)
    : options_(options),
      memory_(std::move(memory)),
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
    info.buckets = static_cast<uint32_t>(retained_->bucket_count());
  } else {
    info.reason = reason_;
  }
  info.held_bytes = memory_ != nullptr ? memory_->held_bytes() : info.bytes;
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
  c.accepts = memory_ != nullptr ? memory_->accepts() : kHostOnly;
  c.acknowledges_checksums = false;
  c.retains = true;
  return c;
}

void RetainedCopy::StopStaging(std::string why) {
  if (!staging_) return;
  staging_ = false;
  if (staged_memory_ != nullptr) staged_memory_->Abandon();
  stopped_memory_ = std::move(staged_memory_);
  not_staged_ = std::move(why);
  spdlog::warn("v{}: {}: if it commits, nothing is retained", staging_version_, not_staged_);
}

absl::StatusOr<std::vector<std::string>> RetainedCopy::Begin(const PublicationManifest& manifest) {
  std::lock_guard lock(mu_);
  if (in_flight_) {
    return absl::FailedPreconditionError(absl::StrCat("retained copy: publication ",
                                                      staged_ ? staged_->manifest.version : 0,
                                                      " is still in flight"));
  }
  staged_.reset();
  staged_memory_.reset();
  stopped_memory_.reset();
  staged_count_ = 0;
  staging_ = false;
  not_staged_.clear();
  if (options_.where == RetainWhere::kOff || manifest.replay) return std::vector<std::string>{};
  in_flight_ = true;
  staging_version_ = manifest.version;
  staged_ = std::make_shared<RetainedVersion>();
  staged_->manifest = manifest;
  staging_ = true;
  if (options_.max_bytes != 0 && manifest.total_bytes() > options_.max_bytes) {
    StopStaging(absl::StrCat(manifest.total_bytes(), " bytes are over the bound of ",
                             options_.max_bytes, " bytes (--retain_max_bytes)"));
  } else if (InMemory(options_.where) && memory_ == nullptr) {
    StopStaging(absl::StrCat("--retain=", RetainWhereName(options_.where),
                             " has no memory here (it needs the GPU path)"));
  } else if (memory_ != nullptr) {
    absl::StatusOr<std::shared_ptr<RetainedBytes>> reserved = memory_->Reserve(manifest);
    if (reserved.ok()) {
      staged_memory_ = *std::move(reserved);
    } else {
      StopStaging(absl::StrCat(RetainWhereName(options_.where),
                               " memory for the copy: ", reserved.status().message()));
    }
  }
  if (!staging_) return std::vector<std::string>{};
  return std::vector<std::string>{"retained copy"};
}

absl::Status RetainedCopy::Send(std::shared_ptr<const Bucket> bucket) {
  std::lock_guard lock(mu_);
  if (!in_flight_ || bucket->version != staged_->manifest.version) {
    return absl::CancelledError(
        absl::StrCat("retained copy: version ", bucket->version, " is not in flight"));
  }
  if (!staging_) return absl::OkStatus();
  const uint32_t index = bucket->manifest.index;
  if (index != staged_count_ || index >= staged_->manifest.buckets.size() ||
      bucket->manifest.nbytes != staged_->manifest.buckets[index].nbytes) {
    return absl::InternalError(absl::StrCat(
        "retained copy: bucket ", index, " of v", bucket->version,
        " out of order or of the wrong size (", bucket->manifest.nbytes, " bytes, manifest says ",
        index < staged_->manifest.buckets.size() ? staged_->manifest.buckets[index].nbytes : 0,
        ")"));
  }
  if (staged_memory_ != nullptr) {
    if (absl::Status s = staged_memory_->Stage(*bucket); !s.ok()) {
      StopStaging(absl::StrCat("the copy of bucket ", index, " failed: ", s.message()));
      return absl::OkStatus();  // the copy never fails the publication
    }
  } else {
    if (bucket->location != BucketLocation::kHost) {
      return absl::InternalError(absl::StrCat("retained copy: bucket ", index, " of v",
                                              bucket->version, " is not in host memory"));
    }
    if (bucket->bytes.size() != bucket->manifest.nbytes) {
      return absl::InternalError(absl::StrCat(
          "retained copy: bucket ", index, " of v", bucket->version, " holds ",
          bucket->bytes.size(), " bytes, its manifest says ", bucket->manifest.nbytes));
    }
    // The manifest the bucket carries has its checksum (a device bucket's host copy too).
    staged_->manifest.buckets[index] = bucket->manifest;
    staged_->buckets.push_back(std::move(bucket));
  }
  staged_->bytes += staged_->manifest.buckets[index].nbytes;
  ++staged_count_;
  return absl::OkStatus();
}

absl::Status RetainedCopy::WaitAcknowledged(absl::Time) { return absl::OkStatus(); }

absl::Status RetainedCopy::Commit() {
  std::lock_guard lock(mu_);
  if (!in_flight_) return absl::OkStatus();
  in_flight_ = false;
  std::shared_ptr<RetainedVersion> staged = std::move(staged_);
  std::shared_ptr<RetainedBytes> memory = std::move(staged_memory_);
  const uint64_t version = staged->manifest.version;
  if (staging_ && staged_count_ != staged->manifest.buckets.size()) {
    StopStaging(absl::StrCat("committed with ", staged_count_, " of ",
                             staged->manifest.buckets.size(), " buckets retained"));
  }
  if (staging_ && memory != nullptr) {
    absl::StatusOr<std::vector<uint64_t>> sums = memory->Seal();
    if (sums.ok() && sums->size() == staged->manifest.buckets.size()) {
      for (size_t i = 0; i < sums->size(); ++i) staged->manifest.buckets[i].checksum = (*sums)[i];
      staged->memory = std::move(memory);
    } else {
      StopStaging(absl::StrCat("its copy could not be sealed: ",
                               sums.ok() ? "checksums missing" : sums.status().message()));
    }
  }
  staging_ = false;
  stopped_memory_.reset();
  if (!not_staged_.empty()) {
    // The committed version is not here: an older copy must not stand in for it.
    retained_.reset();
    ++over_bound_;
    reason_ = absl::StrCat("v", version, " was not retained: ", not_staged_);
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
  if (staged_memory_ != nullptr) staged_memory_->Abandon();
  staged_memory_.reset();
  stopped_memory_.reset();
}

std::shared_ptr<RetainedBytes> RetainedCopy::StagingBytes(uint64_t version) const {
  std::lock_guard lock(mu_);
  if (!in_flight_ || staging_version_ != version) return nullptr;
  return staging_ ? staged_memory_ : stopped_memory_;
}

bool RetainedCopy::Staging(uint64_t version) const {
  std::lock_guard lock(mu_);
  return in_flight_ && staging_ && staging_version_ == version && staged_memory_ != nullptr;
}

}  // namespace wpub::transport
