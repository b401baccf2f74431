// wpub-recv's promises with real processes: an --output it cannot write is found at start-up;
// a version it cannot stage (a file-size limit, its directory gone) makes the publication ABORT
// instead of a COMMITTED report for a receiver that then cannot apply it; and across a daemon
// restart (and its own) it holds its version, so a restarted wpubd cannot take it backwards.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/recv/safetensors.h"
#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;
using recv::SafetensorsEntry;

class RecvOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = synthetic::SyntheticModel::Create(
        synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<synthetic::SyntheticModel>(std::move(*model));
  }

  // A daemon from the shared harness with no receivers of its own.
  void StartHarness() {
    HarnessOptions options;
    options.receivers = 0;
    options.daemon_flags = {"--min_receivers=1", "--bucket_bytes=65536"};
    auto h = DaemonHarness::Start(options);
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h);
  }

  absl::StatusOr<pb::PublicationReport> Publish(client::PublisherClient& client, uint64_t version) {
    return client.Publish(MakeHeader(TestSettings(), version), model_->batches(),
                          client::SyntheticFiller(version), {});
  }

  // wpub-recv with `args`, optionally under a shell that first sets `ulimit` arguments.
  std::unique_ptr<client::ChildProcess> SpawnRecv(const std::vector<std::string>& args,
                                                  const std::string& log,
                                                  const std::string& ulimit = "") {
    client::SpawnOptions spawn{WPUB_RECV_PATH, args, log};
    if (!ulimit.empty()) {
      spawn.path = "/bin/sh";
      spawn.args = {"-c", absl::StrCat("ulimit ", ulimit, " && exec \"$0\" \"$@\""),
                    WPUB_RECV_PATH};
      spawn.args.insert(spawn.args.end(), args.begin(), args.end());
    }
    auto child = client::ChildProcess::Spawn(spawn);
    EXPECT_TRUE(child.ok()) << child.status();
    return child.ok() ? std::move(*child) : nullptr;
  }

  std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Whether the log at `path` holds `text` within 30 s: a receiver logs what it did with a
  // version right after the output file shows it, so the test waits for the line itself.
  bool WaitForLogLine(const std::string& path, const std::string& text) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!absl::StrContains(ReadFile(path), text)) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  // Files in `dir` whose name starts with `prefix` (staging leftovers).
  static std::vector<std::string> FilesStartingWith(const std::string& dir,
                                                    const std::string& prefix) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (absl::StartsWith(name, prefix)) out.push_back(name);
    }
    return out;
  }

  std::unique_ptr<synthetic::SyntheticModel> model_;
  std::unique_ptr<DaemonHarness> harness_;
};

TEST_F(RecvOutputTest, AnUnwritableOutputFailsAtStart) {
  StartHarness();
  const std::string dir = harness_->dir();
  ASSERT_EQ(::mkdir((dir + "/a-directory").c_str(), 0755), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir + "/no/such/dir/model.safetensors", "not writable"},
      {dir + "/a-directory", "is a directory"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [output, why] = cases[i];
    SCOPED_TRACE(output);
    const std::string log = absl::StrCat(dir, "/bad-", i, ".log");
    auto recv = SpawnRecv(
        {"--target=" + harness_->target(), absl::StrCat("--name=bad-", i), "--output=" + output},
        log);
    ASSERT_NE(recv, nullptr);
    // It never subscribes: it exits with the usage/configuration code, naming the path.
    EXPECT_EQ(recv->Wait(absl::Seconds(30)).value_or(-1), 2);
    const std::string text = ReadFile(log);
    EXPECT_TRUE(absl::StrContains(text, output)) << text;
    EXPECT_TRUE(absl::StrContains(text, why)) << text;
  }
  auto status = harness_->client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->receivers_size(), 0);
}

// A file-size limit below the model's size: staging fails before the last acknowledgement, the
// receiver leaves, and the publication aborts. (Before staging, the receiver acknowledged
// everything, the daemon reported COMMITTED, and only then the write failed.)
TEST_F(RecvOutputTest, AFileSizeLimitDuringStagingAbortsThePublication) {
  StartHarness();
  const std::string output = harness_->dir() + "/limited.safetensors";
  // sh's ulimit -f counts 512-byte blocks: 32 KiB, far below the model's file.
  auto recv = SpawnRecv({"--target=" + harness_->target(), "--name=limited", "--output=" + output},
                        harness_->dir() + "/limited.log", "-f 64");
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(1).ok());
  auto report = Publish(harness_->client(), 1);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_ABORTED) << report->error_message();
  ASSERT_EQ(report->receivers_size(), 1);
  EXPECT_FALSE(report->receivers(0).committed());
  EXPECT_EQ(recv->Wait(absl::Seconds(30)).value_or(-1), 1);
  const std::string log = ReadFile(harness_->dir() + "/limited.log");
  EXPECT_TRUE(absl::StrContains(log, "cannot stage v1")) << log;
  EXPECT_FALSE(std::filesystem::exists(output));
  EXPECT_TRUE(FilesStartingWith(harness_->dir(), "limited.safetensors.").empty());
  auto status = harness_->client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->committed_version(), 0u);
}

