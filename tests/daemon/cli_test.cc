// The wpubctl subcommands as a user runs them: publish-synthetic and status against a real
// wpubd with two receivers, connect-engines against the CPU path, and the whole demo (the
// project's main job) end to end.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/daemon/harness.h"

#ifndef WPUBCTL_PATH
#error "WPUBCTL_PATH must be defined by the build (the built wpubctl binary)"
#endif

namespace wpub::testing {
namespace {

// Runs wpubctl with `args`; returns its exit code and fills `output` (stdout + stderr).
int RunWpubctl(const std::string& dir, const std::vector<std::string>& args, std::string* output) {
  const std::string log = absl::StrCat(dir, "/wpubctl-", args.front(), ".log");
  auto proc = client::ChildProcess::Spawn({WPUBCTL_PATH, args, log});
  if (!proc.ok()) {
    *output = proc.status().ToString();
    return -1;
  }
  auto code = (*proc)->Wait(absl::Seconds(240));
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  *output = ss.str();
  return code.ok() ? *code : -1;
}

// Dashed and underscored flag spellings are both accepted.
const std::vector<std::string> kSmallModel = {
    "--num-layers=3",    "--first_k_dense=1",           "--num-experts=4",
    "--hidden_size=256", "--moe_intermediate_size=128", "--intermediate_size=512",
    "--vocab_size=1024"};

TEST(Wpubctl, PublishSyntheticThenStatus) {
  HarnessOptions options;
  options.daemon_flags = {"--min_receivers=2"};
  auto harness = DaemonHarness::Start(options);
  ASSERT_TRUE(harness.ok()) << harness.status();
  DaemonHarness& h = **harness;

  std::vector<std::string> args = {"publish-synthetic", "--target=" + h.target(), "--count=2",
                                   "--payload=shm", "--parts=2"};
  args.insert(args.end(), kSmallModel.begin(), kSmallModel.end());
  std::string out;
  ASSERT_EQ(RunWpubctl(h.dir(), args, &out), 0) << out;
  EXPECT_NE(out.find("committed"), std::string::npos) << out;

  auto status = h.client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->committed_version(), 2u);  // --version=0: one past the daemon's, twice
  ASSERT_TRUE(WaitForFileVersion(h.recv_output(0), 2).ok());

  ASSERT_EQ(RunWpubctl(h.dir(), {"status", "--target=" + h.target()}, &out), 0) << out;
  EXPECT_NE(out.find("committed   v2"), std::string::npos) << out;
  EXPECT_NE(out.find("recv-0"), std::string::npos) << out;
  EXPECT_NE(out.find("recv-1"), std::string::npos) << out;

