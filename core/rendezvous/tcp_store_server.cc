// TCPStore server: one poll() thread, per-connection input buffers parsed incrementally (a
// request may arrive in pieces), the key-value map and the WAIT bookkeeping under one mutex.
#include "core/rendezvous/tcp_store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/rendezvous/tcp_store_protocol.h"

namespace wpub::rendezvous {
namespace {

// Outcome of parsing one request from a connection's buffer.
enum class Parse { kDone, kIncomplete, kClose };

bool SendAll(int fd, const std::vector<uint8_t>& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

std::optional<int64_t> ParseDecimal(const std::vector<uint8_t>& v) {
  int64_t out = 0;
  const char* b = reinterpret_cast<const char*>(v.data());
  const auto r = std::from_chars(b, b + v.size(), out);
  if (r.ec != std::errc() || r.ptr != b + v.size()) return std::nullopt;
  return out;
}

std::vector<uint8_t> Decimal(int64_t v) {
  const std::string s = std::to_string(v);
  return std::vector<uint8_t>(s.begin(), s.end());
}

}  // namespace

class TcpStoreServer::Impl {
 public:
  Impl(const TcpStoreServerOptions& options, int listen_fd, int wake_r, int wake_w)
      : options_(options), listen_fd_(listen_fd), wake_r_(wake_r), wake_w_(wake_w) {}

