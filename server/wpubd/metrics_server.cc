// The metrics endpoint over cpp-httplib.
#include "server/wpubd/metrics_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <utility>

#include <httplib.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/listen_socket.h"
#include "server/service/service_options.h"

namespace wpub::wpubd {
namespace {

constexpr char kMetricsPath[] = "/metrics";

// Splits "host:port" / "[v6]:port".
absl::Status SplitHostPort(const std::string& listen, std::string* host, int* port) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen '", listen, "' is not host:port"));
  }
  *host = listen.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return absl::OkStatus();
}

// httplib's pool, with a bound on how long one connection holds a thread. httplib bounds each
// read, not a request, and hands its task queue only a closure per accepted connection; the
// queue finds that connection's socket when the closure is queued (the connected socket on the
// metrics port it does not track yet: the listener thread accepted it just before), holds a
// duplicate of it, and a reaper shuts the socket down once the connection has been served for
// `lifetime` -- its next read ends, and the thread is free. The duplicate keeps the socket (and
// its identity, the inode) alive until the task ends, so the reaper never acts on a newer
// connection that reuses the number.
class BoundedTaskQueue final : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(int threads, absl::Duration lifetime)
      : pool_(static_cast<size_t>(threads)), lifetime_(lifetime), reaper_([this] { Reap(); }) {}
  ~BoundedTaskQueue() override { Stop(); }

  void set_port(int port) { port_ = port; }

  void enqueue(std::function<void()> fn) override {
    const int held = NewConnection();
    pool_.enqueue([this, held, fn = std::move(fn)] {
      if (held >= 0) Serving(held);
      fn();
      if (held >= 0) Done(held);
    });
  }
  void shutdown() override {
    pool_.shutdown();
    Stop();
  }

 private:
  struct Held {
    int fd;       // our duplicate of the connection's socket
    ino_t inode;  // the socket's identity while any descriptor of it is open
    absl::Time deadline = absl::InfiniteFuture();  // set once a thread serves it
  };

  static ino_t InodeOf(int fd) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? st.st_ino : 0;
  }
  static int LocalPort(int fd) {
    sockaddr_storage a{};
    socklen_t n = sizeof(a);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) return -1;
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
    return -1;
  }
  // The connected socket on the metrics port not tracked yet (a duplicate of it), or -1.
  int NewConnection() {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
      int fd = -1;
      if (!absl::SimpleAtoi(e.path().filename().string(), &fd) || fd < 0) continue;
      const ino_t inode = InodeOf(fd);
      if (inode == 0 || LocalPort(fd) != port_) continue;
      sockaddr_storage peer{};
      socklen_t n = sizeof(peer);
      if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &n) != 0) continue;  // listener
      std::lock_guard lock(mu_);
      if (std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.inode == inode; }))
        continue;
      const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (dup < 0 || InodeOf(dup) != inode) {  // closed and reused meanwhile: not it
        if (dup >= 0) ::close(dup);
        continue;
      }
      held_.push_back({dup, inode});
      return dup;
    }
    return -1;
  }
  void Serving(int fd) {
    std::lock_guard lock(mu_);
    for (Held& h : held_) {
      if (h.fd == fd) h.deadline = absl::Now() + lifetime_;
    }
  }
  void Done(int fd) {
    std::lock_guard lock(mu_);
    std::erase_if(held_, [&](const Held& h) { return h.fd == fd; });
    ::close(fd);
  }
  void Reap() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      const absl::Time now = absl::Now();
      for (const Held& h : held_) {
        if (h.deadline <= now) ::shutdown(h.fd, SHUT_RDWR);
      }
    }
  }
  void Stop() {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      cv_.notify_all();
    }
    reaper_.join();
  }

  httplib::ThreadPool pool_;
  const absl::Duration lifetime_;
  std::atomic<int> port_{-1};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<Held> held_;
  std::thread reaper_;  // last: it starts once everything it reads exists
};

template <typename F>
void SetTimeout(absl::Duration d, F set) {
  const int64_t us = absl::ToInt64Microseconds(d);
  set(static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Create(
    const MetricsServerOptions& options, std::shared_ptr<prometheus::Registry> registry) {
  if (options.threads < 1 || options.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_threads must be in [1, 1024], not ", options.threads));
  }
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(options.listen, &host, &port); !s.ok()) return s;

  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *server->http_;
  const int threads = options.threads;
  const absl::Duration lifetime = options.connection_lifetime;
  // httplib makes the queue when it starts listening (after the bind: the port is known).
  http.new_task_queue = [threads, lifetime, self = server.get()] {
    auto* q = new BoundedTaskQueue(threads, lifetime);
    q->set_port(self->port_);
    return q;
  };
  SetTimeout(options.read_timeout, [&](time_t s, time_t us) { http.set_read_timeout(s, us); });
  SetTimeout(options.write_timeout, [&](time_t s, time_t us) { http.set_write_timeout(s, us); });
  // httplib counts this one in whole seconds.
  http.set_keep_alive_timeout(
      std::max<time_t>(1, static_cast<time_t>(absl::ToInt64Seconds(options.keep_alive_timeout))));
  http.set_payload_max_length(4096);  // a scrape has no body
  MetricsServer* self = server.get();
  // httplib matches the whole path (std::regex_match): "/metricsx", "//metrics" and
  // "/metrics/" do not match and get 404.
  server->auth_token_ = options.auth_token;
  http.Get(kMetricsPath, [self](const httplib::Request& req, httplib::Response& res) {
    std::vector<prometheus::MetricFamily> families = self->registry_->Collect();
    std::vector<std::shared_ptr<prometheus::Collectable>> more;
    {
      std::lock_guard lock(self->mu_);
      more = self->collectables_;
    }
    for (const auto& c : more) {
      std::vector<prometheus::MetricFamily> f = c->Collect();
      families.insert(families.end(), std::make_move_iterator(f.begin()),
                      std::make_move_iterator(f.end()));
    }
    if (!self->auth_token_.empty() &&
        !server::BearerMatches(req.get_header_value("Authorization"), self->auth_token_)) {
      // Who the receivers and engines are is for whoever holds the token.
      for (prometheus::MetricFamily& f : families) {
        std::erase_if(f.metric, [](const prometheus::ClientMetric& m) {
          return std::any_of(
              m.label.begin(), m.label.end(),
              [](const prometheus::ClientMetric::Label& l) { return l.name == "receiver"; });
        });
      }
    }
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, families);
    res.set_content(out.str(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // A second wpubd on this port is refused instead of sharing it (Prometheus would scrape the
  // two alternately).
  http.set_socket_options(ExclusiveListenSocketOptions);
  const bool bound =
      port == 0 ? (port = http.bind_to_any_port(host)) > 0 : http.bind_to_port(host, port);
  if (!bound) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen,
                                               "': in use by another process (another wpubd?) or "
                                               "not an address of this host"));
  }
  server->port_ = port;
  server->listener_ = std::thread([&http] { http.listen_after_bind(); });
  // stop() is a no-op until the listener runs: wait for it so destruction always ends it.
  while (!http.is_running()) absl::SleepFor(absl::Milliseconds(1));
  return server;
}

void MetricsServer::AddCollectable(std::shared_ptr<prometheus::Collectable> c) {
  std::lock_guard lock(mu_);
  collectables_.push_back(std::move(c));
}

MetricsServer::~MetricsServer() {
  if (http_ != nullptr) http_->stop();
  if (listener_.joinable()) listener_.join();
}

}  // namespace wpub::wpubd
