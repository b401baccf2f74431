// The transport interface: how packed buckets of one publication reach the receivers, and how
// their acknowledgements come back. Implemented by the gRPC-pull transport (pull_transport.h)
// and, in the GPU path, by the NCCL weight-update group.
//
// Contract (every implementation):
// - One publication at a time: Begin -> Send (bucket 0, 1, ... in index order) ->
//   WaitAcknowledged -> Commit, or Abort at any point. Begin while one is in flight is
//   FAILED_PRECONDITION.
// - The participant set is fixed at Begin: receivers that join later take part in the next
//   publication. A participant that leaves, fails a checksum or misses the deadline fails the
//   publication; the engine then calls Abort, which tells EVERY participant to discard it.
// - Commit is called only after WaitAcknowledged returned OK, i.e. after every participant
//   acknowledged every bucket with the manifest's checksum. Nothing is applied before Commit.
// - Cancellation: Abort may be called from any thread at any time (also concurrently with a
//   blocked Send or WaitAcknowledged, which then return CANCELLED promptly); it is idempotent
//   and a no-op when nothing is in flight. After Abort the transport is ready for Begin.
// - Methods other than Abort are called by one thread (the engine's publication thread).
//   Capabilities, Receivers and Outcomes are thread-safe; capabilities are constant for the
//   transport's lifetime (the transport group reads them once).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/transport/bucket.h"
#include "core/transport/types.h"

namespace wpub::transport {

struct TransportCapabilities {
  std::string name;  // "pull", "nccl"
  // The bucket locations Send takes (bucket.h). A transport that takes host bytes only is
  // handed the host copy of a device bucket (made once per bucket, by the transport group).
  LocationSet accepts = kHostOnly;
  // Receivers read at their own pace: a bucket stays staged (memory held) until the
  // publication ends, so the engine may not reuse its storage before then.
  bool receiver_paced = false;
  // Receivers acknowledge each bucket with its checksum (the engine verifies end to end).
  bool acknowledges_checksums = true;
  // Receivers load each bucket into their live weights as it arrives and cannot roll back
  // (SGLang, vLLM): an abort after any bucket reached one leaves it dirty (ReceiverOutcome::
  // dirty), and the engine retries the version while it still holds the inputs.
  bool applies_on_receipt = false;
  // Largest bucket accepted; 0 = no limit.
  uint64_t max_bucket_bytes = 0;
  // Keeps the buckets it is sent and has no receivers (the retained copy, retained_copy.h):
  // the transport group hands it every bucket of a publication whose Begin named anything, and
  // counts none of its names as participants.
  bool retains = false;
};

struct RetainedVersion;  // retained_copy.h

// What a transport needs to send bucket patches (core/delta/bucket_patch.h, format 3) to its
// receivers (Transport::SetEnginePatches).
struct EnginePatches {
  // The retained committed version patches are made against (null: none). Called at Begin.
  std::function<std::shared_ptr<const RetainedVersion>()> retained;
  // A patch over this fraction of its bucket is not sent: the bucket goes whole.
  double max_patch_fraction = 0.5;
  // After full_every - 1 committed patched publications in a row the next goes whole (so every
  // receiver rebuilds its copy from a whole version that often); 1: never patches; 0: never
  // forced.
  uint32_t full_every = 8;
  // Host threads for a host bucket's diff (delta::DiffBucket: the CPU path).
  int threads = 1;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual TransportCapabilities capabilities() const = 0;

  // Starts publication `manifest.version`, fixes its participants (the receivers connected
  // now) and announces the manifest to them. Returns the participants' names. Non-blocking.
  virtual absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) = 0;

  // Hands over bucket `bucket->manifest.index` (in index order), in a location it accepts.
  // Returns once the transport accepted it: the pull transport stages it and notifies participants
  // (non-blocking); a push transport may block while the previous bucket is on the wire.
  virtual absl::Status Send(std::shared_ptr<const Bucket> bucket) = 0;

  // Whether this transport, which takes host bytes, takes device bucket `bucket` of the
  // publication in flight without them (Bucket::bytes_deferred, the manifest's checksum set):
  // asked by the transport group instead of making the bucket's host copy. False by default.
  virtual bool DefersBytes(const Bucket& /*bucket*/) { return false; }

  // Blocks until every participant acknowledged every bucket with a matching checksum (OK), a
  // participant failed (ABORTED naming the receivers and why), `deadline` passed
  // (DEADLINE_EXCEEDED naming the receivers still missing buckets) or Abort was called
  // (CANCELLED). Outcomes() says which receiver failed how.
  virtual absl::Status WaitAcknowledged(absl::Time deadline) = 0;

  // Tells every participant to apply the version; ends the publication. Non-blocking.
  virtual absl::Status Commit() = 0;
  // The commit of a group version whose leader decided to commit (docs/DESIGN.md, "One decision
  // per version"): the decision is made, so this never refuses. Every participant still there
  // is told to apply the version; one that left after acknowledging everything is not, and its
  // outcome says so (committed false, the reason in its error). Default: Commit().
  virtual absl::Status CommitDecided() { return Commit(); }

  // Tells every participant to discard the publication in flight; ends it. See the contract.
  virtual void Abort(absl::string_view reason) = 0;

  // Per-participant outcome of the publication in flight, or of the last one if none is.
  virtual std::vector<ReceiverOutcome> Outcomes() const = 0;

  // Every connected receiver (participant or not) with its state.
  virtual std::vector<ReceiverInfo> Receivers() const = 0;

  // A publication group (group_vote.h): another member may have sent bytes of the version in
  // flight to these participants (NCCL engines are shared by every member). On the abort that
  // follows, a transport whose receivers apply on receipt treats every participant as dirty
  // (leaves it paused) instead of resuming the ones it sent nothing. Called before that Abort,
  // from any thread; others need not implement it.
  virtual void MarkParticipantsDirty() {}

  // Called with a receiver's name and the version it holds when the transport notices one that
  // holds less than it should outside a publication (it subscribed behind, or an engine came
  // back from a restart): the engine then catches it up from the retained copy. Called from the
  // transport's own threads, without its locks. Set once, before the transport is used; the
  // default notices nothing.
  using BehindListener = std::function<void(const std::string& receiver, uint64_t held)>;
  virtual void SetBehindListener(BehindListener /*listener*/) {}

  // Bucket patches in place of buckets for receivers that take them and hold the retained
  // committed version (EnginePatches; the rollout groups' engines, wpubd --patches). Set once,
  // before the transport is used; the default sends no patches.
  virtual void SetEnginePatches(EnginePatches /*patches*/) {}
};

}  // namespace wpub::transport