  ~Impl() {
    const char b = 0;
    (void)!::write(wake_w_, &b, 1);
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, conn] : conns_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_r_);
    ::close(wake_w_);
  }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  void Set(const std::string& key, std::vector<uint8_t> value) {
    std::lock_guard lock(mu_);
    DoSet(key, std::move(value));
  }
  std::optional<std::vector<uint8_t>> Get(const std::string& key) const {
    std::lock_guard lock(mu_);
    auto it = store_.find(key);
    if (it == store_.end()) return std::nullopt;
    return it->second;
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) {
    std::lock_guard lock(mu_);
    auto r = DoAdd(key, delta);
    if (!r) {
      if (auto it = store_.find(key); it != store_.end() && ParseDecimal(it->second)) {
        return absl::InvalidArgumentError(
            absl::StrCat("TCPStore key '", key, "': adding ", delta, " overflows int64"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("TCPStore key '", key, "' does not hold a decimal integer"));
    }
    return *r;
  }
  bool Delete(const std::string& key) {
    std::lock_guard lock(mu_);
    return store_.erase(key) > 0;
  }
  size_t NumKeys() const {
    std::lock_guard lock(mu_);
    return store_.size();
  }
  std::vector<std::string> RecentlyAwaitedKeys() const {
    std::lock_guard lock(mu_);
    return std::vector<std::string>(awaited_.begin(), awaited_.end());
  }
  TcpStoreServerStats stats() const {
    std::lock_guard lock(mu_);
    TcpStoreServerStats s = stats_;
    s.connections_open = conns_.size();
    return s;
  }

 private:
  struct Conn {
    std::vector<uint8_t> in;
    size_t awaited = 0;  // keys a pending WAIT still waits for
  };

  void Run() {
    std::vector<pollfd> fds;
    std::vector<uint8_t> chunk(1 << 16);
    for (;;) {
      fds.clear();
      fds.push_back({wake_r_, POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      {
        std::lock_guard lock(mu_);
        for (const auto& [fd, c] : conns_) fds.push_back({fd, POLLIN, 0});
      }
      const int n = ::poll(fds.data(), fds.size(), -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents != 0) return;  // stop requested
      if (fds[1].revents & POLLIN) Accept();
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const int fd = fds[i].fd;
        ssize_t got;
        do {
          got = ::recv(fd, chunk.data(), chunk.size(), MSG_DONTWAIT);
        } while (got < 0 && errno == EINTR);
        std::lock_guard lock(mu_);
        if (got <= 0) {
          if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
          CloseLocked(fd, false);
          continue;
        }
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        it->second.in.insert(it->second.in.end(), chunk.begin(), chunk.begin() + got);
        ServeLocked(fd);
      }
    }
  }

  void Accept() {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    std::lock_guard lock(mu_);
    if (conns_.size() >= options_.max_connections) {
      ::close(fd);
      return;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    timeval tv{};
    const int64_t us = absl::ToInt64Microseconds(options_.send_timeout);
    tv.tv_sec = us / 1000000;
    tv.tv_usec = us % 1000000;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    conns_[fd] = Conn{};
    ++stats_.connections_accepted;
  }

  // Parses and answers every complete request buffered for `fd`. Requires mu_.
  void ServeLocked(int fd) {
    for (;;) {
      auto it = conns_.find(fd);
      if (it == conns_.end()) return;
      Conn& c = it->second;
      if (c.in.empty()) return;
      // A connection with a pending WAIT sends nothing else until answered (torch's client
      // blocks on the reply), except CANCEL_WAIT, which is handled in order like any request.
      size_t used = 0;
      std::vector<uint8_t> reply;
      const Parse p = ParseOne(fd, c, &used, &reply);
      if (p == Parse::kIncomplete) return;
      if (p == Parse::kClose) {
        ++stats_.protocol_errors;
        CloseLocked(fd, true);
        return;
      }
      ++stats_.requests;
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(used));
      if (!reply.empty() && !SendAll(fd, reply)) {
        CloseLocked(fd, false);
        return;
      }
    }
  }

  Parse ParseOne(int fd, Conn& c, size_t* used, std::vector<uint8_t>* reply) {
    WireReader r(c.in.data(), c.in.size(), options_.max_item_bytes);
    bool too_large = false;
    uint8_t type_byte = 0;
    if (!r.Value(&type_byte)) return Parse::kIncomplete;
    const auto fail = [&]() { return too_large ? Parse::kClose : Parse::kIncomplete; };
    WireWriter w;
    switch (static_cast<QueryType>(type_byte)) {
      case QueryType::kValidate: {
        uint32_t magic = 0;
        if (!r.Value(&magic)) return Parse::kIncomplete;
        if (magic != kValidationMagic) return Parse::kClose;
        break;
      }
      case QueryType::kPing: {
        uint32_t nonce = 0;
        if (!r.Value(&nonce)) return Parse::kIncomplete;
        w.Value(nonce);
        break;
      }
      case QueryType::kSet:
      case QueryType::kAppend: {
        std::string key;
        std::vector<uint8_t> value;
        if (!r.String(&key, &too_large) || !r.Vector(&value, &too_large)) return fail();
        if (static_cast<QueryType>(type_byte) == QueryType::kAppend) {
          auto it = store_.find(key);
          if (it != store_.end()) {
            it->second.insert(it->second.end(), value.begin(), value.end());
            value = it->second;
          }
        }
        DoSet(key, std::move(value));
        break;
      }
      case QueryType::kCompareSet: {
        std::string key;
        std::vector<uint8_t> expected, desired;
        if (!r.String(&key, &too_large) || !r.Vector(&expected, &too_large) ||
            !r.Vector(&desired, &too_large)) {
          return fail();
        }
        auto it = store_.find(key);
        if (it == store_.end()) {
          if (expected.empty()) {
            w.Vector(desired);
            DoSet(key, std::move(desired));
          } else {
            w.Vector(expected);  // torch answers the caller's expectation for a missing key
          }
        } else {
          if (it->second == expected) it->second = std::move(desired);
          w.Vector(it->second);
        }
        break;
      }
      case QueryType::kGet: {
        std::string key;
        if (!r.String(&key, &too_large)) return fail();
        NoteAwaited(key);
        auto it = store_.find(key);
        if (it == store_.end()) return Parse::kClose;
        w.Vector(it->second);
        break;
      }
      case QueryType::kAdd: {
        std::string key;
        int64_t delta = 0;
        if (!r.String(&key, &too_large) || !r.Value(&delta)) return fail();
        auto v = DoAdd(key, delta);
        if (!v) return Parse::kClose;
        w.Value<int64_t>(*v);
        break;
      }
      case QueryType::kCheck:
      case QueryType::kWait:
      case QueryType::kMultiGet: {
        uint64_t nargs = 0;
        if (!r.Value(&nargs)) return Parse::kIncomplete;
        if (nargs > 1u << 20) return Parse::kClose;
        std::vector<std::string> keys(nargs);
        for (auto& k : keys) {
          if (!r.String(&k, &too_large)) return fail();
        }
        const auto type = static_cast<QueryType>(type_byte);
        for (const auto& k : keys) NoteAwaited(k);
        if (type == QueryType::kMultiGet) {
          for (const auto& k : keys) {
            auto it = store_.find(k);
            if (it == store_.end()) return Parse::kClose;
            w.Vector(it->second);
          }
          break;
        }
        size_t missing = 0;
        for (const auto& k : keys) missing += store_.count(k) == 0;
        if (type == QueryType::kCheck) {
          w.Value(missing == 0 ? CheckResponse::kReady : CheckResponse::kNotReady);
          break;
        }
        if (missing == 0) {
          w.Value(WaitResponse::kStopWaiting);
          break;
        }
        c.awaited = missing;
        for (const auto& k : keys) {
          if (store_.count(k) == 0) waiting_[k].push_back(fd);
        }
        break;
      }
      case QueryType::kGetNumKeys:
        w.Value<int64_t>(static_cast<int64_t>(store_.size()));
        break;
      case QueryType::kDeleteKey: {
        std::string key;
        if (!r.String(&key, &too_large)) return fail();
        w.Value<int64_t>(static_cast<int64_t>(store_.erase(key)));
        break;
      }
      case QueryType::kMultiSet: {
        uint64_t nargs = 0;
        if (!r.Value(&nargs)) return Parse::kIncomplete;
        if (nargs > 1u << 20) return Parse::kClose;
        std::vector<std::pair<std::string, std::vector<uint8_t>>> kvs(nargs);
        for (auto& [k, v] : kvs) {
          if (!r.String(&k, &too_large) || !r.Vector(&v, &too_large)) return fail();
        }
        for (auto& [k, v] : kvs) DoSet(k, std::move(v));
        break;
      }
      case QueryType::kCancelWait:
        ClearWaitLocked(fd);
        w.Value(WaitResponse::kWaitCanceled);
        break;
      default:
        return Parse::kClose;
    }
    *used = r.consumed();
    *reply = std::move(w.bytes());
    return Parse::kDone;
  }

  // Requires mu_.
  void NoteAwaited(const std::string& key) {
    auto it = std::find(awaited_.begin(), awaited_.end(), key);
    if (it != awaited_.end()) awaited_.erase(it);
    awaited_.push_back(key);
    if (awaited_.size() > 32) awaited_.pop_front();
  }

  // Requires mu_.
  void DoSet(const std::string& key, std::vector<uint8_t> value) {
    store_[key] = std::move(value);
    Wake(key);
  }

  // Requires mu_. nullopt (the value unchanged) when the existing value is not a decimal
  // integer or the sum leaves int64 (a client sending INT64_MAX twice).
  std::optional<int64_t> DoAdd(const std::string& key, int64_t delta) {
    auto it = store_.find(key);
    if (it != store_.end()) {
      auto cur = ParseDecimal(it->second);
      if (!cur || __builtin_add_overflow(delta, *cur, &delta)) return std::nullopt;
    }
    store_[key] = Decimal(delta);
    Wake(key);
    return delta;
  }

  // Answers STOP_WAITING to every connection whose last awaited key is `key`. Requires mu_.
  void Wake(const std::string& key) {
    auto it = waiting_.find(key);
    if (it == waiting_.end()) return;
    std::vector<int> fds = std::move(it->second);
    waiting_.erase(it);
    std::vector<uint8_t> stop;
    WireWriter w;
    w.Value(WaitResponse::kStopWaiting);
    stop = w.bytes();
    for (int fd : fds) {
      auto c = conns_.find(fd);
      if (c == conns_.end() || c->second.awaited == 0) continue;
      // A failed reply ends the connection; the poll thread closes it when it sees EOF (it
      // may be polling this descriptor right now, so it is not closed from here).
      if (--c->second.awaited == 0 && !SendAll(fd, stop)) ::shutdown(fd, SHUT_RDWR);
    }
  }

  void ClearWaitLocked(int fd) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      auto& v = it->second;
      v.erase(std::remove(v.begin(), v.end(), fd), v.end());
      it = v.empty() ? waiting_.erase(it) : std::next(it);
    }
    auto c = conns_.find(fd);
    if (c != conns_.end()) c->second.awaited = 0;
  }

  void CloseLocked(int fd, bool /*protocol_error*/) {
    if (conns_.erase(fd) == 0) return;
    ClearWaitLocked(fd);
    ::close(fd);
  }

  const TcpStoreServerOptions options_;
  const int listen_fd_;
  const int wake_r_;
  const int wake_w_;
  std::thread thread_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, std::vector<uint8_t>> store_;  // guarded by mu_
  std::unordered_map<std::string, std::vector<int>> waiting_;    // guarded by mu_
  std::map<int, Conn> conns_;                                    // guarded by mu_
  std::deque<std::string> awaited_;                              // guarded by mu_
  TcpStoreServerStats stats_;                                    // guarded by mu_
};

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Create(
    const TcpStoreServerOptions& options) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(options.port);
  if (::inet_pton(AF_INET, options.bind_address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore server: bind_address '", options.bind_address, "' is not an IPv4 address"));
  }
  if (options.max_item_bytes == 0 || options.max_connections == 0) {
    return absl::InvalidArgumentError(
        "TCPStore server: max_item_bytes and max_connections must be positive");
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, options.backlog) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("TCPStore server: cannot listen on ",
                                               options.bind_address, ":", options.port, ": ",
                                               std::strerror(err)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("pipe(): ", std::strerror(errno)));
  }
  auto impl = std::make_unique<Impl>(options, fd, pipefd[0], pipefd[1]);
  impl->Start();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl), ntohs(addr.sin_port)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl, uint16_t port)
    : impl_(std::move(impl)), port_(port) {}
