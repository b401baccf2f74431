// A PyTorch-TCPStore-protocol server (see tcp_store_protocol.h and docs/specs/engines.md):
// rank 0 of a weight-update group hosts it so that SGLang engines (torch.distributed
// `rendezvous("tcp://addr:port")` + PrefixStore + ProcessGroupNCCL) and wpub-recv can join
// without PyTorch on the publisher side. The publisher puts the ncclUniqueId under the key
// ProcessGroupNCCL reads (UniqueIdKey) with Set().
//
// Thread-safety: every public method may be called from any thread. One background thread
// serves all connections (poll); requests of one connection are answered in order, WAIT
// replies are sent when the awaited keys appear (by a client SET/ADD/... or a local Set/Add).
// Replies are written with a send timeout so that a client that stops reading cannot stall
// the server. A malformed request (unknown query type, a GET of a missing key, an oversized
// string, a wrong validation magic) closes that connection only, as torch's server does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wpub::rendezvous {

struct TcpStoreServerOptions {
  // Engines connect from other hosts, so the default listens on every interface.
  std::string bind_address = "0.0.0.0";
  uint16_t port = 0;  // 0: an ephemeral port (port() says which)
  int backlog = 128;
  size_t max_connections = 4096;
  uint64_t max_item_bytes = uint64_t{64} << 20;  // longest key or value accepted
  absl::Duration send_timeout = absl::Seconds(10);
};

struct TcpStoreServerStats {
  uint64_t connections_accepted = 0;
  uint64_t connections_open = 0;
  uint64_t requests = 0;
  uint64_t protocol_errors = 0;  // connections closed because of a malformed request
};

class TcpStoreServer {
 public:
  // Binds and starts serving. INVALID_ARGUMENT for a bad bind address, UNAVAILABLE when the
  // port is taken (the message names address and port).
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Create(
      const TcpStoreServerOptions& options);
  // Stops the thread and closes every connection (clients see EOF). Blocks briefly.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }

  // Local store access (no socket round trip). Set wakes clients waiting on `key`.
  void Set(const std::string& key, std::vector<uint8_t> value);
  std::optional<std::vector<uint8_t>> Get(const std::string& key) const;
  // As a client ADD: the value is kept as ASCII decimal; returns the new value.
  // INVALID_ARGUMENT (the value unchanged) when the existing value is not a decimal integer or
  // the sum overflows int64; a client's ADD closes its connection in both cases.
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta);
  bool Delete(const std::string& key);
  size_t NumKeys() const;
  TcpStoreServerStats stats() const;
  // The most recent distinct keys clients waited for or read (WAIT, GET, CHECK), oldest first,
  // at most 32: what to compare with the unique-id key when a peer never joins.
  std::vector<std::string> RecentlyAwaitedKeys() const;

 private:
  class Impl;
  TcpStoreServer(std::unique_ptr<Impl> impl, uint16_t port);
  std::unique_ptr<Impl> impl_;
  uint16_t port_;
};

// The key under which ProcessGroupNCCL reads the ncclUniqueId of communicator number
// `comm_index` (0 for the first collective of a group). `key_template` holds `{group}` (the
// group name, any number of times) and `{index}`; the default reproduces torch 2.11 with
// SGLang's PrefixStore(group_name): "/g/g//cuda//0" for group "g". INVALID_ARGUMENT when the
// template lacks `{group}`.
inline constexpr absl::string_view kDefaultUniqueIdKeyTemplate = "/{group}/{group}//cuda//{index}";
absl::StatusOr<std::string> UniqueIdKey(absl::string_view key_template, absl::string_view group,
                                        int comm_index = 0);

}  // namespace wpub::rendezvous
