// wpubd on an address it cannot have, with real processes: a missing Unix-socket directory, an
// address that is not this host's, and a port or socket another wpubd already serves on. Each
// time the daemon says "cannot listen on '<address>': <why>" and exits 1 (it used to crash),
// and a daemon already serving keeps serving alone.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/client/child_process.h"
#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

struct Exit {
  int code = -1;
  std::string log;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs wpubd with `args` until it exits on its own.
Exit RunWpubd(const std::string& dir, const std::vector<std::string>& args) {
  static int runs = 0;
  const std::string log = absl::StrCat(dir, "/wpubd-", runs++, ".log");
  Exit out;
  auto proc = client::ChildProcess::Spawn({WpubdPath(), args, log});
  if (!proc.ok()) {
    out.log = proc.status().ToString();
    return out;
  }
  absl::StatusOr<int> code = (*proc)->Wait(absl::Seconds(60));
  out.code = code.ok() ? *code : -1;
  out.log = ReadFile(log);
  return out;
}

class ListenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wpub-listen-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_F(ListenTest, MissingUnixSocketDirectoryIsAnErrorNotACrash) {
  const std::string listen = absl::StrCat("unix:", dir_, "/no-such-dir/wpubd.sock");
  Exit e = RunWpubd(dir_, {"--listen=" + listen, "--metrics_listen="});
  EXPECT_EQ(e.code, 1) << e.log;
  EXPECT_NE(e.log.find(absl::StrCat("cannot listen on '", listen, "'")), std::string::npos)
      << e.log;
  EXPECT_NE(e.log.find("does not exist"), std::string::npos) << e.log;
}

TEST_F(ListenTest, AddressNotOnThisHostIsAnErrorNotACrash) {
  // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a local address.
  Exit e = RunWpubd(dir_, {"--listen=192.0.2.1:50151", "--insecure_listen", "--metrics_listen="});
  EXPECT_EQ(e.code, 1) << e.log;
  EXPECT_NE(e.log.find("cannot listen on '192.0.2.1:50151'"), std::string::npos) << e.log;
  EXPECT_NE(e.log.find("not one of this host's"), std::string::npos) << e.log;
}

TEST_F(ListenTest, SecondDaemonOnTheSamePortIsRefused) {
  HarnessOptions options;
  options.receivers = 0;
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  const std::string port = absl::StrCat((*h)->target().substr((*h)->target().rfind(':') + 1));

  Exit e = RunWpubd(dir_, {"--listen=127.0.0.1:" + port, "--metrics_listen="});
  EXPECT_EQ(e.code, 1) << e.log;
  EXPECT_NE(e.log.find(absl::StrCat("cannot listen on '127.0.0.1:", port, "'")), std::string::npos)
      << e.log;
  EXPECT_NE(e.log.find("another wpubd"), std::string::npos) << e.log;
  // The first daemon still has the port to itself and serves.
  EXPECT_TRUE((*h)->daemon().Running());
  EXPECT_EQ(HealthCheck((*h)->target()).value_or(-1), 1);
  EXPECT_TRUE((*h)->client().GetStatus().ok());
}

// The metrics port too: a second daemon that shared it (SO_REUSEPORT, cpp-httplib's default)
// would be scraped alternately with the first.
TEST_F(ListenTest, SecondDaemonOnTheSameMetricsPortIsRefused) {
  HarnessOptions options;
  options.receivers = 0;
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  const std::string metrics = absl::StrCat("127.0.0.1:", (*h)->metrics_port());

  Exit e = RunWpubd(dir_, {"--listen=127.0.0.1:0", "--metrics_listen=" + metrics});
  EXPECT_EQ(e.code, 1) << e.log;
  EXPECT_NE(e.log.find(absl::StrCat("cannot listen on '", metrics, "'")), std::string::npos)
      << e.log;
  EXPECT_NE(e.log.find("another wpubd"), std::string::npos) << e.log;
  // Every scrape still reaches the first daemon.
  for (int i = 0; i < 4; ++i) {
    auto scraped = ScrapeMetrics((*h)->metrics_port());
    ASSERT_TRUE(scraped.ok()) << scraped.status();
    EXPECT_TRUE(
        std::any_of(scraped->begin(), scraped->end(),
                    [](const auto& kv) { return kv.first.rfind("wpub_build_info", 0) == 0; }))
        << "scrape " << i;
  }
}

TEST_F(ListenTest, SecondDaemonOnTheSameUnixSocketIsRefused) {
  const std::string listen = absl::StrCat("unix:", dir_, "/wpubd.sock");
  const std::string ready = dir_ + "/ready.json";
  auto first = client::ChildProcess::Spawn(
      {WpubdPath(),
       {"--listen=" + listen, "--metrics_listen=", "--ready_file=" + ready},
       dir_ + "/first.log"});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(client::WaitForReadyFile(ready, first->get(), absl::Seconds(30)).ok())
      << ReadFile(dir_ + "/first.log");
  ASSERT_EQ(HealthCheck(listen).value_or(-1), 1);

  Exit e = RunWpubd(dir_, {"--listen=" + listen, "--metrics_listen="});
  EXPECT_EQ(e.code, 1) << e.log;
  EXPECT_NE(e.log.find(absl::StrCat("cannot listen on '", listen, "'")), std::string::npos)
      << e.log;
  EXPECT_NE(e.log.find("another wpubd"), std::string::npos) << e.log;
  // gRPC would have unlinked the live socket and bound a new one: the first daemon would be
  // unreachable although running.
  EXPECT_EQ(HealthCheck(listen).value_or(-1), 1);
  EXPECT_EQ((*first)->Stop(absl::Seconds(30)), 0);
}

}  // namespace
}  // namespace wpub::testing
