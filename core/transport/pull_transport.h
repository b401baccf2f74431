// The gRPC-pull transport's core half: buckets are staged in host memory and receivers (the
// gRPC server's subscribe/pull handlers, or in-process receivers in tests) fetch them at their
// own pace. The gRPC server maps one Subscribe RPC onto one Subscription: it forwards Next()
// events on the server stream, serves ReadBucket bytes in chunks, forwards Acks, and destroys
// the Subscription when the RPC ends (which counts as the receiver leaving).
//
// Identity: every subscription gets a secret token (256 bits from the kernel's CSPRNG), sent in
// its GroupInfoEvent; ReadBucket and Ack must present it, so a client that merely knows a
// receiver's name can neither pull nor acknowledge for it. Versions: a receiver may say which
// version it holds when it subscribes (e.g. from before a daemon restart); the engine refuses
// to publish a version <= the highest version a connected receiver holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/transport/transport.h"
#include "core/transport/types.h"

namespace wpub::transport {

struct PullTransportOptions {
  // A receiver whose undelivered events exceed this many is dropped (it fails the publication
  // in flight with reason "protocol"). A publication produces buckets + 2 events per receiver.
  size_t max_queued_events = 65536;
  // The largest version a receiver may claim to hold when it subscribes (the largest version
  // a publication may have: EngineOptions::max_version): a claim beyond any version wpub can
  // publish would hold every publication back while the receiver stays connected.
  uint64_t max_version = uint64_t{1} << 53;
};

class PullTransport;
class HubLock;  // pull_hub.h (internal)

// Bucket patches for receivers that hold the committed version (wpubd --patches): the engine
// makes them from the retained copy (core/engine/engine_impl.cc, core/delta/bucket_patch.h).
struct PatchSource {
  // The version patches are made against now (the retained committed version); 0: none.
  // Called at Begin, without the transport's lock.
  std::function<uint64_t()> base_version;
  // The patch that makes bucket `next` of a copy of `base_version`, as a host bucket
  // (Bucket::patch_base set, the manifest the whole bucket's), or null when `next` goes whole
  // (another layout, a patch not worth it, the base gone). Called at most once per bucket of a
  // publication, by the first receiver that reads it, without the transport's lock.
  std::function<std::shared_ptr<const Bucket>(uint64_t base_version, const Bucket& next)> make;
  // Whether the engine keeps the version in flight where a bucket's patch is made and its bytes
  // read whole without the transport's copy (retained memory staging it: device or pinned).
  // When it does and every participant was offered patches, the transport takes the
  // publication's device buckets without their bytes (Transport::DefersBytes): no host copy is
  // made for a patched publication. Asked by DefersBytes for each device bucket, before its Send
  // (the transport group asks once the retained copy staged the bucket), without the lock.
  std::function<bool(uint64_t version)> can_defer;
  // Bucket `next` (deferred: Bucket::bytes_deferred) whole in host memory, from where the
  // engine keeps it, for a receiver that takes it whole (its patch was not worth it, or it asked
  // for the bucket). Called by the transport at most once per bucket, by the first such reader
  // (a participant), without its lock; an error is returned to that reader and every later one.
  // (`make` may read the bucket too, where it diffs host copies.)
  std::function<absl::StatusOr<std::shared_ptr<const Bucket>>(const Bucket& next)> whole;
  // After full_every - 1 committed publications in a row that offered patches, the next goes
  // whole to every receiver (so each rebuilds its copy from a whole version at least that
  // often; aborted attempts and replays do not count); 1: never patches; 0: never forced.
  uint32_t full_every = 0;
};

// Receiver names are 1..kMaxReceiverNameBytes bytes of printable ASCII other than space: they
// appear in logs, reports and metric labels.
inline constexpr size_t kMaxReceiverNameBytes = 128;
inline constexpr size_t kMaxReceiverInstanceBytes = 64;
// INVALID_ARGUMENT naming `field` (and the offending byte, escaped) unless `name` is valid.
absl::Status ValidateReceiverName(absl::string_view name,
                                  absl::string_view field = "receiver_name");

// The highest version a connected receiver holds, and which receiver holds it.
struct HeldVersion {
  std::string receiver;
  uint64_t version = 0;
};

// The push half of a subscription (Subscription::Attach): a server that writes events from
// callbacks takes them as they come instead of a thread blocking in Next for each receiver.
//
// Handoff: the sink is either idle or busy with one item. An item for an idle sink is handed
// to Deliver, which makes the sink busy; a busy sink asks for the next item with
// Subscription::Take once it is done with the last one, and Take leaves it idle when there is
// none -- so at most one item is outstanding and none is lost between the two.
class SubscriptionSink {
 public:
  virtual ~SubscriptionSink() = default;
  // The next event (OK), or how the subscription ended (as Next returns it: CANCELLED,
  // RESOURCE_EXHAUSTED; nothing follows). Runs on the thread that produced the item, after the
  // transport's lock was released (so a conversion or write here holds up no other receiver):
  // it must not block, and must not call Detach.
  virtual void Deliver(absl::StatusOr<ReceiverEvent> item) = 0;
};

// One receiver's connection. Thread-safety: Next is called by one thread at a time, and not
// while a sink is attached; ReadBucket, Ack, Close, Cancel, Attach, Take and Detach may be
// called from any thread, concurrently with Next. Destruction closes it (must not race with a
// call in progress on another thread).
class Subscription {
 public:
  ~Subscription();
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;

