// The gRPC server of wpubd: Publisher + Receivers services over one engine, with health
// checking (grpc.health.v1, so Kubernetes gRPC probes and grpc_health_probe work), server
// reflection (so grpcurl / grpc_cli work), bounded message sizes and an ordered shutdown.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/group/coordinator.h"
#include "server/service/group_service.h"
#include "server/service/publisher_service.h"
#include "server/service/receivers_service.h"
#include "server/service/service_options.h"

namespace wpub::server {

// TLS of the gRPC listener: PEM files, read once at startup.
struct TlsServerOptions {
  // Server certificate chain and private key. Both or neither; when set the listener speaks
  // TLS only.
  std::string cert_file;
  std::string key_file;
  // When set, clients must present a certificate signed by one of these CAs (mutual TLS);
  // a client without one fails the handshake.
  std::string client_ca_file;
  bool enabled() const { return !cert_file.empty(); }
};

struct DaemonServerOptions {
  // "host:port" (port 0 picks a free one; see DaemonServer::port) or "unix:/path".
  std::string listen = "127.0.0.1:50151";
  // A non-loopback address needs TLS or this acknowledgement (logged as a warning at startup):
  // the API moves model weights.
  bool insecure_listen = false;
  TlsServerOptions tls;
  // HTTP/2 streams one client connection may have open at once (bounds a misbehaving client's
  // share of the server; a trainer needs one Publish plus a few unary calls).
  int max_concurrent_streams = 64;
  // Largest message accepted from or sent to a peer. Payload chunks are bounded by
  // service.max_chunk_bytes; this adds room for framing and batch descriptors.
  int max_message_bytes = 8 << 20;
  // Memory gRPC may hold for every connection together (a grpc::ResourceQuota): read buffers,
  // messages being received, HTTP/2 state. gRPC's HTTP/2 transport buffers a whole incoming
  // message before max_message_bytes is compared with its length, so without this bound one
  // client can make the daemon hold any message size it declares; over the quota gRPC cancels
  // the streams that hold the memory (RESOURCE_EXHAUSTED "Buffers full"). Must be at least
  // 4 x max_message_bytes so ordinary traffic never meets it.
  uint64_t grpc_memory_bytes = uint64_t{256} << 20;
  // Threads gRPC may create for RPCs of the sync Publisher service and its pollers (the same
  // ResourceQuota). Past it a new RPC is answered RESOURCE_EXHAUSTED instead of a new thread.
  int grpc_max_threads = 64;
  // HTTP/2 keepalive: the server pings every connection each `keepalive_time` and closes it
  // (cancelling its RPCs: a Publish aborts, a Subscribe ends and frees the receiver's name)
  // when the peer's gRPC library does not answer within `keepalive_timeout`. That is how a
  // half-open connection or a stopped (SIGSTOP, hung) peer is found; a busy peer answers,
  // since its gRPC threads answer pings, so a long publication is never cut by it.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // Clients may send keepalive pings this often at most; a client pinging faster is sent
  // GOAWAY (too_many_pings) after two strikes.
  absl::Duration min_client_ping_interval = absl::Seconds(10);
  // A connection that has not finished its handshake (TCP accept to HTTP/2 settings, TLS
  // included) within this is closed.
  absl::Duration handshake_timeout = absl::Seconds(20);
  ServiceOptions service;
};

// Owns the grpc::Server and its services. Thread-safe: SetServing and Shutdown may be called
// from any thread (Shutdown once).
class DaemonServer {
 public:
  // Builds and starts the server on `options.listen`. `engine` must outlive the DaemonServer.
  // Errors: PERMISSION_DENIED for a non-loopback address without TLS or insecure_listen,
  // INVALID_ARGUMENT for an unreadable or incomplete TLS file set or an option out of range,
  // UNAVAILABLE "cannot listen on '<listen>': <reason>" when the address cannot be bound: a
  // missing Unix-socket directory, an address not on this host, or a port another process
  // (another wpubd) already listens on: SO_REUSEPORT is off, so a second daemon never shares
  // a port with the first. Also UNAVAILABLE when the TLS key does not match its certificate.
  // When service.auth_token is set, server reflection needs the token too (health checking
  // stays open for probes).
  // `coordinator` (may be null: no Group service, members cannot join this daemon) leads the
  // group versions this daemon's trainer opens as member 0; it must outlive the DaemonServer.
  static absl::StatusOr<std::unique_ptr<DaemonServer>> Create(
      const DaemonServerOptions& options, engine::Engine* engine,
      group::Coordinator* coordinator = nullptr);
  ~DaemonServer();

  // The bound TCP port (0 for a unix socket).
  int port() const { return port_; }

  // Sets the overall health status ("" service) and the Publisher's to SERVING / NOT_SERVING.
  void SetServing(bool serving);

  // Stops accepting RPCs; RPCs still running at `deadline` are cancelled. Blocks until every
  // RPC finished.
  void Shutdown(absl::Time deadline);

 private:
  DaemonServer() = default;
  std::unique_ptr<PublisherService> publisher_;
  std::unique_ptr<ReceiversService> receivers_;
  std::unique_ptr<GroupService> group_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace wpub::server
