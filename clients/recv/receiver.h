// The native receiver of the gRPC-pull transport (the library behind wpub-recv): subscribes to
// a wpubd (or to every member of a publication group, ReceiverOptions::targets), pulls every bucket
// of a publication in chunks, verifies each bucket's checksum (core/transport/checksum.h),
// acknowledges it, keeps the last committed version in memory, discards a publication on abort, and
// optionally writes each committed version as a safetensors file. Runs in its own process
// (wpub-recv) or in-process in tests.
//
// What it promises the daemon: it acknowledges the last bucket of a version only once it can
// apply that version (with an output file: the file is staged next to it and fsynced; if that
// fails it leaves without acknowledging, so the publication aborts instead of committing to a
// receiver that cannot apply it). It presents its subscription's token with every pull and
// acknowledgement, and tells the daemon which version it holds when it (re)subscribes, so a
// restarted daemon cannot take it backwards.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/engine/types.h"
#include "wire/tls.h"

namespace grpc {
class ClientContext;
}

namespace wpub::recv {

struct ReceiverOptions {
  std::string target = "127.0.0.1:50151";  // the daemon's gRPC address
  // A publication group (several daemons publish one version): every member's address. The
  // receiver subscribes to each (under the same name), and applies a version once it holds
  // every member's buckets, verified, and one member tells it to commit; an abort from any
  // member discards the version. Overrides `target` when not empty.
  std::vector<std::string> targets;
  std::string name = "recv-0";  // unique among the daemon's receivers
  std::string auth_token;       // sent as a bearer token when non-empty
  uint64_t chunk_bytes = 0;     // PullBucket chunk size; 0 = the daemon's limit
  // When non-empty, every committed version is written here (atomically) as safetensors, with
  // __metadata__ {version, model_id, recipe}. Create checks that files can be created in its
  // directory; a version found in an existing file's metadata is the version it holds at start.
  std::string output_path;
  // Run returns OK after this many commits; 0 = until Stop or the stream ends.
  uint64_t exit_after_versions = 0;
  // How long Run waits for the daemon to accept the subscription.
  absl::Duration connect_timeout = absl::Seconds(10);
  // When the daemon goes away after the subscription was accepted (restart, crash, network),
  // how long Run keeps trying to subscribe again (discarding a publication in flight; holding
  // the last committed version). Zero: Run returns the error at once.
  absl::Duration resubscribe_timeout = absl::Minutes(5);
  // Fault injection for tests: after pulling this many buckets of a publication, leave
  // (end the subscription) before acknowledging more. -1 = never.
  int64_t leave_after_buckets = -1;
  // Fault injection for tests: flip one byte of bucket `corrupt_bucket` of every publication
  // after pulling it (its checksum then mismatches). -1 = never.
  int64_t corrupt_bucket = -1;
  wire::ClientTls tls;  // plaintext unless tls.ca_file is set
  // Accept bucket patches (SubscribeRequest.accepts_patches): a publication that follows the
  // committed version this receiver holds in memory may then send only the 16-bit units of
  // each bucket that changed; the receiver rebuilds the bucket from its copy and verifies it
  // against the whole bucket's checksum (a patch that does not apply is pulled again whole). It
  // keeps the buckets of the version before last between publications, to build the next one
  // in (the peak while a version arrives is unchanged).
  bool patches = true;
  // Threads that rebuild a bucket from a patch (the copy of the base, the result's checksum;
  // the base's when the one verified at its arrival is not known); <= 0: the hardware's.
  int patch_threads = 8;
};

// The last committed version: the buckets as received and their manifest.
struct CommittedModel {
  transport::PublicationManifest manifest;
  std::vector<std::vector<uint8_t>> buckets;  // indexed by bucket index
  // Each bucket's checksum as verified when it arrived (the manifest's may be 0: announced
  // before packing); what a patch's base checksum is compared with.
  std::vector<uint64_t> checksums;

  // The bytes of tensor `name`, or an empty span when absent.
  absl::Span<const uint8_t> TensorBytes(const std::string& name) const;
  // Every tensor of the manifest, in bucket then offset order.
  std::vector<const transport::ManifestTensor*> Tensors() const;
};

struct ReceiverStats {
  uint64_t commits = 0;
  uint64_t aborts = 0;
  uint64_t buckets = 0;
  uint64_t bytes = 0;
  uint64_t checksum_mismatches = 0;
  uint64_t patched_buckets = 0;  // buckets rebuilt from a patch (bytes counts the patch's)
  // Where patched buckets' time went: pulling the patches (request to last chunk, the daemon's
  // diff included) and rebuilding the buckets from them (copy, patch, checksum).
  double patch_pull_seconds = 0;
  double patch_rebuild_seconds = 0;
  uint64_t last_committed_version = 0;
  uint64_t subscriptions = 0;  // accepted subscriptions (1 + resubscriptions)
};

// Thread-safety: Run on one thread; Stop, committed and stats from any thread.
class Receiver {
 public:
  // INVALID_ARGUMENT for an empty name or target; FAILED_PRECONDITION naming the path when
  // output_path is a directory or no file can be created beside it.
  static absl::StatusOr<std::unique_ptr<Receiver>> Create(const ReceiverOptions& options);
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Blocks: subscribes and processes events. Returns OK after exit_after_versions commits or
  // after Stop; ABORTED when leave_after_buckets made it leave; FAILED_PRECONDITION / INTERNAL
  // naming the path when a version could not be staged (it left without acknowledging);
  // otherwise the error that ended the subscription (UNAVAILABLE when the daemon stayed away
  // past resubscribe_timeout, ALREADY_EXISTS for a taken name at the first subscription).
  absl::Status Run();

  // Ends Run promptly (cancels the subscription). Idempotent.
  void Stop();

  // The last committed version (null before the first commit). The snapshot stays valid while
  // held, independent of later publications.
  std::shared_ptr<const CommittedModel> committed() const;
  ReceiverStats stats() const;
  // The version it tells the daemon it holds: the last committed one, or at start the version
  // in output_path's metadata (0: none).
  uint64_t held_version() const;

 private:
  class Impl;
  explicit Receiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The committed model as safetensors entries (borrowing its bytes), in manifest order.
absl::Status WriteCommittedSafetensors(const CommittedModel& model, const std::string& path);

}  // namespace wpub::recv
