// Options shared by the gRPC services of wpubd, and the bearer-token check every RPC runs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wpub::server {

struct ServiceOptions {
  // Largest `Chunk.data` a trainer may send, and the chunk size PullBucket streams (a receiver
  // may ask for less). The gRPC message limit is set above this plus framing.
  uint64_t max_chunk_bytes = uint64_t{4} << 20;
  // When non-empty, every RPC must carry `authorization: Bearer <auth_token>` metadata
  // (UNAUTHENTICATED otherwise). Compared in constant time.
  std::string auth_token;
  // Receivers subscribed at once (each holds a stream, its queue of undelivered events and its
  // staged buckets' readers): one more is refused with RESOURCE_EXHAUSTED.
  size_t max_subscriptions = 256;
  // Group.Join streams open at once (each holds no thread, its round's names are bounded by
  // the round): one more is refused with RESOURCE_EXHAUSTED. 0: no bound.
  size_t max_group_streams = 2048;
  // Reports listed by ListReports when the request gives no limit.
  size_t default_report_limit = 16;
  // A Publish stream that sends no message for this long while the daemon waits for one
  // (header included) is cancelled and its publication aborted, so a stalled trainer (stream
  // open, no deadline) cannot hold the one publication slot forever. An idle gap, not a
  // total: a publication of any size keeps going while messages keep arriving; the time the
  // daemon itself spends (queueing behind another publication, staging a batch, committing)
  // does not count.
  absl::Duration ingest_idle_timeout = absl::Minutes(2);
  // Publish NaN/Inf weights for every publication (a header may also ask for it).
  bool allow_non_finite = false;
  // Daemon build version, echoed by GetStatus.
  std::string daemon_version;
};

// An Authorization value that is "Bearer <token>", compared in constant time (the token cannot
// be guessed byte by byte from timings). Every place that checks the daemon's token uses it.
bool BearerMatches(std::string_view authorization, std::string_view token);

// OK when no token is configured or `context` carries the right bearer token.
grpc::Status CheckAuth(const ServiceOptions& options, const grpc::ServerContextBase& context);

// gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/run/x.sock") names a
// process of this host: loopback addresses (127.0.0.0/8, ::1, ::ffff:127.x) and Unix sockets.
bool IsLoopbackPeer(absl::string_view peer);
// A listen address or target of this host: "localhost", 127.0.0.0/8, "[::1]" (each with a
// port) and unix: sockets.
bool IsLoopbackAddress(const std::string& address);

// Who may join a publication group as a member (after CheckAuth): with a token, whoever
// presented it; without one, a peer authenticated by its TLS client certificate (mutual TLS)
// or a process of this host. PERMISSION_DENIED otherwise, naming the peer and what to set: an
// unauthenticated group forms on loopback only.
grpc::Status CheckGroupPeer(const ServiceOptions& options, const grpc::ServerContextBase& context);

}  // namespace wpub::server
