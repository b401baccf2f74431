// Value types of the transport contract (core/transport/transport.h): what receivers learn
// before the bytes (manifests), the events a pull receiver is sent, and each receiver's state
// and outcome. No protobuf here; the server maps these one to one onto proto/wpub/v1 messages.
// Plain values (copyable, no hidden sharing), therefore thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/time/time.h"
#include "core/common/tensor.h"

namespace wpub::transport {

// ---------------------------------------------------------------------------------------------
// Manifests (what receivers learn before the bytes).
// ---------------------------------------------------------------------------------------------

// One tensor inside a bucket: buf[offset, offset + nbytes) viewed as dtype, reshaped to shape.
struct ManifestTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  friend bool operator==(const ManifestTensor&, const ManifestTensor&) = default;
};

// One bucket in SGLang's flattened-bucket layout; see core/transport/checksum.h for `checksum`.
struct BucketManifest {
  uint32_t index = 0;
  uint64_t nbytes = 0;
  uint64_t checksum = 0;
  std::vector<ManifestTensor> tensors;
  friend bool operator==(const BucketManifest&, const BucketManifest&) = default;
};

struct PublicationManifest {
  uint64_t version = 0;
  // Transfers of this version begun so far, counting this one (1, or more when the engine
  // retries a version; EngineOptions::max_attempts). Receivers echo it in ReadBucket and Ack,
  // so a late acknowledgement of an aborted attempt never counts for the retry.
  uint32_t attempt = 1;
  std::string model_id;
  std::string recipe;
  std::vector<BucketManifest> buckets;
  // A group version (GroupMembership): receivers subscribed to every member apply the version
  // once they hold every member's buckets and one member tells them to commit. 1 and 0 alone.
  std::string group;
  uint32_t group_members = 1;
  uint32_t group_member = 0;
  // Whether this publisher makes the engines' lifecycle calls around its buckets (pause ..
  // begin before the first, version .. continue at commit). False for the members of a group
  // other than the leader: the leader calls them once per engine per version.
  bool engine_lifecycle = true;
  // A replay of the committed version from the retained copy (retained_copy.h): a restore of
  // engines an abort left dirty, or a catch-up of engines and receivers behind. Its version
  // is the committed one; only receivers that do not hold it take part where the transport can
  // choose (pull receivers behind), every engine of a weight-update group where it cannot.
  bool replay = false;
  uint64_t total_bytes() const {
    uint64_t n = 0;
    for (const auto& b : buckets) n += b.nbytes;
    return n;
  }
};

// ---------------------------------------------------------------------------------------------
// Receiver events (the subscription stream of the gRPC-pull transport).
// ---------------------------------------------------------------------------------------------

// What a daemon knows of a version a receiver holds staged without knowing its outcome.
enum class StagedDecision : uint8_t {
  kUnknown,  // this daemon cannot say (another member of a group may)
  kApply,    // it committed here: apply it
  kDiscard,  // it aborted here, or a later version committed: discard it
};

// First event of every subscription.
struct GroupInfoEvent {
  std::string receiver_name;
  std::string transport;           // "pull"
  uint64_t committed_version = 0;  // the engine's current version at subscribe time
  // The subscription's secret: ReadBucket and Ack must present it (PullTransport).
  std::string subscription_token;
  // What the daemon knows of the version the receiver said it holds staged, undecided
  // (PullTransport::Subscribe's staged_version).
  StagedDecision staged = StagedDecision::kUnknown;
  std::string staged_reason;
};
// A publication starts; the receiver will take part in it.
// Buckets are announced before they are packed (the GPU path pipelines packing with the
// transfer), so every BucketManifest::checksum here is 0; the checksum of a bucket arrives with
// its BucketReadyEvent. Names, dtypes, shapes, offsets and sizes are final.
struct ManifestEvent {
  PublicationManifest manifest;
  // The daemon's committed version as this publication begins (decides a version a receiver
  // holds staged and in doubt: equal, it committed; lower, it did not).
  uint64_t committed_version = 0;
  // Non-zero: this receiver may read the buckets as patches against this version, which it
  // holds (Subscription::ReadBucket's `patch`); 0: whole buckets only.
  uint64_t patch_base = 0;
};
// Bucket `index` of `version` can be read (ReadBucket) and must then be acknowledged (Ack)
// with the checksum the receiver computes over the bytes it read.
struct BucketReadyEvent {
  uint64_t version = 0;
  uint32_t attempt = 1;  // PublicationManifest::attempt
  uint32_t index = 0;
  uint64_t nbytes = 0;
  uint64_t checksum = 0;  // the bucket's checksum (also in the Bucket's manifest)
};
// Every receiver acknowledged every bucket: apply `version`.
struct CommitEvent {
  uint64_t version = 0;
};
// Discard everything received for `version`; keep serving the previous version.
struct AbortEvent {
  uint64_t version = 0;
  uint32_t attempt = 1;  // the attempt that was aborted
  std::string reason;
};

using ReceiverEvent =
    std::variant<GroupInfoEvent, ManifestEvent, BucketReadyEvent, CommitEvent, AbortEvent>;

