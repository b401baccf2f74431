// The version a receiver assembles from its group's members' parts: staged before the last
// acknowledgement, applied on the commit (the staged file renamed into place), discarded on an
// abort, or held in doubt until a daemon says what became of it.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "clients/recv/receiver_impl.h"
#include "core/common/status.h"
#include "core/transport/checksum.h"
#include "wire/convert.h"
#include "wire/status_map.h"

namespace wpub::recv {

void Receiver::Impl::DiscardAssembly() {
  if (assembly_ != nullptr && assembly_->staged) std::remove(stage_path_.c_str());
  assembly_.reset();
}

void Receiver::Impl::DiscardAssembly(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (assembly_ != nullptr && assembly_->version == version) DiscardAssembly();
}

absl::Status Receiver::Impl::HandOver(Link& link) {
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
  part.checksums = pending.checksums;
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

std::vector<SafetensorsEntry> Receiver::Impl::AssemblyEntries() const {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [member, part] : assembly_->parts) {
    std::vector<SafetensorsEntry> e = EntriesOf(part.manifest, part.buckets);
    entries.insert(entries.end(), e.begin(), e.end());
  }
  return entries;
}

absl::Status Receiver::Impl::StageOutput() {
  if (options_.output_path.empty() || assembly_->staged) return absl::OkStatus();
  WPUB_RETURN_IF_ERROR(
      StageSafetensors(stage_path_, AssemblyEntries(), MetadataOf(MergedManifest(*assembly_))));
  assembly_->staged = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> Receiver::Impl::OnCommit(Link& link, uint64_t version) {
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

absl::Status Receiver::Impl::ApplyLocked() {
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
    model->checksums.insert(model->checksums.end(), part.checksums.begin(), part.checksums.end());
  }
  assembly_.reset();
  // What this version cost on the wire (a patch's bytes for a patched bucket).
  spdlog::info(
      "[{}] committed v{} ({} buckets, {} bytes; pulled {} bytes, {} buckets from patches)",
      options_.name, version, model->buckets.size(), model->manifest.total_bytes(),
      stats_.bytes - bytes_at_commit_, stats_.patched_buckets - patched_at_commit_);
  bytes_at_commit_ = stats_.bytes;
  patched_at_commit_ = stats_.patched_buckets;
  // The version it replaces, held by nothing else (committed() hands out copies under mu_):
  // its buckets are the next version's buffers (a receiver that takes patches keeps the version
  // before last between publications; the peak, while the next one arrives, is unchanged).
  spare_.clear();
  if (options_.patches && committed_ != nullptr && committed_.use_count() == 1) {
    spare_ = std::move(committed_->buckets);
  }
  committed_ = std::move(model);
  ++stats_.commits;
  stats_.last_committed_version = version;
  return absl::OkStatus();
}

uint64_t Receiver::Impl::StagedVersionLocked() const {
  if (assembly_ != nullptr && assembly_->complete()) return assembly_->version;
  return adopted_version_;
}

absl::Status Receiver::Impl::ResolveStagedLocked(uint64_t version, bool apply,
                                                 const std::string& why) {
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
    spdlog::info("[{}] applied v{}, staged before this process started: {}", options_.name, version,
                 why);
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

}  // namespace wpub::recv