// The output directory disappears after start-up (the failure a permission change or an
// unmounted volume causes): the version cannot be staged, so it is not committed.
TEST_F(RecvOutputTest, AnOutputDirectoryGoneAfterStartAbortsThePublication) {
  StartHarness();
  const std::string out_dir = harness_->dir() + "/volume";
  ASSERT_EQ(::mkdir(out_dir.c_str(), 0755), 0);
  auto recv = SpawnRecv(
      {"--target=" + harness_->target(), "--name=gone", "--output=" + out_dir + "/m.safetensors"},
      harness_->dir() + "/gone.log");
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(1).ok());
  std::filesystem::remove_all(out_dir);
  auto report = Publish(harness_->client(), 1);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_ABORTED) << report->error_message();
  EXPECT_EQ(recv->Wait(absl::Seconds(30)).value_or(-1), 1);
}

// A receiver with a writable output commits, and leaves no staging file behind.
TEST_F(RecvOutputTest, ACommittedVersionIsRenamedIntoPlace) {
  StartHarness();
  const std::string output = harness_->dir() + "/ok.safetensors";
  auto recv = SpawnRecv({"--target=" + harness_->target(), "--name=ok", "--output=" + output},
                        harness_->dir() + "/ok.log");
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(1).ok());
  for (uint64_t v : {1u, 2u}) {
    auto report = Publish(harness_->client(), v);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    ASSERT_TRUE(WaitForFileVersion(output, v).ok());
  }
  EXPECT_TRUE(FilesStartingWith(harness_->dir(), "ok.safetensors.").empty());
}

// A receiver killed while it held a staged copy leaves `<output>.staging-<pid>` behind; the next
// receiver of that output removes it (its process is gone) and keeps a live process's file.
TEST_F(RecvOutputTest, AStagingFileOfADeadReceiverIsRemovedAtStart) {
  StartHarness();
  const std::string dir = harness_->dir();
  const std::string output = dir + "/o.safetensors";
  // A pid that no process holds: the highest the kernel would give, and then some.
  const std::string dead = output + ".staging-2147483646";
  const std::string alive = absl::StrCat(output, ".staging-", ::getpid());  // this test's own
  std::ofstream(dead) << std::string(4096, 'x');
  std::ofstream(alive) << "live";
  auto recv = SpawnRecv({"--target=" + harness_->target(), "--name=o", "--output=" + output},
                        dir + "/o.log");
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(1).ok());
  EXPECT_FALSE(std::filesystem::exists(dead)) << "an orphaned staging file stayed on disk";
  EXPECT_TRUE(std::filesystem::exists(alive)) << "a live process's staging file was removed";
  EXPECT_TRUE(absl::StrContains(ReadFile(dir + "/o.log"), "that is gone (incomplete)"));
  std::filesystem::remove(alive);
}

// A receiver killed between its last acknowledgement and applying the version leaves the version
// staged: the next receiver process of that output adopts it and asks the daemon, which says
// whether it committed -- applied (the daemon's report named it committed) or discarded (a
// version the daemon never committed, decided by the next publication's committed version).
TEST_F(RecvOutputTest, AVersionStagedByAKilledReceiverIsAppliedOrDiscardedAsTheDaemonSays) {
  StartHarness();
  const std::string dir = harness_->dir();
  const std::string a = dir + "/a.safetensors";
  auto recv_a =
      SpawnRecv({"--target=" + harness_->target(), "--name=a", "--output=" + a}, dir + "/a.log");
  ASSERT_NE(recv_a, nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(1).ok());
  for (uint64_t v : {1u, 2u}) {
    auto report = Publish(harness_->client(), v);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  }
  ASSERT_TRUE(WaitForFileVersion(a, 2).ok());
  // b died holding v2 staged (committed); c died holding v9 staged (never committed).
  const std::string b = dir + "/b.safetensors", c = dir + "/c.safetensors";
  std::filesystem::copy_file(a, b + ".staging-2147483646");
  const std::vector<uint8_t> bytes(8, 1);
  SafetensorsEntry e{TensorDesc{"w", DType::kBFloat16, {4}}, bytes};
  ASSERT_TRUE(recv::WriteSafetensors(c + ".staging-2147483645", {e}, {{"version", "9"}}).ok());
  auto recv_b =
      SpawnRecv({"--target=" + harness_->target(), "--name=b", "--output=" + b}, dir + "/b.log");
  auto recv_c =
      SpawnRecv({"--target=" + harness_->target(), "--name=c", "--output=" + c}, dir + "/c.log");
  ASSERT_TRUE(recv_b != nullptr && recv_c != nullptr);
  ASSERT_TRUE(harness_->WaitForReceivers(3).ok());
  ASSERT_TRUE(WaitForFileVersion(b, 2).ok()) << ReadFile(dir + "/b.log");
  EXPECT_TRUE(FilesStartingWith(dir, "b.safetensors.").empty());
  EXPECT_TRUE(WaitForLogLine(dir + "/b.log", "applied v2, staged before"))
      << ReadFile(dir + "/b.log");
  // The daemon has no record of v9: c keeps it staged (in doubt), its output untouched.
  EXPECT_FALSE(std::filesystem::exists(c));
  EXPECT_EQ(FilesStartingWith(dir, "c.safetensors.staging-").size(), 1u);
  auto report = Publish(harness_->client(), 3);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  for (const std::string& out : {a, b, c}) EXPECT_TRUE(WaitForFileVersion(out, 3).ok()) << out;
  EXPECT_TRUE(FilesStartingWith(dir, "c.safetensors.").empty());
  EXPECT_TRUE(WaitForLogLine(dir + "/c.log", "discarded v9, staged before"))
      << ReadFile(dir + "/c.log");
}