  const std::string& name() const { return name_; }

  // The next event, oldest first; the first is always a GroupInfoEvent. Blocks up to `timeout`:
  // DEADLINE_EXCEEDED when none arrived (poll again), CANCELLED after Close/Cancel, or once the
  // transport shut down and every event queued before that was delivered; RESOURCE_EXHAUSTED if
  // the receiver was dropped for falling behind.
  absl::StatusOr<ReceiverEvent> Next(absl::Duration timeout);

  // The bytes of bucket `index` of the publication in flight `version`. `token` must be this
  // subscription's (GroupInfoEvent::subscription_token; compared in constant time):
  // PERMISSION_DENIED naming the receiver otherwise. NOT_FOUND when that bucket is not staged
  // (yet, or the version ended: ABORTED when it was aborted). Non-blocking; the returned bucket
  // stays valid as long as it is held.
  // `attempt` is the ManifestEvent's (PublicationManifest::attempt; 0 is read as 1): for an
  // aborted attempt of the version now in flight again, FAILED_PRECONDITION.
  // `patch`: the receiver asks for the bucket as a patch against the version it holds (its
  // ManifestEvent::patch_base): when this receiver was offered patches and the bucket's patch
  // is worth it, a host bucket whose bytes are the patch (Bucket::patch_base set; made once per
  // bucket, by the first reader, without the transport's lock); the bucket itself otherwise --
  // for a bucket taken without its bytes, read whole from the patch source once per bucket
  // (PatchSource::whole; its error, e.g. UNAVAILABLE, goes to the reader).
  absl::StatusOr<std::shared_ptr<const Bucket>> ReadBucket(absl::string_view token,
                                                           uint64_t version, uint32_t index,
                                                           uint32_t attempt = 1,
                                                           bool patch = false);

  // Acknowledges bucket `index` of `version` with the checksum the receiver computed over the
  // bytes it received. A wrong `token` is PERMISSION_DENIED naming the receiver and changes
  // nothing (checked first). A checksum other than the manifest's fails this receiver (the
  // publication aborts; this call still returns OK, the verdict arrives as an AbortEvent).
  // INVALID_ARGUMENT for a version/bucket not in flight or not a participant. Non-blocking.
  // An acknowledgement of an earlier attempt of the version in flight (`attempt`, as for
  // ReadBucket) is FAILED_PRECONDITION and counts for nothing (no failure either).
  absl::Status Ack(absl::string_view token, uint64_t version, uint32_t index, uint64_t checksum,
                   uint32_t attempt = 1);

  // From now on the events go to `sink` (idle: an item waiting now is delivered from this call)
  // until Detach. `sink` must stay valid until Detach returned.
  void Attach(SubscriptionSink* sink);
  // The attached sink, busy, is done with its item: the next one (an event, or how the
  // subscription ended), or nullopt -- the sink is idle again and the next item is delivered.
  std::optional<absl::StatusOr<ReceiverEvent>> Take();
  // No Deliver runs after this returns (one in progress on another thread is waited for).
  // Idempotent. Not from within Deliver.
  void Detach();

  // Leaves: a publication in flight in which this receiver participates aborts. Wakes Next
  // (or delivers the end to an idle sink). Idempotent.
  void Close();

  // Wakes a blocked Next (returns CANCELLED) without leaving; for server shutdown paths.
  void Cancel();

 private:
  friend class PullTransport;
  friend class HubLock;
  struct Hub;
  Subscription(std::shared_ptr<Hub> hub, std::string name, uint64_t id, std::string token);
  absl::Status CheckToken(absl::string_view token) const;
  absl::Status EndedStatus() const;  // requires hub_->mu

