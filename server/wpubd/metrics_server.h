// wpubd's Prometheus endpoint: serves one registry at exactly `/metrics` over plain HTTP
// (cpp-httplib), with a bounded thread pool and short read timeouts, so that connections
// that send nothing or half a request cannot starve the scrapes.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <prometheus/registry.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace httplib {
class Server;
}

namespace wpub::wpubd {

struct MetricsServerOptions {
  // "host:port" or "[v6]:port"; port 0 picks a free one (MetricsServer::port).
  std::string listen = "127.0.0.1:9464";
  // Connections served at once. Each connection holds a thread until its request was read
  // (at most read_timeout per read, keep_alive_timeout between requests), so an idle or
  // stalled connection costs a thread for about a second; past `threads` connections wait
  // in order.
  int threads = 16;
  // Longest wait for the next bytes of a request (and of a reply's write).
  absl::Duration read_timeout = absl::Seconds(1);
  absl::Duration write_timeout = absl::Seconds(2);
  // Longest wait for a (first or next) request on a connection.
  absl::Duration keep_alive_timeout = absl::Seconds(1);
  // Longest a connection may hold a thread, whatever it sends: one that trickles its request a
  // byte at a time (each read within read_timeout) is closed then. Prometheus opens a new
  // connection for its next scrape, so a scrape waits at most about
  // (connections ahead of it / threads) x this.
  absl::Duration connection_lifetime = absl::Seconds(5);
  // The daemon's token (wpubd --auth_token_file), or "": series that name a receiver or engine
  // (a `receiver` label) are served only to scrapes that present it as "Authorization: Bearer";
  // every other series is served to every scrape (dashboards and alerts on aggregates keep
  // working without it).
  std::string auth_token;
};

// Serves GET/HEAD `/metrics` (a query string is ignored) with the text exposition format (with a
// token, the per-receiver series only to a scrape that presents it);
// every other path, including `/metricsx` and `//metrics`, is 404 and every other method 405
// or 404. Thread-safe: scrapes run on the pool's threads; destruction stops the listener and
// joins every thread.
class MetricsServer {
 public:
  // Binds `options.listen` and starts serving `registry` (shared with the engine that
  // updates it). INVALID_ARGUMENT for a malformed address or option, UNAVAILABLE when the
  // address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Create(
      const MetricsServerOptions& options, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The bound TCP port.
  int port() const { return port_; }
  // Also serves what `c` collects at each scrape (after the registry's families; its families
  // must not repeat the registry's names). Any thread.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> c);

 private:
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::string auth_token_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;  // guarded by mu_
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  int port_ = 0;
};

}  // namespace wpub::wpubd
