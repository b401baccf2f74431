// Fuzz target `tcp_store`: the TCPStore protocol server (core/rendezvous) as engines reach it,
// over loopback sockets. The input is a list of segments, each [connection byte][length byte]
// [that many bytes]: the bytes go to connection (byte % 3) of three clients, so requests of
// one client can wake another's WAIT. Every client reads what the server answers while the
// segments are sent (the server must never stall on a client that reads), then half-closes;
// the server must close every connection. Afterwards a well-formed client (TcpStoreClient, as
// torch connects) must still get answers: SET, GET, ADD, PING. A fresh server per input keeps
// every run independent of the ones before.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/rendezvous/tcp_store_client.h"
#include "core/rendezvous/tcp_store_server.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using wpub::rendezvous::TcpStoreServer;

constexpr int kClients = 3;
// How long the server has to answer and close once every client half-closed.
constexpr absl::Duration kServerDeadline = absl::Seconds(10);

int Connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  FUZZ_CHECK(fd >= 0, "socket failed");
  // Reset instead of TIME_WAIT on close: a long run makes millions of connections.
  const linger no_linger{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &no_linger, sizeof(no_linger));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  FUZZ_CHECK(rc == 0 || errno == EINPROGRESS, absl::StrCat("connect: ", std::strerror(errno)));
  pollfd p{fd, POLLOUT, 0};
  FUZZ_CHECK(::poll(&p, 1, 10000) == 1, "connect did not complete");
  return fd;
}

struct Client {
  int fd = -1;
  std::vector<uint8_t> out;  // bytes still to send
  size_t sent = 0;
  bool write_closed = false;
  bool eof = false;
};

// Reads what is there (discarding it) and sends what the socket takes, without blocking.
void Pump(Client& c, bool finishing) {
  uint8_t buf[1 << 14];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.eof = true;
    break;
  }
  while (!c.eof && c.sent < c.out.size()) {
    const ssize_t n =
        ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c.eof = true;
      break;
    }
    c.sent += static_cast<size_t>(n);
  }
  if (finishing && !c.write_closed && (c.eof || c.sent == c.out.size())) {
    ::shutdown(c.fd, SHUT_WR);
    c.write_closed = true;
  }
}

// Sends every client's bytes and waits until the server closed every connection.
void Exchange(std::array<Client, kClients>& clients) {
  const absl::Time deadline = absl::Now() + kServerDeadline;
  for (;;) {
    bool all_closed = true;
    std::vector<pollfd> fds;
    for (Client& c : clients) {
      Pump(c, /*finishing=*/true);
      if (!c.eof) {
        all_closed = false;
        fds.push_back(
            {c.fd, static_cast<short>(POLLIN | (c.sent < c.out.size() ? POLLOUT : 0)), 0});
      }
    }
    if (all_closed) return;
    FUZZ_CHECK(absl::Now() < deadline, "the server kept a half-closed connection open");
    ::poll(fds.data(), fds.size(), 100);
  }
}

// A client speaking the protocol as torch does must be served.
void CheckStillServing(uint16_t port) {
  wpub::rendezvous::TcpStoreClientOptions o;
  o.port = port;
  o.timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<wpub::rendezvous::TcpStoreClient>> c =
      wpub::rendezvous::TcpStoreClient::Connect(o);
  FUZZ_CHECK(c.ok(), c.status().ToString());
  const std::vector<uint8_t> value = {'o', 'k'};
  absl::Status s = (*c)->Set("fuzz/check", value);
  FUZZ_CHECK(s.ok(), s.ToString());
  absl::StatusOr<std::vector<uint8_t>> got = (*c)->Get("fuzz/check");
  FUZZ_CHECK(got.ok() && *got == value, got.status().ToString());
  absl::StatusOr<int64_t> added = (*c)->Add("fuzz/counter", 2);
  FUZZ_CHECK(added.ok() && *added == 2, added.status().ToString());
  absl::StatusOr<uint32_t> pong = (*c)->Ping(0x1234);
  FUZZ_CHECK(pong.ok() && *pong == 0x1234, pong.status().ToString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  wpub::rendezvous::TcpStoreServerOptions options;
  options.bind_address = "127.0.0.1";
  options.max_item_bytes = 1 << 16;
  options.send_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Create(options);
  FUZZ_CHECK(server.ok(), server.status().ToString());
  const uint16_t port = (*server)->port();

  std::array<Client, kClients> clients;
  for (Client& c : clients) c.fd = Connect(port);
  // Segments in input order; each is pumped at once so that requests interleave across clients.
  size_t i = 0;
  while (i + 2 <= size) {
    Client& c = clients[data[i] % kClients];
    const size_t len = std::min<size_t>(data[i + 1], size - i - 2);
    c.out.insert(c.out.end(), data + i + 2, data + i + 2 + len);
    i += 2 + len;
    Pump(c, /*finishing=*/false);
  }
  Exchange(clients);
  for (Client& c : clients) ::close(c.fd);
  CheckStillServing(port);
  return 0;
}
