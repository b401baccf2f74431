// A PyTorch-TCPStore-protocol client: what torch's TCPStore(is_master=False) sends, so that a
// C++ receiver (wpub-recv) can join a weight-update group through the same rendezvous as an
// SGLang engine, and so tests can speak to the server exactly as torch does. Keys are sent as
// given (torch's TCPStore prepends "/" to user keys itself; UniqueIdKey already includes it).
//
// Thread-compatible: one request at a time per client (use one client per thread). Every call
// blocks until the reply arrives or the client's timeout passes (DEADLINE_EXCEEDED; a timed-out
// WAIT is cancelled with CANCEL_WAIT as torch does). A closed connection is UNAVAILABLE.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wpub::rendezvous {

struct TcpStoreClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  absl::Duration timeout = absl::Seconds(30);  // connect (with retries) and every request
  // Connect's handshake as torch's client: VALIDATE, PING, then ADD "init/" 1 (numWorkers set).
  bool announce_worker = true;
};

class TcpStoreClient {
 public:
  // Connects (retrying until the timeout, as torch does while rank 0 starts), validates and
  // pings. UNAVAILABLE / DEADLINE_EXCEEDED naming host:port.
  static absl::StatusOr<std::unique_ptr<TcpStoreClient>> Connect(
      const TcpStoreClientOptions& options);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  absl::Status Set(const std::string& key, const std::vector<uint8_t>& value);
  // torch's get(): WAIT for the key (up to the timeout), then GET.
  absl::StatusOr<std::vector<uint8_t>> Get(const std::string& key);
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta);
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys);
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout);
  absl::StatusOr<std::vector<uint8_t>> CompareSet(const std::string& key,
                                                  const std::vector<uint8_t>& expected,
                                                  const std::vector<uint8_t>& desired);
  absl::Status Append(const std::string& key, const std::vector<uint8_t>& value);
  absl::StatusOr<std::vector<std::vector<uint8_t>>> MultiGet(const std::vector<std::string>& keys);
  absl::Status MultiSet(const std::vector<std::string>& keys,
                        const std::vector<std::vector<uint8_t>>& values);
  absl::StatusOr<int64_t> NumKeys();
  absl::StatusOr<bool> DeleteKey(const std::string& key);
  absl::StatusOr<uint32_t> Ping(uint32_t nonce);

  // Sends raw bytes (tests of the server's handling of malformed requests).
  absl::Status SendRaw(const std::vector<uint8_t>& bytes);
  // True when the server closed the connection (a read sees EOF within `within`).
  bool PeerClosed(absl::Duration within);

 private:
  TcpStoreClient(int fd, TcpStoreClientOptions options);
  absl::Status Send(const std::vector<uint8_t>& bytes);
  absl::Status Recv(void* out, size_t n, absl::Time deadline);
  absl::StatusOr<std::vector<uint8_t>> RecvVector(absl::Time deadline);
  template <typename T>
  absl::StatusOr<T> RecvValue(absl::Time deadline) {
    T v{};
    absl::Status s = Recv(&v, sizeof(T), deadline);
    if (!s.ok()) return s;
    return v;
  }
  int fd_;
  TcpStoreClientOptions options_;
};

}  // namespace wpub::rendezvous
