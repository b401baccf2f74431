// Internal to wpub-recv's Receiver (receiver.cc: subscriptions and their links;
// receiver_events.cc: the events of one subscription, pulls and acknowledgements;
// receiver_version.cc: the version assembled from the members' parts, staged, applied or
// discarded). Not part of the library's interface.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "clients/recv/receiver.h"
#include "clients/recv/staging.h"
#include "wpub/v1/receivers.grpc.pb.h"

namespace wpub::recv {

namespace pb = ::wpub::v1;

class Receiver::Impl {
 public:
  Impl(ReceiverOptions options, std::shared_ptr<grpc::ChannelCredentials> credentials,
       uint64_t held_at_start, uint64_t adopted);

  ~Impl();

  // One subscription loop per daemon; the first that ends for good (or reaches
  // exit_after_versions) ends the others.
  absl::Status Run();

  void Stop();

  std::shared_ptr<const CommittedModel> committed() const;
  ReceiverStats stats() const;
  uint64_t held_version() const;

 private:
  // One daemon's subscription (a member of a group, or the only daemon).
  struct Link {
    std::string target;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<pb::Receivers::Stub> stub;
    std::unique_ptr<grpc::ClientContext> context;  // guarded by mu_ for Stop's TryCancel
    std::unique_ptr<Pending> pending;              // the link's thread only
    std::string token;  // the link's thread only: the subscription's, from group_info
    int64_t pulled_in_publication = 0;
  };

  // How one subscription ended.
  struct Session {
    absl::Status status;    // OK: exit_after_versions reached, or stopped
    bool accepted = false;  // the daemon accepted it (its group_info arrived)
    bool retry = false;     // subscribe again (within the resubscribe budget)
  };

  absl::Status RunLink(Link& link);

  // Waits for the channel until `deadline`, in slices so Stop is noticed; false when stopped or
  // out of time.
  bool WaitConnected(Link& link, absl::Time deadline);

  bool Stopped() const;

  // One Subscribe stream, from connecting to its end.
  Session Subscribe(Link& link, absl::Time deadline, bool resubscribing);

  void Authorize(grpc::ClientContext* context) const;

  // Forgets the version being assembled and the file staged for it.
  void DiscardAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DiscardAssembly(uint64_t version);

  // Processes one event; true when Run should return (exit_after_versions reached).
  absl::StatusOr<bool> Handle(Link& link, const pb::ReceiverEvent& event);

  // Pulls bucket `index` into the link's pending version; false (after logging) when the pull
  // failed, e.g. because the publication was aborted meanwhile (its abort event follows).
  // *rebuilt_checksum: set when the bucket was rebuilt from a patch, to the checksum the
  // patch's application computed over the whole rebuilt bucket (no need to compute it again).
  absl::StatusOr<bool> Pull(Link& link, uint64_t version, uint32_t index,
                            uint64_t* expected_checksum, uint64_t* received,
                            std::optional<uint64_t>* rebuilt_checksum);
  // Pull's two ways: as a patch against `base` (true: the bucket is in the pending version;
  // false: pull it whole -- the patch did not apply, or the pull failed and is logged) and
  // whole.
  // spare_[index] when it is `nbytes` long (moved out), else an empty buffer.
  std::vector<uint8_t> TakeSpare(uint32_t index, uint64_t nbytes) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> PullPatched(Link& link, uint64_t version, uint32_t index,
                                   const CommittedModel& base, uint64_t* expected_checksum,
                                   uint64_t* received, std::optional<uint64_t>* rebuilt_checksum);
  absl::StatusOr<bool> PullWhole(Link& link, uint64_t version, uint32_t index,
                                 uint64_t* expected_checksum, uint64_t* received);
  // The PullBucket request for bucket `index` of the link's pending `version`.
  pb::PullBucketRequest PullRequest(const Link& link, uint64_t version, uint32_t index,
                                    bool patch) const;

  absl::Status PullAndAck(Link& link, uint64_t version, uint32_t index);

  // The link's version arrived whole and verified: its manifest and buckets join the assembly;
  // when that completes the version (every member's part), the output is staged.
  absl::Status HandOver(Link& link);

  std::vector<SafetensorsEntry> AssemblyEntries() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Writes the assembled version to stage_path_ (fsynced), when there is an output file.
  absl::Status StageOutput() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<bool> OnCommit(Link& link, uint64_t version);

  // Applies the complete assembly (its version committed): publishes its staged file, makes it
  // the committed model.
  absl::Status ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The version this receiver holds staged without knowing its outcome (SubscribeRequest.
  // staged_version): a complete assembly, or a staging file adopted at start; 0 when none.
  uint64_t StagedVersionLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A daemon said what became of the version held staged (`apply`: it committed; otherwise it
  // did not, or a later one committed). `why` for the log.
  absl::Status ResolveStagedLocked(uint64_t version, bool apply, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReceiverOptions options_;
  const std::string stage_path_;  // beside output_path, so the commit is one rename
  // This process's instance, the same at every daemon it subscribes to (SubscribeRequest).
  const std::string instance_;
  const uint64_t held_at_start_;  // the version in output_path's metadata at start
  std::vector<std::unique_ptr<Link>> links_;

  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Assembly> assembly_ ABSL_GUARDED_BY(mu_);
  // A complete version staged by this receiver's previous process (stage_path_ holds it), its
  // outcome not yet known: 0 when none.
  uint64_t adopted_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<CommittedModel> committed_ ABSL_GUARDED_BY(mu_);
  // The buckets of the version before the committed one, when nothing else held it at the
  // commit: a bucket rebuilt from a patch is written into the one of its size (TakeSpare), so a
  // patched version costs no allocation or page faults of its own.
  std::vector<std::vector<uint8_t>> spare_ ABSL_GUARDED_BY(mu_);
  ReceiverStats stats_ ABSL_GUARDED_BY(mu_);
  // stats_.bytes and .patched_buckets at the last commit (the log says what each version cost).
  uint64_t bytes_at_commit_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t patched_at_commit_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wpub::recv
