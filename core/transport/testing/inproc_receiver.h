// An in-process receiver of the pull transport for tests and benchmarks: a thread that
// subscribes, reads every announced bucket, verifies and acknowledges it with the checksum it
// computes itself (presenting the token of its GroupInfoEvent), and keeps the last committed
// version's tensors (decoded from the bucket manifests). Fault injection: a wrong checksum, leaving
// mid-publication, never acknowledging. Thread-safe accessors; the receiver thread stops on Stop()
// or destruction.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/transport/pull_transport.h"

namespace wpub::transport::testing {

struct InprocReceiverOptions {
  std::string name = "receiver";
  // Acknowledge with the computed checksum XOR 1 (the engine must reject it).
  bool corrupt_checksum = false;
  // Close the subscription after acknowledging this many buckets of a publication (-1: never).
  int leave_after_buckets = -1;
  // Read buckets but never acknowledge them.
  bool never_ack = false;
  // Keep the committed tensors' bytes (tests); off for benchmarks (checksums only).
  bool keep_tensors = true;
  // The version it says it holds when it subscribes (PullTransport::Subscribe).
  uint64_t held_version = 0;
};

class InprocReceiver {
 public:
  static absl::StatusOr<std::unique_ptr<InprocReceiver>> Start(PullTransport* transport,
                                                               InprocReceiverOptions options);
  ~InprocReceiver();
  void Stop();

  // Blocks until the receiver applied (committed) `version` or discarded it (aborted); true
  // when the outcome was seen before `timeout`.
  bool WaitForOutcome(uint64_t version, absl::Duration timeout);
  // Exact states, for tests where a version is aborted and then retried: true once `version`
  // is the committed one, or once `count` aborts of `version` were seen (or it left).
  bool WaitForCommitted(uint64_t version, absl::Duration timeout);
  bool WaitForAborts(uint64_t version, size_t count, absl::Duration timeout);

  uint64_t committed_version() const;
  std::vector<uint64_t> aborted_versions() const;
  // The tensors of the committed version: name -> bytes (empty unless keep_tensors).
  std::map<std::string, std::vector<uint8_t>> committed_tensors() const;
  std::map<std::string, ManifestTensor> committed_manifest() const;
  // Checksums this receiver computed that differed from the BucketReadyEvent's.
  uint64_t checksum_mismatches() const;
  bool left() const;
  uint64_t bytes_read() const;

 private:
  InprocReceiver(std::unique_ptr<Subscription> sub, InprocReceiverOptions options);
  void Run();

  const InprocReceiverOptions options_;
  std::unique_ptr<Subscription> sub_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool left_ = false;
  uint64_t committed_version_ = 0;
  std::vector<uint64_t> aborted_;
  std::map<std::string, std::vector<uint8_t>> tensors_;
  std::map<std::string, ManifestTensor> manifest_;
  uint64_t mismatches_ = 0;
  uint64_t bytes_read_ = 0;
  std::thread thread_;
};

}  // namespace wpub::transport::testing
