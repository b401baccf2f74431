// wpubd's metrics port with a real daemon: exactly `/metrics` is served (not `/metricsx`,
// `//metrics`, `/metrics/`), and scrapes are still answered while 50 connections sit on the
// port sending nothing or half a request, and while 40 trickle theirs a byte at a time.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>

#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

// GET `path`: the HTTP status (-1 when no answer came) and the body.
int Get(int port, const std::string& path, std::string* body = nullptr) {
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(10);
  // Generous: the answer must come, however long the stalled connections hold workers.
  http.set_read_timeout(60);
  auto res = http.Get(path.c_str());
  if (!res) return -1;
  if (body != nullptr) *body = res->body;
  return res->status;
}

// A TCP connection to the metrics port that sent `bytes` and then nothing.
int OpenStalled(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (!bytes.empty() &&
       send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size()))) {
    close(fd);
    return -1;
  }
  return fd;
}

class MetricsPortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HarnessOptions options;
    options.receivers = 0;
    auto h = DaemonHarness::Start(options);
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h);
  }
  std::unique_ptr<DaemonHarness> harness_;
};

TEST_F(MetricsPortTest, ServesExactlyTheMetricsPath) {
  const int port = harness_->metrics_port();
  std::string body;
  EXPECT_EQ(Get(port, "/metrics", &body), 200);
  EXPECT_NE(body.find("wpub_"), std::string::npos) << body.substr(0, 500);
  EXPECT_EQ(Get(port, "/metrics?name[]=x", &body), 200);
  for (const char* path :
       {"/metricsx", "//metrics", "/metrics/", "/", "/metrics/../metrics2", "/favicon.ico"}) {
    EXPECT_EQ(Get(port, path), 404) << path;
  }
}

TEST_F(MetricsPortTest, ScrapesAreAnsweredWhileHalfOpenConnectionsSit) {
  const int port = harness_->metrics_port();
  std::vector<int> stalled;
  for (int i = 0; i < 50; ++i) {
    // Half send nothing at all, half stop in the middle of their request headers.
    const int fd = OpenStalled(port, i % 2 == 0 ? "" : "GET /metrics HTTP/1.1\r\nHost: x");
    ASSERT_GE(fd, 0) << "connection " << i;
    stalled.push_back(fd);
  }
  for (int scrape = 0; scrape < 3; ++scrape) {
    std::string body;
    EXPECT_EQ(Get(port, "/metrics", &body), 200) << "scrape " << scrape;
    EXPECT_NE(body.find("wpub_"), std::string::npos);
  }
  EXPECT_TRUE(harness_->daemon().Running());
  for (int fd : stalled) close(fd);
  EXPECT_EQ(Get(port, "/metrics"), 200);
}

// Connections that trickle a request a byte at a time (every read within the read timeout, the
// request never complete) hold a thread each for at most a connection's lifetime: scrapes are
// answered long before the tricklers stop.
TEST_F(MetricsPortTest, TricklingConnectionsHoldAThreadNoLongerThanTheirLifetime) {
  const int port = harness_->metrics_port();
  std::vector<int> trickling;
  for (int i = 0; i < 40; ++i) {
    const int fd = OpenStalled(port, "GET /metrics HTTP/1.1\r\nX-Slow: ");
    ASSERT_GE(fd, 0) << "connection " << i;
    trickling.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    for (int second = 0; second < 600 && !stop; ++second) {  // a byte per connection per 300 ms
      for (int fd : trickling) send(fd, "a", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  std::string body;
  const int status = Get(port, "/metrics", &body);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop = true;
  trickle.join();
  for (int fd : trickling) close(fd);
  EXPECT_EQ(status, 200);
  EXPECT_NE(body.find("wpub_"), std::string::npos);
  // 40 tricklers on 16 threads, each cut after its 5 s: about 15 s at most, never the minutes
  // a trickler could go on for.
  EXPECT_LT(waited, 40.0);
  EXPECT_TRUE(harness_->daemon().Running());
}

// With a token, who the receivers are (the `receiver` label) is served only to a scrape that
// presents it; the aggregates are served to every scrape.
TEST(MetricsPortTokenTest, ReceiverNamesNeedTheToken) {
  char tmpl[] = "/tmp/wpub_metrics_token_XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string token = "scrape-s3cret";
  std::ofstream(tmpl) << token << "\n";
  HarnessOptions options;
  options.receivers = 1;  // a connected receiver: series named after it
  options.auth_token_file = tmpl;
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  const int port = (*h)->metrics_port();
  const auto scrape = [&](const std::string& bearer) {
    httplib::Client http("127.0.0.1", port);
    http.set_read_timeout(30);
    if (!bearer.empty()) http.set_bearer_token_auth(bearer);
    auto res = http.Get("/metrics");
    return res ? res->body : std::string();
  };
  std::string with;
  for (int i = 0; i < 100 && with.find("receiver=\"") == std::string::npos; ++i) {
    with = scrape(token);  // until the receiver subscribed
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(with.find("wpub_receiver_state{receiver=\""), std::string::npos) << with;
  for (const std::string& bearer : {std::string(), std::string("wrong")}) {
    const std::string without = scrape(bearer);
    EXPECT_NE(without.find("wpub_publications_total"), std::string::npos);
    EXPECT_EQ(without.find("receiver=\""), std::string::npos) << bearer;
  }
  std::remove(tmpl);
}

}  // namespace
}  // namespace wpub::testing
