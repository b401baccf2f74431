// No client can hold the daemon, with real processes: a trainer that stalls mid-stream (no
// deadline) has its publication aborted after --ingest_idle_timeout and the next publication
// proceeds; a SIGSTOPped wpub-recv stops answering HTTP/2 keepalive pings, is dropped, and
// another receiver takes its name.
#include <signal.h>

#include <thread>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tests/daemon/harness.h"
#include "wpub/v1/publisher.grpc.pb.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

// Waits (bounded only so that a regression fails instead of hanging) until the newest report
// is for `version` with `status`.
absl::StatusOr<pb::PublicationReport> WaitForReport(client::PublisherClient& client,
                                                    uint64_t version,
                                                    pb::PublicationStatus status) {
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (absl::Now() < deadline) {
    auto reports = client.ListReports(1);
    if (reports.ok() && !reports->empty() && reports->front().version() == version &&
        reports->front().status() == status) {
      return reports->front();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("no report of v", version, " with ", status));
}

TEST(Stall, TrainerSilentAfterTheHeaderIsAbortedAndTheNextPublicationProceeds) {
  HarnessOptions options;
  options.receivers = 1;
  options.daemon_flags = {"--ingest_idle_timeout=1s"};
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();

  // A raw stream: header sent, then nothing, no deadline, the stream left open.
  auto channel = grpc::CreateChannel((*h)->target(), grpc::InsecureChannelCredentials());
  auto stub = pb::Publisher::NewStub(channel);
  grpc::ClientContext context;
  pb::PublicationReport reply;
  std::unique_ptr<grpc::ClientWriter<pb::PublishRequest>> writer = stub->Publish(&context, &reply);
  pb::PublishRequest header;
  *header.mutable_header() = MakeHeader(TestSettings(), 1);
  ASSERT_TRUE(writer->Write(header));

  auto report = WaitForReport((*h)->client(), 1, pb::PUBLICATION_STATUS_ABORTED);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NE(report->error_message().find("--ingest_idle_timeout"), std::string::npos)
      << report->error_message();
  EXPECT_FALSE(writer->Finish().ok());

  auto model = synthetic::SyntheticModel::Create(
      synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
  ASSERT_TRUE(model.ok()) << model.status();
  auto next = (*h)->client().Publish(MakeHeader(TestSettings(), 2), model->batches(),
                                     client::SyntheticFiller(2), {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->status(), pb::PUBLICATION_STATUS_COMMITTED) << next->error_message();
  EXPECT_TRUE((*h)->WaitForReceiversAt(2).ok());
}

TEST(Stall, TrainerStalledMidStreamIsAbortedAndTheNextPublicationProceeds) {
  HarnessOptions options;
  options.receivers = 1;
  options.daemon_flags = {"--ingest_idle_timeout=1s"};
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  auto model = synthetic::SyntheticModel::Create(
      synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
  ASSERT_TRUE(model.ok()) << model.status();

  // The trainer's client (no deadline) stalls after its first batch until the daemon gave up.
  client::ClientOptions client_options;
  client_options.target = (*h)->target();
  auto stalled_client = client::PublisherClient::Create(client_options);
  ASSERT_TRUE(stalled_client.ok()) << stalled_client.status();
  absl::Notification aborted;
  client::StreamOptions stall;
  stall.on_batch_sent = [&](size_t batch) {
    if (batch == 0) aborted.WaitForNotification();
  };
  absl::StatusOr<pb::PublicationReport> stalled;
  std::thread trainer([&] {
    stalled = (*stalled_client)
                  ->Publish(MakeHeader(TestSettings(), 1), model->batches(),
                            client::SyntheticFiller(1), stall);
  });
  auto report = WaitForReport((*h)->client(), 1, pb::PUBLICATION_STATUS_ABORTED);
  aborted.Notify();
  trainer.join();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NE(report->error_message().find("--ingest_idle_timeout"), std::string::npos)
      << report->error_message();
  EXPECT_FALSE(stalled.ok() && stalled->status() == pb::PUBLICATION_STATUS_COMMITTED);

  auto next = (*h)->client().Publish(MakeHeader(TestSettings(), 2), model->batches(),
                                     client::SyntheticFiller(2), {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->status(), pb::PUBLICATION_STATUS_COMMITTED) << next->error_message();
}

TEST(Stall, StoppedReceiverIsDroppedAndAnotherTakesItsName) {
  HarnessOptions options;
  options.receivers = 1;
  options.daemon_flags = {"--keepalive_time=500ms", "--keepalive_timeout=500ms"};
  auto h = DaemonHarness::Start(options);
  ASSERT_TRUE(h.ok()) << h.status();
  client::ChildProcess& stopped = (*h)->receiver(0);

  stopped.Signal(SIGSTOP);
  // Its connection stays open (the kernel still acknowledges TCP) but pings go unanswered.
  ASSERT_TRUE((*h)->WaitForReceivers(0, absl::Seconds(90)).ok());

  auto replacement =
      client::ChildProcess::Spawn({WPUB_RECV_PATH,
                                   {"--target=" + (*h)->target(), "--name=recv-0",
                                    "--output=" + (*h)->dir() + "/replacement.safetensors"},
                                   (*h)->dir() + "/replacement.log"});
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  ASSERT_TRUE((*h)->WaitForReceivers(1).ok()) << (*h)->ReadLog("replacement");
  auto model = synthetic::SyntheticModel::Create(
      synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
  ASSERT_TRUE(model.ok()) << model.status();
  auto report = (*h)->client().Publish(MakeHeader(TestSettings(), 1), model->batches(),
                                       client::SyntheticFiller(1), {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_COMMITTED) << report->error_message();
  EXPECT_TRUE(WaitForFileVersion((*h)->dir() + "/replacement.safetensors", 1).ok());

  stopped.Signal(SIGKILL);
  EXPECT_TRUE(stopped.Wait(absl::Seconds(30)).ok());
  (*replacement)->Stop();
}

}  // namespace
}  // namespace wpub::testing
