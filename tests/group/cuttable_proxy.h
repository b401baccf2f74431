// A TCP proxy on 127.0.0.1 for tests: forwards every connection to a target port, and can cut
// every connection at once (a network between daemons that drops), refuse new ones (the peer
// unreachable) and switch its target (the peer restarted elsewhere).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace wpub::testing {

class CuttableProxy {
 public:
  explicit CuttableProxy(int target_port) : target_port_(target_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    ::listen(listen_fd_, 64);
    socklen_t n = sizeof(a);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &n);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~CuttableProxy() {
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    Cut();
    std::vector<std::thread> pumps;
    {
      std::lock_guard lock(mu_);
      pumps.swap(pumps_);
    }
    for (std::thread& t : pumps) t.join();
  }
  CuttableProxy(const CuttableProxy&) = delete;
  CuttableProxy& operator=(const CuttableProxy&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // Closes every connection it carries (both ends see a reset or end of stream).
  void Cut() {
    std::lock_guard lock(mu_);
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
  }
  // While refusing, a new connection is closed as soon as it is accepted.
  void Refuse(bool refuse) { refusing_ = refuse; }
  void Retarget(int port) { target_port_ = port; }
  int connections() const { return accepted_.load(); }

 private:
  void Accept() {
    while (!stopping_) {
      const int c = ::accept(listen_fd_, nullptr, nullptr);
      if (c < 0) {
        if (stopping_) return;
        continue;
      }
      if (refusing_) {
        ::close(c);
        continue;
      }
      const int u = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(target_port_.load()));
      if (::connect(u, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        ::close(u);
        ::close(c);
        continue;
      }
      ++accepted_;
      std::lock_guard lock(mu_);
      open_.push_back(c);
      open_.push_back(u);
      pumps_.emplace_back([this, c, u] { Pump(c, u); });
      pumps_.emplace_back([this, c, u] { Pump(u, c); });
    }
  }
  // Copies from -> to until either side ends; the second pump of the pair closes both.
  void Pump(int from, int to) {
    char buf[65536];
    for (;;) {
      const ssize_t n = ::recv(from, buf, sizeof(buf), 0);
      if (n <= 0) break;
      if (::send(to, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(from, SHUT_RDWR);
    ::shutdown(to, SHUT_RDWR);
    std::lock_guard lock(mu_);
    const int key = from < to ? from : to;
    if (++ended_[key] == 2) {
      ended_.erase(key);
      std::erase(open_, from);
      std::erase(open_, to);
      ::close(from);
      ::close(to);
    }
  }

  std::atomic<int> target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> refusing_{false};
  std::atomic<int> accepted_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> open_;
  std::vector<std::thread> pumps_;
  std::map<int, int> ended_;  // pumps ended per connection pair (keyed by its lower fd)
};

}  // namespace wpub::testing
