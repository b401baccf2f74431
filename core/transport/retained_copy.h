// The retained copy: the last committed version's buckets exactly as they were emitted (bytes,
// manifests, checksums), kept by the daemon so that engines and receivers converge on the
// committed version without the trainer publishing again -- a dirty engine is restored after
// an abort, an engine or receiver that joins behind is caught up (docs/DESIGN.md, "Convergence
// on the committed version").
//
// It is one more member of the publication's transport group, without receivers: a retaining
// transport (TransportCapabilities::retains) takes every bucket of every publication it joins
// and is never counted among participants, receivers or outcomes. Per publication it stages the
// buckets as they are sent, promotes them at Commit (the staged copy becomes the retained
// version) and drops them at Abort (the retained version stays the last committed one). The copy
// is the committed version or nothing, never an older one: a version over the memory bound is
// not staged, and when it commits the previous copy is dropped too.
//
// Where the copy lives: RetainWhere::kHost keeps host buckets by reference (they are immutable
// once emitted: the CPU backend's buckets cost nothing more) and takes the one host copy of a
// device bucket the transport group makes (one device-to-host copy and one host synchronization
// per bucket on the GPU path). kDevice and kPinned keep the bytes in a RetainedMemory
// (retained_memory.h, the GPU layer's): the copy is then one more reader of each device bucket
// (an enqueued copy, no host synchronization per bucket; one wait at commit), and a replay emits
// device buckets the engines' broadcasts read as they read a publication's. kOff retains
// nothing. A version that cannot be copied (over the bound, memory refused, a copy failed) is
// not retained and never fails the publication.
//
// A replay of the retained version (a restore or a catch-up) is a publication whose manifest
// says `replay`: the retained copy does not take part in it (it is the source).
//
// Thread-safety: as Transport (the engine's publication thread drives it, Abort from any
// thread); Retained and Info from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/transport/retained_memory.h"
#include "core/transport/transport.h"

namespace wpub::transport {

// "off" / "host" / "device" / "pinned" (INVALID_ARGUMENT naming the values otherwise).
absl::StatusOr<RetainWhere> ParseRetainWhere(absl::string_view text);

struct RetainedCopyOptions {
  RetainWhere where = RetainWhere::kOff;
  // The most bytes one retained version may hold (the sum of its buckets); 0: no bound.
  // With kDevice / kPinned a second version's worth is held while a publication is staged.
  uint64_t max_bytes = 0;
};

// The retained version: immutable once promoted; shared with the replays reading it.
struct RetainedVersion {
  PublicationManifest manifest;  // as published (attempt: the one that committed), checksums in
  std::vector<std::shared_ptr<const Bucket>> buckets;  // kHost: the host buckets
  std::shared_ptr<RetainedBytes> memory;               // kDevice / kPinned: the sealed bytes
  uint64_t bytes = 0;
  absl::Time committed_at = absl::InfinitePast();

  size_t bucket_count() const { return manifest.buckets.size(); }
  // Bucket i for a replay, in index order (kDevice / kPinned: RetainedBytes::Emit).
  absl::StatusOr<std::shared_ptr<const Bucket>> BucketAt(size_t i) const;
  // Bucket i in host memory, any order, any thread (kDevice / kPinned: a copy).
  absl::StatusOr<std::shared_ptr<const Bucket>> HostBucketAt(size_t i) const;
  // OUT_OF_RANGE naming the version unless i < bucket_count().
  absl::Status CheckIndex(size_t i) const;
};

class RetainedCopy final : public Transport {
 public:
  // `memory` holds the bytes for kDevice / kPinned and must then be given (its where() equal
  // to options.where); null otherwise.
  static absl::StatusOr<std::unique_ptr<RetainedCopy>> Create(
      RetainedCopyOptions options, std::shared_ptr<RetainedMemory> memory = nullptr);
  // kOff or kHost only (no memory).
  explicit RetainedCopy(RetainedCopyOptions options) : RetainedCopy(options, nullptr) {}

  // The retained version, or null (nothing committed since start, kOff, or the last committed
  // version was over the bound: Info().reason says which).
  std::shared_ptr<const RetainedVersion> Retained() const;
  RetainedCopyInfo Info() const;
  // The memory publication `version` is being staged into (kDevice / kPinned), for a patch made
  // where the bytes live (RetainedBytes::Patch) or a bucket read back (StagedHostCopy); null
  // when that version is not in flight here. After a failed copy stopped the staging, the
  // memory it staged into, until the publication ends: the buckets copied before stay
  // readable (a pull transport may have taken them without their bytes), later ones never come.
  std::shared_ptr<RetainedBytes> StagingBytes(uint64_t version) const;
  // Whether publication `version` is still being staged into retained memory (every bucket so
  // far copied, the next ones to be).
  bool Staging(uint64_t version) const;
  // Drops the retained version (e.g. the engine's committed version moved on without it).
  void Drop(absl::string_view why);

  // Transport. Begin takes part (one pseudo participant the transport group does not count)
  // unless nothing is retained, the manifest is a replay, the version is over the bound or its
  // memory was refused; Send keeps the bucket's host bytes (kHost: INTERNAL for a device bucket)
  // or stages its copy (kDevice / kPinned: a failed copy stops the staging, logged, and returns
  // OK) -- a bucket out of order or of another size than its manifest says is INTERNAL either
  // way (the producer broke the transport contract: every transport refuses it); WaitAcknowledged
  // has nothing to wait for; Commit promotes a complete staged copy, sealing it (an incomplete one,
  // e.g. over the bound, drops the retained version); Abort drops what was staged.
  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<ReceiverInfo> Receivers() const override { return {}; }

 private:
  RetainedCopy(RetainedCopyOptions options, std::shared_ptr<RetainedMemory> memory);
  // Stops staging this publication: the version, if it commits, is not retained.
  void StopStaging(std::string why);  // mu_ held

  const RetainedCopyOptions options_;
  const std::shared_ptr<RetainedMemory> memory_;  // kDevice / kPinned
  mutable std::mutex mu_;
  bool in_flight_ = false;                        // guarded by mu_
  bool staging_ = false;                          // this publication is kept (within the bound)
  std::string not_staged_;                        // why not (guarded by mu_)
  std::shared_ptr<RetainedBytes> staged_memory_;  // kDevice / kPinned (guarded by mu_)
  // A staging of the publication in flight that stopped: readable, abandoned (guarded by mu_).
  std::shared_ptr<RetainedBytes> stopped_memory_;
  uint32_t staged_count_ = 0;                        // buckets staged (guarded by mu_)
  uint64_t staging_version_ = 0;                     // the version in flight (guarded by mu_)
  std::shared_ptr<RetainedVersion> staged_;          // guarded by mu_
  std::shared_ptr<const RetainedVersion> retained_;  // guarded by mu_
  uint64_t over_bound_ = 0;                          // guarded by mu_
  std::string reason_;                               // guarded by mu_
};

}  // namespace wpub::transport