// A wpubd of its own on a Unix socket, so a restart listens at the same address.
class RestartTest : public RecvOutputTest {
 protected:
  void SetUp() override {
    RecvOutputTest::SetUp();
    char tmpl[] = "/tmp/wpub-restart-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    target_ = "unix:" + dir_ + "/wpubd.sock";
  }
  void TearDown() override {
    if (recv_) recv_->Stop();
    if (daemon_) daemon_->Stop(absl::Seconds(30));
    if (HasFailure()) {
      std::cerr << ReadFile(dir_ + "/wpubd.log") << ReadFile(dir_ + "/recv.log");
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  void StartDaemon() {
    const std::string ready = absl::StrCat(dir_, "/ready-", ++starts_, ".json");
    auto d = client::ChildProcess::Spawn(
        {WPUBD_PATH,
         {"--listen=" + target_, "--metrics_listen=", "--ready_file=" + ready, "--log_level=debug"},
         dir_ + "/wpubd.log"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    ASSERT_TRUE(client::WaitForReadyFile(ready, daemon_.get(), absl::Seconds(30)).ok());
    client::ClientOptions options;
    options.target = target_;
    auto c = client::PublisherClient::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  void StopDaemon() {
    client_.reset();
    EXPECT_EQ(daemon_->Stop(absl::Seconds(30)), 0);
    daemon_.reset();
  }
  void StartRecv() {
    recv_ = SpawnRecv({"--target=" + target_, "--name=recv-0", "--output=" + output()},
                      dir_ + "/recv.log");
    ASSERT_NE(recv_, nullptr);
  }

  // Waits until the daemon lists the receiver (it subscribes again on its own after a restart).
  void WaitForReceiver() {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      auto s = client_->GetStatus();
      if (s.ok() && s->receivers_size() == 1) return;
      ASSERT_LT(absl::Now(), deadline) << "the receiver did not subscribe";
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  void ExpectRefused(uint64_t version, uint64_t held) {
    auto report = Publish(*client_, version);
    ASSERT_FALSE(report.ok()) << "v" << version << " was accepted";
    EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition) << report.status();
    EXPECT_TRUE(absl::StrContains(report.status().message(), "recv-0")) << report.status();
    EXPECT_TRUE(absl::StrContains(report.status().message(), absl::StrCat("version ", held)))
        << report.status();
  }
  void ExpectCommitted(uint64_t version) {
    auto report = Publish(*client_, version);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
    ASSERT_TRUE(WaitForFileVersion(output(), version).ok());
  }
  std::string output() const { return dir_ + "/recv.safetensors"; }
  std::string FileVersion() {
    auto f = recv::ReadSafetensors(output());
    return f.ok() ? f->metadata["version"] : f.status().ToString();
  }

  std::string dir_;
  std::string target_;
  int starts_ = 0;
  std::unique_ptr<client::ChildProcess> daemon_;
  std::unique_ptr<client::ChildProcess> recv_;
  std::unique_ptr<client::PublisherClient> client_;
};

TEST_F(RestartTest, ARestartedDaemonCannotTakeAReceiverBackwards) {
  StartDaemon();
  StartRecv();
  WaitForReceiver();
  ExpectCommitted(5);

  // The daemon restarts and forgets v5; the receiver stays up and subscribes again holding it.
  StopDaemon();
  EXPECT_TRUE(recv_->Running());
  StartDaemon();
  WaitForReceiver();
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->committed_version(), 0u);
  ExpectRefused(1, 5);
  ExpectRefused(5, 5);
  EXPECT_EQ(FileVersion(), "5");
  ExpectCommitted(6);

  // Both restart: the receiver reads the version its file records.
  recv_->Stop();
  StopDaemon();
  StartDaemon();
  StartRecv();
  WaitForReceiver();
  ExpectRefused(2, 6);
  EXPECT_EQ(FileVersion(), "6");
  ExpectCommitted(7);
  EXPECT_EQ(recv_->Stop(), 0);
  const std::string log = ReadFile(dir_ + "/recv.log");
  EXPECT_TRUE(absl::StrContains(log, "subscribing again")) << log;
}

}  // namespace
}  // namespace wpub::testing
