// Faults with real processes: a receiver that leaves mid-publication or corrupts a bucket (the
// publication aborts everywhere, the other receiver discards it), a trainer that cancels
// mid-stream, a concurrent second publisher (refused, or queued when it asks), and SIGTERM
// during a publication (exit 0, the publication finished or aborted).
#include <signal.h>

#include <atomic>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "clients/recv/safetensors.h"
#include "tests/daemon/harness.h"

namespace wpub::testing {
namespace {

namespace pb = ::wpub::v1;

class FaultsTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> daemon_flags = {}) {
    HarnessOptions options;
    options.receivers = 2;
    options.daemon_flags = {"--min_receivers=2", "--bucket_bytes=65536"};
    options.daemon_flags.insert(options.daemon_flags.end(), daemon_flags.begin(),
                                daemon_flags.end());
    auto h = DaemonHarness::Start(options);
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h);
    auto model = synthetic::SyntheticModel::Create(
        synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<synthetic::SyntheticModel>(std::move(*model));
    ASSERT_EQ(PublishStatus(1), pb::PUBLICATION_STATUS_COMMITTED);
    ASSERT_TRUE(harness_->WaitForReceiversAt(1).ok());
    for (int i = 0; i < 2; ++i) {
      auto file = WaitForFileVersion(harness_->recv_output(i), 1);
      ASSERT_TRUE(file.ok()) << file.status();
    }
  }

  absl::StatusOr<pb::PublicationReport> Publish(uint64_t version,
                                                client::PublisherClient* client = nullptr,
                                                const client::StreamOptions& stream = {},
                                                bool queue = false) {
    pb::PublicationHeader header = MakeHeader(TestSettings(), version);
    header.set_queue(queue);
    return (client ? client : &harness_->client())
        ->Publish(header, model_->batches(), client::SyntheticFiller(version), stream);
  }

  pb::PublicationStatus PublishStatus(uint64_t version) {
    auto report = Publish(version);
    if (!report.ok()) {
      ADD_FAILURE() << report.status();
      return pb::PUBLICATION_STATUS_UNSPECIFIED;
    }
    return report->status();
  }

  // The receiver's saved version (as the file's metadata says).
  std::string FileVersion(int i) {
    auto f = recv::ReadSafetensors(harness_->recv_output(i));
    return f.ok() ? f->metadata["version"] : f.status().ToString();
  }

  // The newest report once it is for `version` (the daemon may finish it after the RPC ended).
  absl::StatusOr<pb::PublicationReport> NewestReport(uint64_t version) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      auto reports = harness_->client().ListReports(1);
      if (reports.ok() && !reports->empty() && reports->front().version() == version) {
        return reports->front();
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError("no report");
  }

  std::unique_ptr<DaemonHarness> harness_;
  std::unique_ptr<synthetic::SyntheticModel> model_;
};

TEST_F(FaultsTest, ReceiverLeavingMidPublicationAbortsItEverywhere) {
  Start();
  ASSERT_TRUE(harness_->StartReceiver(1, {"--leave_after_buckets=1"}).ok());
  ASSERT_TRUE(harness_->WaitForReceivers(2).ok());

  auto report = Publish(2);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_ABORTED);
  EXPECT_NE(report->error_message().find("recv-1"), std::string::npos) << report->error_message();
  bool saw_leaver = false;
  for (const auto& r : report->receivers()) {
    EXPECT_FALSE(r.committed()) << r.name();
    if (r.name() == "recv-1") {
      saw_leaver = true;
      EXPECT_EQ(r.failure(), "disconnected");
    }
  }
  EXPECT_TRUE(saw_leaver);
  EXPECT_EQ(harness_->receiver(1).Wait(absl::Seconds(10)).value_or(-1), 3);

  // The other receiver discarded v2 and keeps v1; the daemon still serves v1.
  auto status = harness_->client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->committed_version(), 1u);
  EXPECT_EQ(FileVersion(0), "1");
  EXPECT_TRUE(harness_->receiver(0).Running());

  // A restarted receiver takes part in the retried version, which commits.
  ASSERT_TRUE(harness_->StartReceiver(1).ok());
  ASSERT_TRUE(harness_->WaitForReceivers(2).ok());
  EXPECT_EQ(PublishStatus(2), pb::PUBLICATION_STATUS_COMMITTED);
  EXPECT_TRUE(harness_->WaitForReceiversAt(2).ok());
}

TEST_F(FaultsTest, CorruptBucketAtOneReceiverAbortsTheVersion) {
  Start();
  ASSERT_TRUE(harness_->StartReceiver(1, {"--corrupt_bucket=0"}).ok());
  ASSERT_TRUE(harness_->WaitForReceivers(2).ok());
  auto report = Publish(2);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->status(), pb::PUBLICATION_STATUS_ABORTED);
  for (const auto& r : report->receivers()) {
    EXPECT_FALSE(r.committed());
    if (r.name() == "recv-1") {
      EXPECT_EQ(r.failure(), "checksum");
    }
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(FileVersion(0), "1");
  EXPECT_EQ(FileVersion(1), "1");
  auto metrics = ScrapeMetrics(harness_->metrics_port());
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ((*metrics)["wpub_engine_failures_total{reason=\"checksum\"}"], 1);
  EXPECT_EQ((*metrics)["wpub_publications_total{status=\"aborted\"}"], 1);
  EXPECT_EQ((*metrics)["wpub_last_committed_version"], 1);
}

