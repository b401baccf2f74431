// ProcessCollector against this process, StatusCollector over fake statuses (in flight, idle,
// 70 receivers bounded to 64 with the rest counted, one-hot states, Detach), and EngineMetrics'
// series of failed and aborted publications and per-receiver failures (bounded).
#include "core/metrics/collectors.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/metrics/metrics.h"

namespace wpub::metrics {
namespace {

using prometheus::MetricFamily;

// name{label=value,...} -> value (counters and gauges; histograms as name_count).
std::map<std::string, double> Flatten(const std::vector<MetricFamily>& families) {
  std::map<std::string, double> out;
  for (const MetricFamily& f : families) {
    for (const prometheus::ClientMetric& m : f.metric) {
      std::string key = f.name;
      std::string labels;
      for (const auto& l : m.label)
        absl::StrAppend(&labels, labels.empty() ? "" : ",", l.name, "=", l.value);
      if (f.type == prometheus::MetricType::Histogram) {
        out[absl::StrCat(key, "_count{", labels, "}")] =
            static_cast<double>(m.histogram.sample_count);
        continue;
      }
      key = absl::StrCat(key, "{", labels, "}");
      out[key] = f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
  }
  return out;
}

TEST(ProcessCollector, ReadsThisProcess) {
  const auto m = Flatten(ProcessCollector().Collect());
  EXPECT_GT(m.at("process_resident_memory_bytes{}"), 1e6);
  EXPECT_GE(m.at("process_virtual_memory_bytes{}"), m.at("process_resident_memory_bytes{}"));
  EXPECT_GE(m.at("process_open_fds{}"), 3);
  EXPECT_GE(m.at("process_max_fds{}"), m.at("process_open_fds{}"));
  EXPECT_GE(m.at("process_cpu_seconds_total{}"), 0);
  const double now = static_cast<double>(absl::ToUnixMicros(absl::Now())) / 1e6;
  EXPECT_LE(m.at("process_start_time_seconds{}"), now + 2);
  EXPECT_GT(m.at("process_start_time_seconds{}"), now - 3600);
}

engine::EngineStatus Status(bool active, size_t receivers) {
  engine::EngineStatus s;
  if (active) {
    engine::ActivePublication a;
    a.version = 42;
    a.opened_at = absl::Now() - absl::Seconds(30);
    a.bytes_ingested = 1000;
    a.bytes_sent = 600;
    s.active = a;
  }
  for (size_t i = 0; i < receivers; ++i) {
    transport::ReceiverInfo r;
    r.name = absl::StrCat("recv-", 100 + i);
    r.state = i == 1 ? transport::ReceiverState::kDirty : transport::ReceiverState::kIdle;
    r.last_committed_version = i == 1 ? 40 : 41;
    s.receivers.push_back(r);
  }
  return s;
}

TEST(StatusCollector, ThePublicationInFlight) {
  StatusCollector c([] {
    engine::EngineStatus s = Status(true, 2);
    s.backend_held_bytes = 3 << 20;
    return s;
  });
  const auto m = Flatten(c.Collect());
  EXPECT_EQ(m.at("wpub_backend_held_bytes{}"), 3 << 20);
  EXPECT_EQ(m.at("wpub_publication_in_flight{}"), 1);
  EXPECT_EQ(m.at("wpub_publication_in_flight_version{}"), 42);
  EXPECT_GE(m.at("wpub_publication_in_flight_age_seconds{}"), 30);
  EXPECT_LT(m.at("wpub_publication_in_flight_age_seconds{}"), 300);
  EXPECT_EQ(m.at("wpub_publication_in_flight_bytes{stage=ingested}"), 1000);
  EXPECT_EQ(m.at("wpub_publication_in_flight_bytes{stage=sent}"), 600);
  EXPECT_EQ(m.at("wpub_receiver_last_committed_version{receiver=recv-101}"), 40);
  EXPECT_EQ(m.at("wpub_receiver_last_committed_version{receiver=recv-100}"), 41);
  EXPECT_EQ(m.at("wpub_receiver_state{receiver=recv-101,state=dirty}"), 1);
  EXPECT_EQ(m.at("wpub_receiver_state{receiver=recv-101,state=idle}"), 0);
  EXPECT_EQ(m.at("wpub_receiver_state{receiver=recv-100,state=idle}"), 1);
  EXPECT_EQ(m.at("wpub_receivers_unlisted{}"), 0);
}

TEST(StatusCollector, IdleAndBoundedAndDetached) {
  StatusCollector c([] { return Status(false, 70); });
  const auto m = Flatten(c.Collect());
  EXPECT_EQ(m.at("wpub_publication_in_flight{}"), 0);
  EXPECT_EQ(m.at("wpub_publication_in_flight_age_seconds{}"), 0);
  size_t listed = 0;
  for (const auto& [k, v] : m) listed += k.rfind("wpub_receiver_last_committed_version{", 0) == 0;
  EXPECT_EQ(listed, kMaxReceiverSeries);
  EXPECT_EQ(m.at("wpub_receivers_unlisted{}"), 6);
  // Name order: the first 64 names are listed.
  EXPECT_TRUE(m.count("wpub_receiver_state{receiver=recv-163,state=idle}"));
  EXPECT_FALSE(m.count("wpub_receiver_state{receiver=recv-164,state=idle}"));
  c.Detach();
  EXPECT_TRUE(c.Collect().empty());
}

engine::PublicationReport Report(engine::PublicationStatus status, double seconds,
                                 std::vector<std::string> failed) {
  engine::PublicationReport r;
  r.status = status;
  r.wall_seconds = seconds;
  for (const std::string& n : failed) {
    transport::ReceiverOutcome o;
    o.name = n;
    o.failure = transport::ReceiverFailure::kTimeout;
    r.receivers.push_back(o);
  }
  return r;
}

TEST(EngineMetrics, EveryOutcomesDurationAndBoundedReceiverFailures) {
  prometheus::Registry registry;
  auto m = EngineMetrics::Create(&registry);
  ASSERT_TRUE(m.ok()) << m.status();
  (*m)->OnReport(Report(engine::PublicationStatus::kAborted, 2.5, {"recv-a"}));
  (*m)->OnReport(Report(engine::PublicationStatus::kFailed, 0.1, {"recv-a", "recv-b"}));
  (*m)->OnReport(Report(engine::PublicationStatus::kCommitted, 1.0, {}));
  std::vector<std::string> many;
  for (int i = 0; i < 100; ++i) many.push_back(absl::StrCat("r", i));
  (*m)->OnReport(Report(engine::PublicationStatus::kAborted, 3.0, many));
  const auto v = Flatten(registry.Collect());
  EXPECT_EQ(v.at("wpub_publication_attempt_seconds_count{status=aborted}"), 2);
  EXPECT_EQ(v.at("wpub_publication_attempt_seconds_count{status=failed}"), 1);
  EXPECT_EQ(v.at("wpub_publication_attempt_seconds_count{status=committed}"), 1);
  EXPECT_EQ(v.at("wpub_publication_seconds_count{}"), 1);  // committed only, as before
  EXPECT_EQ(v.at("wpub_receiver_failures_total{receiver=recv-a}"), 2);
  EXPECT_EQ(v.at("wpub_receiver_failures_total{receiver=recv-b}"), 1);
  size_t series = 0;
  for (const auto& [k, x] : v) series += k.rfind("wpub_receiver_failures_total{", 0) == 0;
  EXPECT_EQ(series, kMaxReceiverFailureSeries + 1);  // 64 names and "_other"
  EXPECT_EQ(v.at("wpub_receiver_failures_total{receiver=_other}"), 100 - 62);
}

// A publication committed to nobody is counted (the alert WpubCommittedToNoReceiver reads it);
// one that reached a receiver, or that aborted with none, is not.
TEST(EngineMetrics, CommittedToNoReceiverIsCounted) {
  prometheus::Registry registry;
  auto m = EngineMetrics::Create(&registry);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Flatten(registry.Collect()).at("wpub_publications_without_receivers_total{}"), 0);
  engine::PublicationReport reached = Report(engine::PublicationStatus::kCommitted, 1.0, {});
  reached.receivers.push_back(transport::ReceiverOutcome{});
  reached.receivers.back().name = "engine-0";
  reached.receivers.back().committed = true;
  (*m)->OnReport(reached);
  (*m)->OnReport(Report(engine::PublicationStatus::kAborted, 1.0, {}));
  (*m)->OnReport(Report(engine::PublicationStatus::kCommitted, 1.0, {}));
  (*m)->OnReport(Report(engine::PublicationStatus::kCommitted, 1.0, {}));
  EXPECT_EQ(Flatten(registry.Collect()).at("wpub_publications_without_receivers_total{}"), 2);
}

// How far each receiver is behind the committed version (a dirty engine holds none), and what
// the retained copy holds.
TEST(StatusCollector, VersionsBehindAndTheRetainedCopy) {
  StatusCollector c([] {
    engine::EngineStatus s = Status(false, 3);
    s.committed_version = 41;
    s.receivers[0].held_version = 41;  // current
    s.receivers[1].held_version = 41;  // dirty: holds none whole
    s.receivers[2].held_version = 38;  // joined behind
    s.retained.where = transport::RetainWhere::kPinned;
    s.retained.version = 41;
    s.retained.bytes = 123456;
    s.retained.held_bytes = 2 * 123456 + 4096;
    return s;
  });
  const auto m = Flatten(c.Collect());
  EXPECT_EQ(m.at("wpub_receiver_versions_behind{receiver=recv-100}"), 0);
  EXPECT_EQ(m.at("wpub_receiver_versions_behind{receiver=recv-101}"), 41);
  EXPECT_EQ(m.at("wpub_receiver_versions_behind{receiver=recv-102}"), 3);
  EXPECT_EQ(m.at("wpub_receiver_held_version{receiver=recv-101}"), 0);
  EXPECT_EQ(m.at("wpub_receiver_held_version{receiver=recv-102}"), 38);
  EXPECT_EQ(m.at("wpub_retained_bytes{where=pinned}"), 123456);
  EXPECT_EQ(m.at("wpub_retained_held_bytes{where=pinned}"), 2 * 123456 + 4096);
  EXPECT_EQ(m.at("wpub_retained_version{}"), 41);
}

// Every engine paused and resumed in a publication: its window, by family and part; one still
// paused (dirty) is not observed. Replays by kind and outcome, seconds of completed ones.
TEST(EngineMetrics, PauseWindowsAndReplays) {
  prometheus::Registry registry;
  auto m = EngineMetrics::Create(&registry);
  ASSERT_TRUE(m.ok()) << m.status();
  engine::PublicationReport r = Report(engine::PublicationStatus::kCommitted, 2.0, {});
  for (const char* family : {"sglang", "vllm", "vllm"}) {
    transport::ReceiverOutcome o;
    o.name = absl::StrCat("http://", family, r.receivers.size());
    o.family = family;
    o.pause = {.paused = true,
               .resumed = true,
               .seconds = 1.0,
               .waiting = 0.1,
               .transfer = 0.7,
               .finalization = 0.2};
    r.receivers.push_back(o);
  }
  r.receivers.back().pause.resumed = false;  // still paused: no window to observe
  (*m)->OnReport(r);
  engine::ReplayReport done;
  done.kind = engine::ReplayKind::kRestore;
  done.completed = true;
  done.seconds = 0.5;
  (*m)->OnReplay(done);
  engine::ReplayReport preempted;
  preempted.kind = engine::ReplayKind::kCatchUp;
  preempted.preempted = true;
  (*m)->OnReplay(preempted);
  const auto v = Flatten(registry.Collect());
  for (const char* part : {"total", "waiting", "transfer", "finalization"}) {
    EXPECT_EQ(v.at(absl::StrCat("wpub_engine_paused_seconds_count{family=sglang,part=", part, "}")),
              1)
        << part;
    EXPECT_EQ(v.at(absl::StrCat("wpub_engine_paused_seconds_count{family=vllm,part=", part, "}")),
              1)
        << part;
  }
  EXPECT_EQ(v.at("wpub_replays_total{kind=restore,outcome=completed}"), 1);
  EXPECT_EQ(v.at("wpub_replays_total{kind=catch_up,outcome=preempted}"), 1);
  EXPECT_EQ(v.at("wpub_replays_total{kind=catch_up,outcome=completed}"), 0);
  EXPECT_EQ(v.at("wpub_replay_seconds_count{kind=restore}"), 1);
  EXPECT_EQ(v.at("wpub_replay_seconds_count{kind=catch_up}"), 0);
}

}  // namespace
}  // namespace wpub::metrics