  std::shared_ptr<Hub> hub_;
  std::string name_;
  uint64_t id_;
  std::string token_;
};

// Thread-safe. The engine drives the Transport half; any number of threads may Subscribe.
// Subscriptions may outlive the transport (their calls then fail with CANCELLED).
class PullTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<PullTransport>> Create(const PullTransportOptions& options);
  ~PullTransport() override;

  // Registers receiver `name` (ValidateReceiverName: INVALID_ARGUMENT otherwise; unique among
  // connected receivers: ALREADY_EXISTS otherwise), which holds `held_version` (0: none;
  // INVALID_ARGUMENT naming the receiver above options.max_version). It
  // takes part in the next publication that begins after this call; its GroupInfoEvent carries
  // a fresh subscription token. INTERNAL if the kernel gives no random bytes.
  // `instance`: the receiving process's instance (SubscribeRequest.instance; "" none), printable
  // as names are, at most kMaxReceiverInstanceBytes (INVALID_ARGUMENT otherwise); carried in
  // its outcomes (ReceiverOutcome::instance).
  // `staged_version`: a version it holds staged without knowing its outcome (0: none); its
  // GroupInfoEvent says what this transport told its receivers of that version (kApply when it
  // committed it, kDiscard when it aborted it or it is older than the committed version),
  // kUnknown otherwise (in flight here, or never seen: another member of a group may know).
  // `accepts_patches`: the receiver keeps its committed version and applies bucket patches
  // (SubscribeRequest.accepts_patches): with a PatchSource, a publication that follows the
  // version it holds offers it patches (ManifestEvent::patch_base).
  absl::StatusOr<std::unique_ptr<Subscription>> Subscribe(absl::string_view name,
                                                          uint64_t held_version = 0,
                                                          absl::string_view instance = "",
                                                          uint64_t staged_version = 0,
                                                          bool accepts_patches = false);

  // Offers receivers that accept them patches from `source` (see PatchSource). Once, before
  // publications begin.
  void SetPatchSource(PatchSource source);

  // The highest version a connected receiver holds (what it subscribed with, or the last
  // version it committed here, whichever is higher); nullopt when no receiver holds one.
  std::optional<HeldVersion> HighestHeldVersion() const;
  // FAILED_PRECONDITION naming the receiver and both versions when `version` <=
  // HighestHeldVersion() (publishing it would take that receiver backwards); OK otherwise.
  absl::Status CheckVersionAhead(uint64_t version) const;

  // Transport. Begin also refuses (as CheckVersionAhead) a manifest whose version a receiver
  // that subscribed since the engine's check already holds.
  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest& manifest) override;
  // Send takes a deferred bucket (Bucket::bytes_deferred) only when DefersBytes said so.
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override;
  // True when every participant of the publication in flight was offered patches and the patch
  // source keeps the version (PatchSource::can_defer).
  bool DefersBytes(const Bucket& bucket) override;
  absl::Status WaitAcknowledged(absl::Time deadline) override;
  absl::Status Commit() override;
  absl::Status CommitDecided() override;
  void Abort(absl::string_view reason) override;
  std::vector<ReceiverOutcome> Outcomes() const override;
  std::vector<ReceiverInfo> Receivers() const override;

  // Called (on the subscribing thread, without the transport's lock) for every receiver that
  // subscribes holding less than the committed version (name, the version it holds): the
  // engine catches it up from the retained copy. Set once, before receivers subscribe.
  void SetBehindListener(BehindListener listener) override;

  // The version the transport last committed (announced in GroupInfoEvent). Seeded by the
  // engine at start; advanced by Commit.
  uint64_t committed_version() const;
  void set_committed_version(uint64_t version);

  // Closes every subscription (their Next returns CANCELLED) and aborts anything in flight --
  // or, with `abort_in_flight` false (a group version in doubt here), ends it without telling
  // the receivers anything: they hold it and learn the decision from another member.
  void Shutdown(bool abort_in_flight = true);

 private:
  explicit PullTransport(std::shared_ptr<Subscription::Hub> hub);
  // Subscribe under the transport's lock; *behind: the listener to call once it is released.
  absl::StatusOr<std::unique_ptr<Subscription>> SubscribeLocked(
      absl::string_view name, uint64_t held_version, absl::string_view instance,
      uint64_t staged_version, bool accepts_patches, std::string token,
      std::function<void(const std::string&, uint64_t)>* behind);
  std::shared_ptr<Subscription::Hub> hub_;
};

}  // namespace wpub::transport