TcpStoreServer::~TcpStoreServer() = default;

void TcpStoreServer::Set(const std::string& key, std::vector<uint8_t> value) {
  impl_->Set(key, std::move(value));
}
std::vector<std::string> TcpStoreServer::RecentlyAwaitedKeys() const {
  return impl_->RecentlyAwaitedKeys();
}
std::optional<std::vector<uint8_t>> TcpStoreServer::Get(const std::string& key) const {
  return impl_->Get(key);
}
absl::StatusOr<int64_t> TcpStoreServer::Add(const std::string& key, int64_t delta) {
  return impl_->Add(key, delta);
}
bool TcpStoreServer::Delete(const std::string& key) { return impl_->Delete(key); }
size_t TcpStoreServer::NumKeys() const { return impl_->NumKeys(); }
TcpStoreServerStats TcpStoreServer::stats() const { return impl_->stats(); }

absl::StatusOr<std::string> UniqueIdKey(absl::string_view key_template, absl::string_view group,
                                        int comm_index) {
  if (key_template.find("{group}") == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("unique-id key template '", key_template, "' must contain {group}"));
  }
  if (group.empty()) return absl::InvalidArgumentError("unique-id key: empty group name");
  return absl::StrReplaceAll(key_template,
                             {{"{group}", group}, {"{index}", absl::StrCat(comm_index)}});
}

}  // namespace wpub::rendezvous
