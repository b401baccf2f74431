// The metrics endpoint over cpp-httplib.
#include "server/wpubd/metrics_server.h"

#include <algorithm>
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
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
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
