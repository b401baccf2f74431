// TCPStore client over a blocking TCP socket; reads poll() against a per-request deadline.
#include "core/rendezvous/tcp_store_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/rendezvous/tcp_store_protocol.h"

namespace wpub::rendezvous {
namespace {

int ConnectOnce(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

std::vector<uint8_t> Request(QueryType t) {
  WireWriter w;
  w.Value(t);
  return std::move(w.bytes());
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(
    const TcpStoreClientOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  int fd = -1;
  while ((fd = ConnectOnce(options.host, options.port)) < 0) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("TCPStore ", options.host, ":", options.port,
                                                      " did not accept within ",
                                                      absl::FormatDuration(options.timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::unique_ptr<TcpStoreClient> c(new TcpStoreClient(fd, options));
  WireWriter w;
  w.Value(QueryType::kValidate).Value(kValidationMagic);
  WPUB_RETURN_IF_ERROR(c->Send(w.bytes()));
  const uint32_t nonce = static_cast<uint32_t>(::getpid());
  WPUB_ASSIGN_OR_RETURN(uint32_t echoed, c->Ping(nonce));
  if (echoed != nonce) {
    return absl::DataLossError(absl::StrCat("TCPStore ", options.host, ":", options.port,
                                            " echoed ping ", echoed, " for ", nonce));
  }
  if (options.announce_worker) WPUB_RETURN_IF_ERROR(c->Add("init/", 1).status());
  return c;
}

TcpStoreClient::TcpStoreClient(int fd, TcpStoreClientOptions options)
    : fd_(fd), options_(std::move(options)) {}
TcpStoreClient::~TcpStoreClient() { ::close(fd_); }

absl::Status TcpStoreClient::Send(const std::vector<uint8_t>& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::UnavailableError(absl::StrCat("TCPStore ", options_.host, ":", options_.port,
                                                 ": send failed: ", std::strerror(errno)));
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status TcpStoreClient::SendRaw(const std::vector<uint8_t>& bytes) { return Send(bytes); }

absl::Status TcpStoreClient::Recv(void* out, size_t n, absl::Time deadline) {
  auto* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("TCPStore ", options_.host, ":", options_.port, ": no reply in time"));
    }
    const ssize_t k = ::recv(fd_, p + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      return absl::UnavailableError(absl::StrCat("TCPStore ", options_.host, ":", options_.port,
                                                 ": connection closed by the server"));
    }
    got += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> TcpStoreClient::RecvVector(absl::Time deadline) {
  WPUB_ASSIGN_OR_RETURN(uint64_t n, RecvValue<uint64_t>(deadline));
  std::vector<uint8_t> v(n);
  if (n) WPUB_RETURN_IF_ERROR(Recv(v.data(), n, deadline));
  return v;
}

bool TcpStoreClient::PeerClosed(absl::Duration within) {
  uint8_t b;
  const absl::Status s = Recv(&b, 1, absl::Now() + within);
  return absl::IsUnavailable(s);
}

absl::Status TcpStoreClient::Set(const std::string& key, const std::vector<uint8_t>& value) {
  WireWriter w;
  w.Value(QueryType::kSet).String(key).Vector(value);
  return Send(w.bytes());
}

absl::Status TcpStoreClient::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  WireWriter w;
  w.Value(QueryType::kWait).Value<uint64_t>(keys.size());
  for (const auto& k : keys) w.String(k);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  auto r = RecvValue<WaitResponse>(absl::Now() + timeout);
  if (r.ok()) {
    if (*r != WaitResponse::kStopWaiting) {
      return absl::DataLossError("TCPStore: unexpected WAIT reply");
    }
    return absl::OkStatus();
  }
  if (!absl::IsDeadlineExceeded(r.status())) return r.status();
  // Cancel as torch does; the server answers WAIT_CANCELED (or STOP_WAITING if the key
  // appeared meanwhile, followed by WAIT_CANCELED).
  WPUB_RETURN_IF_ERROR(Send(Request(QueryType::kCancelWait)));
  const absl::Time d = absl::Now() + options_.timeout;
  for (;;) {
    WPUB_ASSIGN_OR_RETURN(WaitResponse c, RecvValue<WaitResponse>(d));
    if (c == WaitResponse::kWaitCanceled) break;
  }
  return absl::DeadlineExceededError(absl::StrCat("TCPStore: keys not set within ",
                                                  absl::FormatDuration(timeout),
                                                  " (first: ", keys.empty() ? "" : keys[0], ")"));
}

absl::StatusOr<std::vector<uint8_t>> TcpStoreClient::Get(const std::string& key) {
  WPUB_RETURN_IF_ERROR(Wait({key}, options_.timeout));
  WireWriter w;
  w.Value(QueryType::kGet).String(key);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  return RecvVector(absl::Now() + options_.timeout);
}

absl::StatusOr<int64_t> TcpStoreClient::Add(const std::string& key, int64_t delta) {
  WireWriter w;
  w.Value(QueryType::kAdd).String(key).Value(delta);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  return RecvValue<int64_t>(absl::Now() + options_.timeout);
}

absl::StatusOr<bool> TcpStoreClient::Check(const std::vector<std::string>& keys) {
  WireWriter w;
  w.Value(QueryType::kCheck).Value<uint64_t>(keys.size());
  for (const auto& k : keys) w.String(k);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  WPUB_ASSIGN_OR_RETURN(CheckResponse r, RecvValue<CheckResponse>(absl::Now() + options_.timeout));
  return r == CheckResponse::kReady;
}

absl::StatusOr<std::vector<uint8_t>> TcpStoreClient::CompareSet(
    const std::string& key, const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  WireWriter w;
  w.Value(QueryType::kCompareSet).String(key).Vector(expected).Vector(desired);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  return RecvVector(absl::Now() + options_.timeout);
}

absl::Status TcpStoreClient::Append(const std::string& key, const std::vector<uint8_t>& value) {
  WireWriter w;
  w.Value(QueryType::kAppend).String(key).Vector(value);
  return Send(w.bytes());
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> TcpStoreClient::MultiGet(
    const std::vector<std::string>& keys) {
  WireWriter w;
  w.Value(QueryType::kMultiGet).Value<uint64_t>(keys.size());
  for (const auto& k : keys) w.String(k);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  std::vector<std::vector<uint8_t>> out;
  const absl::Time d = absl::Now() + options_.timeout;
  for (size_t i = 0; i < keys.size(); ++i) {
    WPUB_ASSIGN_OR_RETURN(auto v, RecvVector(d));
    out.push_back(std::move(v));
  }
  return out;
}

absl::Status TcpStoreClient::MultiSet(const std::vector<std::string>& keys,
                                      const std::vector<std::vector<uint8_t>>& values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError("MultiSet: keys and values differ in length");
  }
  WireWriter w;
  w.Value(QueryType::kMultiSet).Value<uint64_t>(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) w.String(keys[i]).Vector(values[i]);
  return Send(w.bytes());
}

absl::StatusOr<int64_t> TcpStoreClient::NumKeys() {
  WPUB_RETURN_IF_ERROR(Send(Request(QueryType::kGetNumKeys)));
  return RecvValue<int64_t>(absl::Now() + options_.timeout);
}

absl::StatusOr<bool> TcpStoreClient::DeleteKey(const std::string& key) {
  WireWriter w;
  w.Value(QueryType::kDeleteKey).String(key);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  WPUB_ASSIGN_OR_RETURN(int64_t n, RecvValue<int64_t>(absl::Now() + options_.timeout));
  return n > 0;
}

absl::StatusOr<uint32_t> TcpStoreClient::Ping(uint32_t nonce) {
  WireWriter w;
  w.Value(QueryType::kPing).Value(nonce);
  WPUB_RETURN_IF_ERROR(Send(w.bytes()));
  return RecvValue<uint32_t>(absl::Now() + options_.timeout);
}

}  // namespace wpub::rendezvous