  // A stale explicit version is refused with the daemon's message and a non-zero exit.
  args.push_back("--version=1");
  EXPECT_EQ(RunWpubctl(h.dir(), args, &out), 1);
  EXPECT_NE(out.find("FAILED_PRECONDITION"), std::string::npos) << out;
}

// A loopback port nothing listens on (bound once, then closed).
int UnusedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// wpubctl reads WPUB_TARGET (and WPUB_TOKEN_FILE) as the Python client does, --target wins over
// it, and a target nothing listens on fails at once naming it instead of after
// --connect_timeout.
TEST(Wpubctl, ReadsTheClientEnvironmentAndFailsFastWhenNothingListens) {
  HarnessOptions options;
  options.receivers = 0;
  auto harness = DaemonHarness::Start(options);
  ASSERT_TRUE(harness.ok()) << harness.status();
  DaemonHarness& h = **harness;
  const std::string dead = absl::StrCat("127.0.0.1:", UnusedPort());
  std::string out;
  ::setenv("WPUB_TARGET", h.target().c_str(), 1);
  EXPECT_EQ(RunWpubctl(h.dir(), {"status"}, &out), 0) << out;
  EXPECT_NE(out.find("committed"), std::string::npos) << out;
  ::setenv("WPUB_TARGET", dead.c_str(), 1);
  EXPECT_EQ(RunWpubctl(h.dir(), {"status", "--target=" + h.target()}, &out), 0) << out;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(RunWpubctl(h.dir(), {"status", "--connect_timeout=300s"}, &out), 0) << out;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::unsetenv("WPUB_TARGET");
  EXPECT_NE(out.find(absl::StrCat("cannot connect to wpubd at '", dead, "'")), std::string::npos)
      << out;
  EXPECT_NE(out.find("WPUB_TARGET"), std::string::npos) << "the hint: " << out;
  // Not the 300 s connect timeout: the refused connection ends it.
  EXPECT_LT(seconds, 120) << out;
}

// ConnectEngines on the CPU path: the daemon names why (no GPU path) and, first, any bad entry;
// wpubctl reports either with a non-zero exit. GetStatus has no engine group there.
TEST(Wpubctl, ConnectEnginesOnTheCpuPath) {
  HarnessOptions options;
  options.receivers = 0;
  auto harness = DaemonHarness::Start(options);
  ASSERT_TRUE(harness.ok()) << harness.status();
  DaemonHarness& h = **harness;

  wpub::v1::ConnectEnginesRequest request;
  request.add_engines()->set_url("http://127.0.0.1:30000");
  auto r = h.client().ConnectEngines(request, absl::Seconds(10));
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("this daemon has no GPU path"), std::string::npos);
  auto* bad = request.add_engines();
  bad->set_url("http://127.0.0.1:30001");
  bad->set_gpus(-2);
  r = h.client().ConnectEngines(request, absl::Seconds(10));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("engines[1] 'http://127.0.0.1:30001': gpus is -2"),
            std::string::npos)
      << r.status();
  request.set_timeout_seconds(-1);
  r = h.client().ConnectEngines(request, absl::Seconds(10));
  EXPECT_NE(r.status().message().find("timeout_seconds"), std::string::npos) << r.status();
  auto status = h.client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_FALSE(status->has_engine_group());

  std::string out;
  EXPECT_EQ(RunWpubctl(h.dir(),
                       {"connect-engines", "--target=" + h.target(),
                        "--engines=http://127.0.0.1:30000=2, http://127.0.0.1:30001"},
                       &out),
            1);
  EXPECT_NE(out.find("FAILED_PRECONDITION"), std::string::npos) << out;
  EXPECT_NE(out.find("no GPU path"), std::string::npos) << out;
  EXPECT_EQ(RunWpubctl(h.dir(),
                       {"connect-engines", "--target=" + h.target(),
                        "--engines=http://127.0.0.1:30000,ftp://127.0.0.1:30001"},
                       &out),
            1);
  EXPECT_NE(out.find("INVALID_ARGUMENT"), std::string::npos) << out;
  EXPECT_NE(out.find("engines[1] 'ftp://127.0.0.1:30001'"), std::string::npos) << out;
  // The engine list syntax is checked before anything is sent.
  EXPECT_EQ(RunWpubctl(h.dir(),
                       {"connect-engines", "--target=" + h.target(), "--engines=http://a=0"}, &out),
            1);
  EXPECT_NE(out.find("GPU count"), std::string::npos) << out;
}

// Runs wpubd with `args` until it exits (it must within a minute); its exit code and log.
int RunWpubdToExit(const std::vector<std::string>& args, std::string* out) {
  char tmpl[] = "/tmp/wpub-wpubd-exit-test-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  const std::string log = absl::StrCat(tmpl, "/wpubd.log");
  auto proc = client::ChildProcess::Spawn({WPUBD_PATH, args, log});
  EXPECT_TRUE(proc.ok()) << proc.status();
  if (!proc.ok()) return -1;
  auto code = (*proc)->Wait(absl::Seconds(60));
  EXPECT_TRUE(code.ok()) << code.status();
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  std::filesystem::remove_all(tmpl);
  return code.ok() ? *code : -1;
}

// --gpu_path on a device that does not exist: wpubd exits 1 naming it (or, built without CUDA,
// saying so) instead of serving without its GPU path.
TEST(Wpubd, GpuPathWithoutTheDeviceExitsNamingIt) {
  std::string out;
  EXPECT_EQ(
      RunWpubdToExit(
          {"--gpu_path", "--gpu_device=999", "--listen=127.0.0.1:0", "--metrics_listen="}, &out),
      1);
  EXPECT_TRUE(out.find("CUDA device 999") != std::string::npos ||
              out.find("built without CUDA") != std::string::npos)
      << out;
}

