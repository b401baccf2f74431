// PullTransport's event delivery at shutdown: what was queued before still reaches receivers.
#include "core/engine/pull_transport.h"

#include <gtest/gtest.h>

#include <variant>

namespace wpub::engine {
namespace {

TEST(PullTransportTest, EventsQueuedBeforeShutdownAreStillDelivered) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok()) << transport.status();
  auto sub = (*transport)->Subscribe("r0");
  ASSERT_TRUE(sub.ok()) << sub.status();
  PublicationManifest manifest;
  manifest.version = 7;
  ASSERT_TRUE((*transport)->Begin(manifest).ok());
  (*transport)->Shutdown();  // aborts version 7: the abort is queued behind the manifest

  std::vector<size_t> kinds;
  uint64_t aborted = 0;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<ReceiverEvent> e = (*sub)->Next(absl::Milliseconds(200));
    if (!e.ok()) {
      EXPECT_EQ(e.status().code(), absl::StatusCode::kCancelled) << e.status();
      break;
    }
    kinds.push_back(e->index());
    if (const auto* a = std::get_if<AbortEvent>(&*e)) aborted = a->version;
  }
  ASSERT_GE(kinds.size(), 3u);
  EXPECT_EQ(kinds.front(), ReceiverEvent(GroupInfoEvent{}).index());
  EXPECT_EQ(kinds[1], ReceiverEvent(ManifestEvent{}).index());
  EXPECT_EQ(kinds.back(), ReceiverEvent(AbortEvent{}).index());
  EXPECT_EQ(aborted, 7u);
  // Drained: the next call reports the shutdown at once.
  absl::StatusOr<ReceiverEvent> after = (*sub)->Next(absl::Seconds(5));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kCancelled);
}

TEST(PullTransportTest, AClosedSubscriptionGetsNoMoreEvents) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("r0");
  ASSERT_TRUE(sub.ok());
  (*sub)->Cancel();  // its own RPC went away: queued events are moot
  EXPECT_EQ((*sub)->Next(absl::Seconds(5)).status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace wpub::engine