// ---------------------------------------------------------------------------------------------
// Receivers and reports.
// ---------------------------------------------------------------------------------------------

enum class ReceiverState : uint8_t {
  kIdle,       // connected, no publication in flight for it
  kReceiving,  // taking part in the active publication, not every bucket acknowledged yet
  kStaged,     // acknowledged every bucket of the active publication
  kFailed,     // failed the active or last publication (bad checksum, timeout); still connected
  kLeft,       // disconnected (kept in reports only)
  // Received bytes of a version that then aborted, and applies bytes on receipt (SGLang,
  // vLLM): its live weights may be a mix, so it stays paused (serves nothing) until a complete
  // version is applied to it.
  kDirty,
};
// "idle", "receiving", "staged", "failed", "left", "dirty" (the wpub_engines{state} label
// values).
const char* ReceiverStateName(ReceiverState state);

struct ReceiverInfo {
  std::string name;
  ReceiverState state = ReceiverState::kIdle;
  uint64_t last_committed_version = 0;  // last version this receiver was told to commit
  absl::Time connected_at = absl::InfinitePast();
  // The version it holds whole, as far as the transport knows (0: none or unknown): a pull
  // receiver's claim at subscribe raised by every commit, an engine's reported weight version
  // raised by every commit. Below the committed version, the receiver is behind.
  uint64_t held_version = 0;
};

// Why a receiver failed a publication (the wpub_engine_failures_total{reason} label values).
enum class ReceiverFailure : uint8_t {
  kNone,
  kChecksum,      // acknowledged a bucket with a checksum other than the manifest's
  kTimeout,       // did not acknowledge every bucket before the commit deadline
  kDisconnected,  // left (closed its subscription) while the publication was in flight
  kProtocol,      // acknowledged an unknown version/bucket, or its event queue overflowed
};
// "none", "checksum", "timeout", "disconnected", "protocol".
const char* ReceiverFailureName(ReceiverFailure failure);

// How long a rollout engine served nothing in one publication attempt, from the answer to its
// pause to the answer to its resume, and where that time went (seconds, as wpubd saw the
// answers): waiting for wpub (the pause's answer .. the first bucket's update request: the
// engine's own pause and cache flush, its session's begin, and whatever of ingestion and
// quantization was left), the transfer (.. the last update's answer), and the engine's own
// finalization (.. the resume's answer: SGLang's end of session and version, vLLM's finish).
// waiting + transfer + finalization == seconds.
struct PauseWindow {
  bool paused = false;   // the engine answered a pause in this attempt
  bool resumed = false;  // ... and its resume (false: still paused -- dirty -- at the report)
  double seconds = 0;    // pause answer .. resume answer (or .. the report, when not resumed)
  double waiting = 0;
  double transfer = 0;
  double finalization = 0;
};

// Outcome of one receiver in one publication.
struct ReceiverOutcome {
  std::string name;
  // The receiving process's instance (SubscribeRequest.instance; "" for engines and receivers
  // that gave none): with the name, what identifies it across the members of a group.
  std::string instance;
  ReceiverState state = ReceiverState::kIdle;  // kStaged when it acknowledged everything
  bool committed = false;                      // it was told to apply the version
  ReceiverFailure failure = ReceiverFailure::kNone;
  std::string error;  // empty on success
  // The receiver applies bytes on receipt and holds some of a version that has not committed:
  // an abort left it paused and kDirty until a complete version reaches it, or (while the
  // publication is in flight) it would be if the publication ended now.
  bool dirty = false;
  // A rollout engine's family ("sglang", "vllm"); "" for a pull receiver.
  std::string family;
  // A rollout engine's pause window (engines that pause: not a pull receiver).
  PauseWindow pause;
};

// ---------------------------------------------------------------------------------------------
// The retained copy of the committed version (retained_copy.h).
// ---------------------------------------------------------------------------------------------

enum class RetainWhere : uint8_t {
  kOff,     // nothing retained: no restore, no catch-up
  kHost,    // host memory (the host buckets as emitted; the host copy of a device bucket)
  kDevice,  // device memory of the publishing GPU (retained_memory.h; the GPU path)
  kPinned,  // pinned host memory (retained_memory.h; the GPU path)
};
// "off", "host", "device", "pinned".
const char* RetainWhereName(RetainWhere where);

// What status and metrics show of the copy.
struct RetainedCopyInfo {
  RetainWhere where = RetainWhere::kOff;
  uint64_t max_bytes = 0;
  uint64_t version = 0;  // the retained version (0: none)
  uint64_t bytes = 0;    // its bytes
  uint32_t buckets = 0;
  // Memory the copy holds now where it lives (device, pinned): the retained version's buffer,
  // the one a publication stages into (a second version's worth while one is in flight) and the
  // replay's bounce buffers. For kHost, the retained bytes.
  uint64_t held_bytes = 0;
  // Committed versions not retained (over the bound, memory refused, a copy that failed): each
  // dropped the older copy too.
  uint64_t over_bound = 0;
  std::string reason;  // why nothing is retained ("" when a version is)
};

}  // namespace wpub::transport
