// A receiving engine (one or several GPUs) that speaks SGLang's weight-update HTTP routes (what the
// publisher's SGLang driver calls) over a GroupMember: the NCCL data path of a C++ receiver such as
// wpub-recv, so a publisher can push to it exactly as to an SGLang engine. Each flattened
// bucket is received into device memory with one broadcast and handed to the callback with its
// tensors decoded from the request (names, dtypes, shapes, back to back): copied back to the host
// with its checksum computed there (copy_to_host), or checksummed on the device with the same
// kernel the publisher uses and not copied (a receiver that only verifies, e.g. in benchmarks).
//
// Threading: the HTTP server runs on its own threads; weight-update requests are decoded
// concurrently but received one at a time (as SGLang does), and the callbacks run on that
// handler thread. A request that carries `wpub_sequence` (a publisher with several update
// requests in flight per engine, rollout::SglangDriverOptions::requests_in_flight) waits for
// its turn: sequence 0 starts a publication, k + 1 is received after k (NCCL matches broadcasts
// by order); a group joined or destroyed meanwhile ends the waiters with ABORTED, and a request
// naming another group is refused. Receives never block in CUDA: they poll the stream, the
// communicator's error and receive_timeout; a failure on any rank aborts the engine's members
// and leaves the group, and joining or destroying a group first aborts a receive still blocked
// on the old one. With device checksums the receive path is pipelined two deep: a bucket's
// receives are posted under the lock, its checksum is computed on a second stream and awaited
// without the lock, so the next bucket's receive is posted right behind it (each rank has two
// bucket buffers); callbacks may then run out of order, the version stats keep bucket order. Public
// methods are thread-safe. Destruction stops the server and aborts the group.
//
// Besides SGLang's routes it serves GET /stats: {"<version>": {"buckets": n, "bytes": b,
// "checksums": [...], "decode_seconds": .., "wait_seconds": .., "receive_seconds": ..,
// "receive_device_seconds": .., "last_verified_ns": ..}} (ReceiverVersionStats; checksums:
// core/transport/checksum.h).
//
// Pieces: receiver_endpoint.cc the HTTP routes; bucket_receiver.h the receive path (group,
// request order, both receive modes, stats); device_rank.h one GPU's slots, streams and
// checksums.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/types.h"

namespace wpub::recv::nccl {

struct ReceiverEndpointOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port (port() says which)
  // The engine's GPUs, one group rank each (rank_offset + i, as the TP ranks of an SGLang
  // engine join): every bucket is received on every device, and their checksums must agree.
  std::vector<int> devices = {0};
  absl::Duration join_timeout = absl::Seconds(120);
  // A bucket's broadcast must complete within this (also a request's wait for its turn); the
  // receive is then abandoned, the group aborted and left (the publisher re-forms it).
  absl::Duration receive_timeout = absl::Seconds(120);
  // true: ReceivedBucket::bytes holds the bucket (one device-to-host copy per bucket). false:
  // bytes stays empty and only the checksum (computed on the device, 8 bytes read back) arrives.
  bool copy_to_host = true;
  // The engine keeps every bucket it receives on each GPU, as an engine keeps its weights, and
  // takes bucket patches (format 3, "wpub_patch" update requests, wpub_sequence required)
  // against them: its server info lists "wpub_bucket_patches": [3], and GET /get_model_info
  // reports the version they hold as SGLang does ("weight_version"). Takes precedence over
  // copy_to_host (bytes stay empty).
  bool keep_weights = false;
  int nccl_ctas = 0;  // NcclCommOptions::ctas of every rank (0: NCCL's choice)
};

struct ReceivedBucket {
  std::string version;  // the request's weight_version
  uint32_t index = 0;   // position within the version
  std::vector<transport::ManifestTensor> tensors;
  uint64_t nbytes = 0;         // the bucket's size
  std::vector<uint8_t> bytes;  // empty unless ReceiverEndpointOptions::copy_to_host
  uint64_t checksum = 0;       // core/transport/checksum.h over the bucket's bytes
};

struct ReceiverVersionStats {
  uint64_t buckets = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> checksums;
  // Sums over the version's buckets (wall clock): decoding the requests, waiting for the
  // receive lock and the request's turn, and from posting the receives to the checksums.
  double decode_seconds = 0;
  double wait_seconds = 0;
  double receive_seconds = 0;
  // With device checksums: the receive kernels' device time on the first GPU (CUDA events),
  // including any wait for the publisher's broadcast to start.
  double receive_device_seconds = 0;
  // When the version's latest bucket so far was verified (its checksum read on the host):
  // std::chrono::steady_clock nanoseconds, which on Linux (CLOCK_MONOTONIC) compare across the
  // processes of one host, e.g. with the publisher's end of its transfers.
  int64_t last_verified_ns = 0;
  // With keep_weights: the buckets that came as patches, and the patches' bytes.
  uint64_t patched_buckets = 0;
  uint64_t patch_bytes = 0;
};

class ReceiverEndpoint {
 public:
  struct Callbacks {
    std::function<void(const ReceivedBucket&)> on_bucket;  // may be empty
    std::function<void(const std::string&)> on_version;    // /update_weight_version
  };
  // Binds and serves. UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<ReceiverEndpoint>> Start(
      const ReceiverEndpointOptions& options, Callbacks callbacks);
  ~ReceiverEndpoint();
  ReceiverEndpoint(const ReceiverEndpoint&) = delete;
  ReceiverEndpoint& operator=(const ReceiverEndpoint&) = delete;

  int port() const;
  std::map<std::string, ReceiverVersionStats> stats() const;

 private:
  class Impl;
  explicit ReceiverEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wpub::recv::nccl