// Every GPU-path tuning flag out of its range: wpubd exits naming the flag, its range and the
// value given.
TEST(Wpubd, GpuPathFlagsOutOfRangeAreRefusedNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"--engine_requests_in_flight=0", "--engine_requests_in_flight must be in [1, 8], not 0"},
      {"--engine_requests_in_flight=9", "--engine_requests_in_flight must be in [1, 8], not 9"},
      {"--engine_requests_in_flight=-1", "--engine_requests_in_flight must be in [1, 8], not -1"},
      {"--gpu_compute_sms=-4", "--gpu_compute_sms must be >= 0, not -4"},
      {"--gpu_overlap_ctas_per_sm=-4", "--gpu_overlap_ctas_per_sm must be >= 0, not -4"},
      {"--nccl_ctas=-1", "--nccl_ctas must be in [0, 64], not -1"},
      {"--nccl_ctas=65", "--nccl_ctas must be in [0, 64], not 65"},
      {"--engine_api_key_file=/nonexistent/wpub-key",
       "--engine_api_key_file '/nonexistent/wpub-key' cannot be read"},
  };
  for (const auto& [flag, message] : cases) {
    std::string out;
    EXPECT_NE(RunWpubdToExit({flag, "--listen=127.0.0.1:0", "--metrics_listen="}, &out), 0) << flag;
    EXPECT_NE(out.find(message), std::string::npos) << flag << ": " << out;
  }
}

// The retained copy in device or pinned memory without the GPU path: wpubd exits naming the
// flag and what it needs, instead of publishing with no copy; an unknown place names the values.
TEST(Wpubd, ADeviceOrPinnedRetainedCopyWithoutTheGpuPathIsRefused) {
  const std::pair<const char*, const char*> cases[] = {
      {"--retain=device",
       "--retain=device keeps the copy in GPU-path memory: it needs the GPU "
       "path (--gpu_path or --engines)"},
      {"--retain=pinned", "--retain=pinned keeps the copy in GPU-path memory"},
      {"--retain=gpu", "'gpu' is not one of off, host, device, pinned"},
  };
  for (const auto& [flag, message] : cases) {
    std::string out;
    EXPECT_NE(RunWpubdToExit({flag, "--listen=127.0.0.1:0", "--metrics_listen="}, &out), 0) << flag;
    EXPECT_NE(out.find(message), std::string::npos) << flag << ": " << out;
  }
}

TEST(Wpubd, AnMmapThresholdOutsideGlibcsRangeIsRefused) {
  for (const char* flag : {"--malloc_mmap_threshold=1024", "--malloc_mmap_threshold=64MiB"}) {
    std::string out;
    EXPECT_NE(RunWpubdToExit({flag, "--listen=127.0.0.1:0", "--metrics_listen="}, &out), 0) << flag;
    EXPECT_NE(out.find("--malloc_mmap_threshold must be 0 or in [64 KiB, 32 MiB]"),
              std::string::npos)
        << flag << ": " << out;
  }
}

TEST(Wpubctl, DemoRunsEndToEndAndStopsCleanly) {
  char tmpl[] = "/tmp/wpub-demo-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::vector<std::string> args = {"demo", "--demo_versions=2",
                                   absl::StrCat("--wpubd_path=", WPUBD_PATH),
                                   absl::StrCat("--recv_path=", WPUB_RECV_PATH)};
  std::string out;
  ASSERT_EQ(RunWpubctl(tmpl, args, &out), 0) << out;
  EXPECT_NE(out.find("version status"), std::string::npos) << out;
  EXPECT_NE(out.find("2       committed"), std::string::npos) << out;
  EXPECT_NE(out.find("wpub_publications_total{status=\"committed\"} 2"), std::string::npos) << out;
  EXPECT_NE(out.find("wpubd stopped (exit 0)"), std::string::npos) << out;
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
}

}  // namespace
}  // namespace wpub::testing