TEST_F(FaultsTest, TrainerCancellingMidStreamAbortsThePublication) {
  Start();
  client::StreamOptions stream;
  stream.cancel_after_batches = 3;
  // Cancel only once the daemon has the publication open (client writes are buffered, so an
  // early cancel could end the RPC before the daemon read the header).
  stream.on_batch_sent = [&](size_t b) {
    if (b != 2) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      auto s = harness_->client().GetStatus();
      if (s.ok() && s->has_active()) return;
      absl::SleepFor(absl::Milliseconds(5));
    }
  };
  auto report = Publish(2, nullptr, stream);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kCancelled) << report.status();

  auto newest = NewestReport(2);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->status(), pb::PUBLICATION_STATUS_ABORTED);
  auto status = harness_->client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->committed_version(), 1u);
  EXPECT_EQ(FileVersion(0), "1");
  EXPECT_EQ(FileVersion(1), "1");
  // The daemon is free again: the same version now commits.
  EXPECT_EQ(PublishStatus(2), pb::PUBLICATION_STATUS_COMMITTED);
}

TEST_F(FaultsTest, ConcurrentSecondPublisherIsRefusedNamingTheActiveVersion) {
  Start();
  client::ClientOptions at;
  at.target = harness_->target();
  auto second = client::PublisherClient::Create(at);
  ASSERT_TRUE(second.ok());
  auto third = client::PublisherClient::Create(at);
  ASSERT_TRUE(third.ok());

  absl::Notification first_open, release;
  client::StreamOptions paused;
  paused.on_batch_sent = [&](size_t b) {
    if (b == 0) {
      first_open.Notify();
      release.WaitForNotification();
    }
  };
  auto first = std::async(std::launch::async, [&] { return Publish(2, nullptr, paused); });
  first_open.WaitForNotification();
  // The header and batch 0 are on the wire; wait until the daemon shows v2 active.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    auto s = harness_->client().GetStatus();
    if (s.ok() && s->has_active()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto refused = Publish(3, second->get());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("version 2"), absl::string_view::npos)
      << refused.status();

  // A publisher that asks to queue waits for v2 and then commits v3.
  auto queued =
      std::async(std::launch::async, [&] { return Publish(3, third->get(), {}, /*queue=*/true); });
  absl::SleepFor(absl::Milliseconds(200));
  release.Notify();
  auto first_report = first.get();
  ASSERT_TRUE(first_report.ok()) << first_report.status();
  EXPECT_EQ(first_report->status(), pb::PUBLICATION_STATUS_COMMITTED);
  auto queued_report = queued.get();
  ASSERT_TRUE(queued_report.ok()) << queued_report.status();
  EXPECT_EQ(queued_report->status(), pb::PUBLICATION_STATUS_COMMITTED);
  EXPECT_EQ(queued_report->version(), 3u);
  EXPECT_TRUE(harness_->WaitForReceiversAt(3).ok());
}

TEST_F(FaultsTest, SigtermDuringAPublicationExitsZero) {
  Start({"--drain_deadline=2s", "--shutdown_grace=2s"});
  absl::Notification in_flight, release;
  client::StreamOptions paused;
  paused.on_batch_sent = [&](size_t b) {
    if (b == 1) {
      in_flight.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(30));
    }
  };
  auto publication = std::async(std::launch::async, [&] { return Publish(2, nullptr, paused); });
  in_flight.WaitForNotification();
  harness_->daemon().Signal(SIGTERM);
  // The daemon stops advertising at once.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int health = 1;
  while (absl::Now() < deadline && health == 1) {
    health = HealthCheck(harness_->target()).value_or(-1);
    if (health == 1) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_NE(health, 1) << "still SERVING after SIGTERM";
  release.Notify();
  auto exit_code = harness_->daemon().Wait(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  auto report = publication.get();
  // Finished (committed) or aborted: never half-published.
  if (report.ok()) {
    EXPECT_NE(report->status(), pb::PUBLICATION_STATUS_UNSPECIFIED);
    if (report->status() == pb::PUBLICATION_STATUS_COMMITTED) {
      // The receivers apply the commit after the daemon announced it; give them a moment.
      for (int i = 0; i < 2; ++i) {
        const absl::Time deadline = absl::Now() + absl::Seconds(10);
        while (FileVersion(i) != "2" && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(20));
        }
        EXPECT_EQ(FileVersion(i), "2") << "recv-" << i;
      }
    }
  } else {
    EXPECT_EQ(FileVersion(0), "1");
    EXPECT_EQ(FileVersion(1), "1");
  }
}

TEST_F(FaultsTest, SecondReceiverWithATakenNameIsRefused) {
  Start();
  auto dup = client::ChildProcess::Spawn({WPUB_RECV_PATH,
                                          {"--target=" + harness_->target(), "--name=recv-0"},
                                          harness_->dir() + "/dup.log"});
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ((*dup)->Wait(absl::Seconds(20)).value_or(-1), 1);
  EXPECT_NE(harness_->ReadLog("dup").find("recv-0"), std::string::npos);
  EXPECT_EQ(PublishStatus(2), pb::PUBLICATION_STATUS_COMMITTED);
}

}  // namespace
}  // namespace wpub::testing
