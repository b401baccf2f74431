// PullTransport: event delivery at shutdown (what was queued before still reaches receivers),
// subscription tokens (pulls and acknowledgements bound to the subscription), receiver names,
// the versions receivers hold (the engine refuses to take one backwards), and patches (offered
// per receiver; a publication whose receivers all take patches takes device buckets without
// their bytes through the transport group).
#include "core/transport/pull_transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <optional>
#include <set>
#include <variant>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/transport/checksum.h"
#include "core/transport/testing/inproc_receiver.h"
#include "core/transport/testing/quiet_transport.h"
#include "core/transport/transport_group.h"

namespace wpub::transport {
namespace {

// The GroupInfoEvent a new subscription starts with.
GroupInfoEvent FirstEvent(Subscription& sub) {
  absl::StatusOr<ReceiverEvent> e = sub.Next(absl::Seconds(10));
  EXPECT_TRUE(e.ok()) << e.status();
  const auto* info = e.ok() ? std::get_if<GroupInfoEvent>(&*e) : nullptr;
  EXPECT_NE(info, nullptr);
  return info ? *info : GroupInfoEvent{};
}

// A one-bucket publication of version `version` whose bucket is staged.
std::shared_ptr<const Bucket> BeginOneBucket(PullTransport& transport, uint64_t version) {
  auto bucket = std::make_shared<Bucket>();
  bucket->version = version;
  bucket->bytes = {1, 2, 3, 4, 5, 6, 7, 8};
  bucket->manifest.index = 0;
  bucket->manifest.nbytes = bucket->bytes.size();
  bucket->manifest.checksum = Checksum(bucket->bytes.data(), bucket->bytes.size());
  PublicationManifest manifest;
  manifest.version = version;
  manifest.buckets.push_back(bucket->manifest);
  EXPECT_TRUE(transport.Begin(manifest).ok());
  EXPECT_TRUE(transport.Send(bucket).ok());
  return bucket;
}

ReceiverOutcome OutcomeOf(const PullTransport& transport, const std::string& name) {
  for (const ReceiverOutcome& o : transport.Outcomes()) {
    if (o.name == name) return o;
  }
  ADD_FAILURE() << "no outcome for " << name;
  return {};
}

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

// A receiver claiming a version beyond any publishable one would hold every publication back
// while connected (each must go beyond the highest version a receiver holds).
// A sink that records what it is handed and, like a server's writer, holds each item until
// the test says the write is done (Done: takes the next, or goes idle).
class RecordingSink final : public SubscriptionSink {
 public:
  explicit RecordingSink(Subscription* sub) : sub_(sub) {}
  void Deliver(absl::StatusOr<ReceiverEvent> item) override {
    std::lock_guard lock(mu_);
    EXPECT_FALSE(busy_) << "an item was delivered while another was held";
    busy_ = true;
    items_.push_back(std::move(item));
  }
  // The held item is written: takes the next. False when the sink went idle.
  bool Done() {
    {
      std::lock_guard lock(mu_);
      EXPECT_TRUE(busy_);
    }
    std::optional<absl::StatusOr<ReceiverEvent>> next = sub_->Take();
    std::lock_guard lock(mu_);
    if (!next.has_value()) {
      busy_ = false;
      return false;
    }
    items_.push_back(*std::move(next));
    return true;
  }
  std::vector<absl::StatusOr<ReceiverEvent>> items() {
    std::lock_guard lock(mu_);
    return items_;
  }
  bool busy() {
    std::lock_guard lock(mu_);
    return busy_;
  }

 private:
  Subscription* const sub_;
  std::mutex mu_;
  bool busy_ = false;
  std::vector<absl::StatusOr<ReceiverEvent>> items_;
};

size_t KindOf(const absl::StatusOr<ReceiverEvent>& item) {
  return item.ok() ? item->index() : std::variant_size_v<ReceiverEvent>;
}

// The push half: an attached sink is handed the group info at once, then each event as the
// transport produces it -- one at a time, the rest taken in order once it is done, nothing lost
// when it goes idle in between -- and finally the end (CANCELLED after a close, whether the sink
// was idle or busy when it came).
TEST(PullTransportTest, AnAttachedSinkIsHandedEveryEventOnceInOrderThenTheEnd) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("r0");
  ASSERT_TRUE(sub.ok());
  RecordingSink sink(sub->get());
  (*sub)->Attach(&sink);
  ASSERT_EQ(sink.items().size(), 1u);  // the group info, from Attach
  EXPECT_EQ(KindOf(sink.items()[0]), ReceiverEvent(GroupInfoEvent{}).index());
  // Busy: the manifest and the abort wait in the queue.
  PublicationManifest manifest;
  manifest.version = 3;
  ASSERT_TRUE((*transport)->Begin(manifest).ok());
  (*transport)->Abort("test");
  EXPECT_EQ(sink.items().size(), 1u);
  EXPECT_TRUE(sink.Done());   // the manifest
  EXPECT_TRUE(sink.Done());   // the abort
  EXPECT_FALSE(sink.Done());  // idle
  // Idle: the next event is handed over by the thread that produced it.
  manifest.version = 4;
  ASSERT_TRUE((*transport)->Begin(manifest).ok());
  std::vector<absl::StatusOr<ReceiverEvent>> items = sink.items();
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(KindOf(items[1]), ReceiverEvent(ManifestEvent{}).index());
  EXPECT_EQ(KindOf(items[2]), ReceiverEvent(AbortEvent{}).index());
  EXPECT_EQ(KindOf(items[3]), ReceiverEvent(ManifestEvent{}).index());
  // Busy with that manifest when the receiver leaves: the end comes from Take.
  (*sub)->Close();
  EXPECT_EQ(sink.items().size(), 4u);
  EXPECT_TRUE(sink.Done());
  items = sink.items();
  ASSERT_EQ(items.size(), 5u);
  EXPECT_EQ(items[4].status().code(), absl::StatusCode::kCancelled) << items[4].status();
  (*sub)->Detach();

  // Idle when the receiver leaves: the end is handed over at once.
  auto other = (*transport)->Subscribe("r1");
  ASSERT_TRUE(other.ok());
  RecordingSink idle(other->get());
  (*other)->Attach(&idle);
  EXPECT_FALSE(idle.Done());
  (*other)->Close();
  ASSERT_EQ(idle.items().size(), 2u);
  EXPECT_EQ(idle.items()[1].status().code(), absl::StatusCode::kCancelled);
  (*other)->Detach();
}

// A sink is handed its items after the transport's lock is released: one that reads the
// transport from Deliver (as a server converting a manifest takes its time) neither deadlocks
// nor holds up the other receivers.
TEST(PullTransportTest, ASinkIsHandedItsItemsOutsideTheTransportsLock) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("reader");
  ASSERT_TRUE(sub.ok());
  class ReadingSink final : public SubscriptionSink {
   public:
    explicit ReadingSink(PullTransport* t) : t_(t) {}
    void Deliver(absl::StatusOr<ReceiverEvent>) override {
      receivers_seen.push_back(t_->Receivers().size());  // takes the transport's lock
    }
    std::vector<size_t> receivers_seen;

   private:
    PullTransport* t_;
  } sink(transport->get());
  (*sub)->Attach(&sink);  // the group info
  EXPECT_EQ(sink.receivers_seen, std::vector<size_t>{1});
  EXPECT_FALSE((*sub)->Take().has_value());  // idle
  PublicationManifest manifest;
  manifest.version = 2;
  ASSERT_TRUE((*transport)->Begin(manifest).ok());  // the manifest, from Begin's thread
  EXPECT_EQ(sink.receivers_seen, (std::vector<size_t>{1, 1}));
  (*sub)->Detach();
}

// A sink that stops taking its events is dropped at the transport's queue bound, like a reader
// that stopped calling Next: RESOURCE_EXHAUSTED once it takes again; nothing is handed to a
// detached sink.
TEST(PullTransportTest, ASinkThatFallsBehindIsDroppedAndADetachedOneHearsNothing) {
  PullTransportOptions options;
  options.max_queued_events = 4;
  auto transport = PullTransport::Create(options);
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("slow");
  ASSERT_TRUE(sub.ok());
  RecordingSink sink(sub->get());
  (*sub)->Attach(&sink);  // holds the group info, never done
  PublicationManifest manifest;
  for (uint64_t v = 1; v <= 3; ++v) {  // manifest + abort each: the third manifest overflows
    manifest.version = v;
    ASSERT_TRUE((*transport)->Begin(manifest).ok());
    (*transport)->Abort("test");
  }
  EXPECT_TRUE((*transport)->Receivers().empty());
  EXPECT_EQ(sink.items().size(), 1u);
  EXPECT_TRUE(sink.Done());
  EXPECT_EQ(sink.items().back().status().code(), absl::StatusCode::kResourceExhausted)
      << sink.items().back().status();

  auto quiet = (*transport)->Subscribe("quiet");
  ASSERT_TRUE(quiet.ok());
  RecordingSink detached(quiet->get());
  (*quiet)->Attach(&detached);
  EXPECT_FALSE(detached.Done());
  (*quiet)->Detach();
  manifest.version = 9;
  ASSERT_TRUE((*transport)->Begin(manifest).ok());
  (*quiet)->Close();
  EXPECT_EQ(detached.items().size(), 1u);
}

TEST(PullTransportTest, AClaimedVersionBeyondAnyPublishableOneIsRefused) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto top = (*transport)->Subscribe("r0", uint64_t{1} << 53);  // the largest is taken
  ASSERT_TRUE(top.ok());
  for (const uint64_t v : {(uint64_t{1} << 53) + 1, ~uint64_t{0}}) {
    auto sub = (*transport)->Subscribe("r1", v);
    ASSERT_FALSE(sub.ok()) << v;
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(sub.status().message().find("receiver 'r1' claims to hold version"),
              std::string::npos)
        << sub.status();
  }
  EXPECT_EQ((*transport)->HighestHeldVersion()->version, uint64_t{1} << 53);
}

TEST(PullTransportTest, EverySubscriptionGetsItsOwnRandomToken) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  std::set<std::string> tokens;
  for (int i = 0; i < 16; ++i) {
    auto sub = (*transport)->Subscribe("r" + std::to_string(i));
    ASSERT_TRUE(sub.ok()) << sub.status();
    const std::string token = FirstEvent(**sub).subscription_token;
    EXPECT_EQ(token.size(), 64u) << token;  // 256 bits, hex
    tokens.insert(token);
  }
  EXPECT_EQ(tokens.size(), 16u);
}

TEST(PullTransportTest, PullsAndAcksNeedTheSubscriptionsToken) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto victim = (*transport)->Subscribe("engine-1");
  auto other = (*transport)->Subscribe("engine-2");
  ASSERT_TRUE(victim.ok() && other.ok());
  const std::string victim_token = FirstEvent(**victim).subscription_token;
  const std::string other_token = FirstEvent(**other).subscription_token;
  auto bucket = BeginOneBucket(**transport, 3);
  const uint64_t sum = bucket->manifest.checksum;

  for (const std::string& wrong : {std::string(), other_token, victim_token.substr(1)}) {
    SCOPED_TRACE(wrong);
    absl::StatusOr<std::shared_ptr<const Bucket>> read = (*victim)->ReadBucket(wrong, 3, 0);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(std::string(read.status().message()), ::testing::HasSubstr("engine-1"));
    // The right checksum under a foreign token: refused, nothing acknowledged.
    absl::Status ack = (*victim)->Ack(wrong, 3, 0, sum);
    EXPECT_EQ(ack.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(std::string(ack.message()), ::testing::HasSubstr("engine-1"));
    // A wrong checksum under a foreign token cannot fail the receiver (or the publication).
    EXPECT_EQ((*victim)->Ack(wrong, 3, 0, sum ^ 1).code(), absl::StatusCode::kPermissionDenied);
  }
  EXPECT_EQ(OutcomeOf(**transport, "engine-1").state, ReceiverState::kReceiving);
  EXPECT_EQ(OutcomeOf(**transport, "engine-1").failure, ReceiverFailure::kNone);

  // The other receiver acknowledging: the victim still has not, so nothing can commit.
  ASSERT_TRUE((*other)->ReadBucket(other_token, 3, 0).ok());
  ASSERT_TRUE((*other)->Ack(other_token, 3, 0, sum).ok());
  EXPECT_EQ((*transport)->Commit().code(), absl::StatusCode::kFailedPrecondition);

  // Its own token: the victim reads, acknowledges, and the publication commits.
  absl::StatusOr<std::shared_ptr<const Bucket>> read = (*victim)->ReadBucket(victim_token, 3, 0);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)->bytes, bucket->bytes);
  ASSERT_TRUE((*victim)->Ack(victim_token, 3, 0, sum).ok());
  ASSERT_TRUE((*transport)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE((*transport)->Commit().ok());
  EXPECT_TRUE(OutcomeOf(**transport, "engine-1").committed);
}

TEST(PullTransportTest, ALateAckOfAnAbortedAttemptNeverCountsForTheRetry) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("r0");
  ASSERT_TRUE(sub.ok());
  const std::string token = FirstEvent(**sub).subscription_token;
  // Attempt 1 of version 3 is aborted before the receiver acknowledged; the engine begins
  // attempt 2 of the same version with the same bytes.
  std::shared_ptr<const Bucket> bucket = BeginOneBucket(**transport, 3);
  (*transport)->Abort("attempt 1 failed elsewhere");
  PublicationManifest retry;
  retry.version = 3;
  retry.attempt = 2;
  retry.buckets.push_back(bucket->manifest);
  ASSERT_TRUE((*transport)->Begin(retry).ok());
  ASSERT_TRUE((*transport)->Send(bucket).ok());
  // The receiver, still working through attempt 1's events, reads and acknowledges bucket 0 of
  // attempt 1: refused, and it does not count (the receiver will discard what it read when it
  // sees attempt 1's abort).
  const uint64_t sum = bucket->manifest.checksum;
  EXPECT_TRUE(absl::IsFailedPrecondition((*sub)->ReadBucket(token, 3, 0, 1).status()));
  const absl::Status stale = (*sub)->Ack(token, 3, 0, sum, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(stale)) << stale;
  EXPECT_NE(stale.message().find("attempt 1 of version 3 was aborted"), std::string::npos);
  EXPECT_EQ(OutcomeOf(**transport, "r0").failure, ReceiverFailure::kNone);
  EXPECT_EQ(OutcomeOf(**transport, "r0").state, ReceiverState::kReceiving);  // nothing acked
  // The events say which attempt each one belongs to.
  std::vector<uint32_t> attempts;
  while (true) {
    absl::StatusOr<ReceiverEvent> e = (*sub)->Next(absl::Milliseconds(10));
    if (!e.ok()) break;
    if (auto* m = std::get_if<ManifestEvent>(&*e)) attempts.push_back(m->manifest.attempt);
    if (auto* r = std::get_if<BucketReadyEvent>(&*e)) attempts.push_back(r->attempt);
    if (auto* a = std::get_if<AbortEvent>(&*e)) attempts.push_back(a->attempt);
  }
  EXPECT_EQ(attempts, (std::vector<uint32_t>{1, 1, 1, 2, 2}));
  // Attempt 2's own acknowledgement commits it.
  ASSERT_TRUE((*sub)->ReadBucket(token, 3, 0, 2).ok());
  ASSERT_TRUE((*sub)->Ack(token, 3, 0, sum, 2).ok());
  EXPECT_TRUE((*transport)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE((*transport)->Commit().ok());
}

// A group version the leader decided to commit: a receiver that left after acknowledging
// everything cannot refuse it (a lone daemon's Commit would); the others are told to apply it,
// and the one that left is reported not told.
TEST(PullTransportTest, ADecidedCommitIsNotRefusedByAReceiverThatLeftAfterItsLastAck) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto stays = (*transport)->Subscribe("r0");
  auto leaves = (*transport)->Subscribe("r1");
  ASSERT_TRUE(stays.ok() && leaves.ok());
  const std::string t0 = FirstEvent(**stays).subscription_token;
  const std::string t1 = FirstEvent(**leaves).subscription_token;
  auto bucket = BeginOneBucket(**transport, 4);
  const uint64_t sum = bucket->manifest.checksum;
  ASSERT_TRUE((*stays)->Ack(t0, 4, 0, sum).ok());
  ASSERT_TRUE((*leaves)->Ack(t1, 4, 0, sum).ok());
  ASSERT_TRUE((*transport)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
  leaves->reset();  // gone after its last acknowledgement
  EXPECT_EQ(OutcomeOf(**transport, "r1").state, ReceiverState::kLeft);
  EXPECT_FALSE((*transport)->Commit().ok());  // alone, a daemon would not commit
  ASSERT_TRUE((*transport)->CommitDecided().ok());
  EXPECT_EQ((*transport)->committed_version(), 4u);
  const ReceiverOutcome r0 = OutcomeOf(**transport, "r0");
  EXPECT_TRUE(r0.committed);
  const ReceiverOutcome r1 = OutcomeOf(**transport, "r1");
  EXPECT_FALSE(r1.committed);
  EXPECT_EQ(r1.state, ReceiverState::kLeft);
  EXPECT_NE(r1.error.find("version 4 committed after it acknowledged every bucket, and it was "
                          "not told to apply it"),
            std::string::npos)
      << r1.error;
  bool told = false;
  while (true) {
    absl::StatusOr<ReceiverEvent> e = (*stays)->Next(absl::Milliseconds(10));
    if (!e.ok()) break;
    if (auto* c = std::get_if<CommitEvent>(&*e)) told = c->version == 4;
  }
  EXPECT_TRUE(told);
}

// A daemon stopping while a group version is in doubt here tells its receivers nothing.
TEST(PullTransportTest, AShutdownInDoubtEndsTheVersionWithoutAnAbort) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto sub = (*transport)->Subscribe("r0");
  ASSERT_TRUE(sub.ok());
  FirstEvent(**sub);
  BeginOneBucket(**transport, 5);
  (*transport)->Shutdown(/*abort_in_flight=*/false);
  bool aborted = false;
  while (true) {
    absl::StatusOr<ReceiverEvent> e = (*sub)->Next(absl::Milliseconds(10));
    if (!e.ok()) break;
    aborted |= std::holds_alternative<AbortEvent>(*e);
  }
  EXPECT_FALSE(aborted);
  EXPECT_EQ((*transport)->committed_version(), 0u);
}

// What a receiver that subscribes holding a version staged, its outcome unknown to it, is told:
// what this transport told its receivers of that version, or that it cannot say.
TEST(PullTransportTest, AStagedVersionIsAnsweredWithWhatTheTransportToldOfIt) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  auto r0 = (*transport)->Subscribe("r0");
  ASSERT_TRUE(r0.ok());
  const std::string t0 = FirstEvent(**r0).subscription_token;
  const auto staged = [&](uint64_t v) {
    auto sub = (*transport)->Subscribe("late", 0, "", v);
    EXPECT_TRUE(sub.ok()) << sub.status();
    GroupInfoEvent info = FirstEvent(**sub);
    return std::make_pair(info.staged, info.staged_reason);
  };
  auto bucket = BeginOneBucket(**transport, 4);
  EXPECT_EQ(staged(4).first, StagedDecision::kUnknown);  // in flight here
  EXPECT_NE(staged(4).second.find("still being published"), std::string::npos);
  ASSERT_TRUE((*r0)->Ack(t0, 4, 0, bucket->manifest.checksum).ok());
  ASSERT_TRUE((*transport)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE((*transport)->Commit().ok());
  EXPECT_EQ(staged(4).first, StagedDecision::kApply);
  BeginOneBucket(**transport, 5);
  (*transport)->Abort("a receiver failed");
  EXPECT_EQ(staged(5).first, StagedDecision::kDiscard);
  EXPECT_EQ(staged(3).first, StagedDecision::kDiscard);  // older than the committed v4
  EXPECT_EQ(staged(6).first, StagedDecision::kUnknown);  // never seen here
  EXPECT_NE(staged(6).second.find("no record of version 6"), std::string::npos);
  EXPECT_EQ(staged(0).first, StagedDecision::kUnknown);
  EXPECT_TRUE(
      absl::IsInvalidArgument((*transport)->Subscribe("x", 0, "", uint64_t{1} << 60).status()));
  // Every manifest carries the committed version as the publication begins.
  BeginOneBucket(**transport, 6);
  uint64_t committed_in_manifest = 0;
  while (true) {
    absl::StatusOr<ReceiverEvent> e = (*r0)->Next(absl::Milliseconds(10));
    if (!e.ok()) break;
    if (auto* m = std::get_if<ManifestEvent>(&*e); m && m->manifest.version == 6) {
      committed_in_manifest = m->committed_version;
    }
  }
  EXPECT_EQ(committed_in_manifest, 4u);
}

TEST(PullTransportTest, ReceiverNamesAreBoundedAndPrintable) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  const std::string longest(kMaxReceiverNameBytes, 'n');
  EXPECT_TRUE((*transport)->Subscribe(longest).ok());
  EXPECT_TRUE((*transport)->Subscribe("engine-0.rank_1:tp/2").ok());
  for (const std::string& bad :
       {std::string(), longest + "n", std::string("a\nINFO forged line"), std::string("a b"),
        std::string("tab\t"), std::string("nul\0x", 5), std::string("\xc3\xa9t\xc3\xa9")}) {
    absl::StatusOr<std::unique_ptr<Subscription>> sub = (*transport)->Subscribe(bad);
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << absl::CHexEscape(bad);
    EXPECT_THAT(std::string(sub.status().message()), ::testing::HasSubstr("receiver_name"));
    // The message never carries the raw bytes (it ends up in logs).
    EXPECT_EQ(sub.status().message().find('\n'), absl::string_view::npos);
  }
}

TEST(PullTransportTest, TracksTheHighestVersionConnectedReceiversHold) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  EXPECT_FALSE((*transport)->HighestHeldVersion().has_value());
  EXPECT_TRUE((*transport)->CheckVersionAhead(1).ok());
  auto fresh = (*transport)->Subscribe("fresh");
  auto v5 = (*transport)->Subscribe("holds-5", 5);
  auto v3 = (*transport)->Subscribe("holds-3", 3);
  ASSERT_TRUE(fresh.ok() && v5.ok() && v3.ok());
  std::optional<HeldVersion> held = (*transport)->HighestHeldVersion();
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->receiver, "holds-5");
  EXPECT_EQ(held->version, 5u);
  for (uint64_t version : {1u, 5u}) {
    absl::Status s = (*transport)->CheckVersionAhead(version);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("holds-5"));
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(absl::StrCat("version: ", version)));
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("version 5"));
  }
  // Begin refuses too (a receiver may subscribe after the engine's check).
  PublicationManifest manifest;
  manifest.version = 4;
  EXPECT_EQ((*transport)->Begin(manifest).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*transport)->CheckVersionAhead(6).ok());
  // The receiver that held it leaves: the next highest counts.
  v5->reset();
  held = (*transport)->HighestHeldVersion();
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->receiver, "holds-3");
  EXPECT_TRUE((*transport)->CheckVersionAhead(4).ok());
  // A commit raises what every participant holds.
  const std::string fresh_token = FirstEvent(**fresh).subscription_token;
  const std::string v3_token = FirstEvent(**v3).subscription_token;
  auto bucket = BeginOneBucket(**transport, 9);
  ASSERT_TRUE((*fresh)->Ack(fresh_token, 9, 0, bucket->manifest.checksum).ok());
  ASSERT_TRUE((*v3)->Ack(v3_token, 9, 0, bucket->manifest.checksum).ok());
  ASSERT_TRUE((*transport)->Commit().ok());
  held = (*transport)->HighestHeldVersion();
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->version, 9u);
}

}  // namespace
}  // namespace wpub::transport

namespace wpub::transport {
namespace {

// The ManifestEvent of the publication just begun, after the events before it.
ManifestEvent NextManifest(Subscription& sub) {
  for (;;) {
    absl::StatusOr<ReceiverEvent> e = sub.Next(absl::Seconds(10));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    if (const auto* m = std::get_if<ManifestEvent>(&*e)) return *m;
  }
}

// Patches are offered per receiver: only to one that accepts them and holds the base, never in a
// replay, nor in every full_every-th publication; the patch is made once per bucket, by the
// first reader, and a receiver that was not offered one reads the bucket.
TEST(PullTransportTest, PatchesAreOfferedOnlyToReceiversHoldingTheBaseAndMadeOncePerBucket) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  uint64_t base = 0;
  int made = 0;
  PatchSource source;
  source.base_version = [&] { return base; };
  source.make = [&](uint64_t b, const Bucket& next) -> std::shared_ptr<const Bucket> {
    ++made;
    auto p = std::make_shared<Bucket>(next);
    p->bytes = {0xAB};
    p->patch_base = b;
    return p;
  };
  source.full_every = 3;
  (*transport)->SetPatchSource(source);
  auto holder = (*transport)->Subscribe("holder", 0, "", 0, /*accepts_patches=*/true);
  auto refuser = (*transport)->Subscribe("refuser", 0, "", 0, /*accepts_patches=*/false);
  ASSERT_TRUE(holder.ok() && refuser.ok());
  const std::string ht = FirstEvent(**holder).subscription_token;
  const std::string rt = FirstEvent(**refuser).subscription_token;
  // v1: no base yet: nothing offered.
  auto commit = [&](uint64_t v, const std::shared_ptr<const Bucket>& b) {
    for (auto* s : {&*holder, &*refuser}) {
      const std::string& t = s == &*holder ? ht : rt;
      ASSERT_TRUE((*s)->Ack(t, v, 0, b->manifest.checksum).ok());
    }
    ASSERT_TRUE((*transport)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
    ASSERT_TRUE((*transport)->Commit().ok());
  };
  auto b1 = BeginOneBucket(**transport, 1);
  EXPECT_EQ(NextManifest(**holder).patch_base, 0u);
  EXPECT_EQ((*(*holder)->ReadBucket(ht, 1, 0, 1, /*patch=*/true))->patch_base, 0u);
  commit(1, b1);
  base = 1;  // the retained copy holds v1 now; both receivers hold it
  // v2: the holder is offered patches, the refuser is not; one patch for both reads.
  auto b2 = BeginOneBucket(**transport, 2);
  EXPECT_EQ(NextManifest(**holder).patch_base, 1u);
  EXPECT_EQ(NextManifest(**refuser).patch_base, 0u);
  auto p = (*holder)->ReadBucket(ht, 2, 0, 1, true);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->patch_base, 1u);
  EXPECT_EQ((*p)->bytes, std::vector<uint8_t>{0xAB});
  EXPECT_EQ((*p)->manifest.checksum, b2->manifest.checksum);  // the whole bucket's
  EXPECT_EQ(*(*holder)->ReadBucket(ht, 2, 0, 1, true), *p);
  EXPECT_EQ(made, 1);
  // The refuser asking for a patch anyway gets the bucket.
  EXPECT_EQ(*(*refuser)->ReadBucket(rt, 2, 0, 1, true), b2);
  commit(2, b2);
  // v3 offered (the second in a row), v4 whole (full_every 3), v5 offered again.
  for (uint64_t v = 3; v <= 5; ++v) {
    base = v - 1;
    auto b = BeginOneBucket(**transport, v);
    EXPECT_EQ(NextManifest(**holder).patch_base, v == 4 ? 0u : v - 1) << "v" << v;
    (void)NextManifest(**refuser);
    commit(v, b);
  }
  // A base the receiver does not hold (the copy is older than what it holds): nothing offered.
  base = 3;
  auto b6 = BeginOneBucket(**transport, 6);
  EXPECT_EQ(NextManifest(**holder).patch_base, 0u);
  commit(6, b6);
  // A replay is never patched.
  base = 6;
  PublicationManifest replay;
  replay.version = 6;
  replay.replay = true;
  replay.buckets.push_back(b6->manifest);
  auto late = (*transport)->Subscribe("late", 5, "", 0, true);
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE((*transport)->Begin(replay).ok());
  EXPECT_EQ(NextManifest(**late).patch_base, 0u);
  (*transport)->Abort("test");
}

// A member that reads device buckets (where the retained copy stages them), recording the order.
class DeviceReader final : public testing::QuietTransport {
 public:
  explicit DeviceReader(std::vector<std::string>* order)
      : QuietTransport("device-reader"), order_(order) {}
  TransportCapabilities capabilities() const override {
    TransportCapabilities c;
    c.name = "device-reader";
    c.accepts = static_cast<LocationSet>(BucketLocation::kDevice);
    return c;
  }
  absl::Status Send(std::shared_ptr<const Bucket> bucket) override {
    EXPECT_EQ(bucket->location, BucketLocation::kDevice);
    order_->push_back("device");
    return absl::OkStatus();
  }

 private:
  std::vector<std::string>* order_;
};

// A publication whose every participant takes patches, through the transport group, takes each
// device bucket without its bytes -- the producer's checksum read instead of its host copy, and
// only once the members that read the device bytes (the retained copy's staging) took it -- and a
// receiver of the publication that needs a bucket whole gets it from the patch source's copy,
// read once per bucket and let go when the publication ends. Any participant that takes buckets
// whole, or a source that does not keep the version, brings the host copy back; a deferred bucket
// is refused where it cannot be read, and to a receiver that is not a participant; a failed read
// reaches the reader.
TEST(PullTransportTest, APatchedPublicationTakesDeviceBucketsWithoutTheirBytes) {
  auto transport = PullTransport::Create(PullTransportOptions{});
  ASSERT_TRUE(transport.ok());
  std::vector<std::string> order;
  DeviceReader reader(&order);
  auto group = TransportGroup::Create({transport->get(), &reader});
  ASSERT_TRUE(group.ok());
  const std::vector<uint8_t> bytes = {9, 8, 7, 6, 5, 4, 3, 2, 1};
  const uint64_t sum = Checksum(bytes.data(), bytes.size());
  uint64_t base = 0;
  bool keeps = true, worth = true, readable = true;
  int made = 0, wholes = 0;
  PatchSource source;
  source.base_version = [&] { return base; };
  source.make = [&](uint64_t b, const Bucket& next) -> std::shared_ptr<const Bucket> {
    ++made;
    EXPECT_EQ(next.bytes_deferred, next.bytes.empty());
    if (!worth) return nullptr;
    auto p = std::make_shared<Bucket>(next);
    p->bytes = {0xAB};
    p->bytes_deferred = false;
    p->patch_base = b;
    return p;
  };
  source.can_defer = [&](uint64_t) {
    order.push_back("defer?");
    return keeps;
  };
  source.whole = [&](const Bucket& next) -> absl::StatusOr<std::shared_ptr<const Bucket>> {
    ++wholes;
    if (!readable) return absl::UnavailableError("test: the staging stopped");
    auto w = std::make_shared<Bucket>(next);
    w->bytes = bytes;
    w->bytes_deferred = false;
    return std::shared_ptr<const Bucket>(std::move(w));
  };
  (*transport)->SetPatchSource(source);
  auto a = (*transport)->Subscribe("a", 0, "", 0, /*accepts_patches=*/true);
  auto b = (*transport)->Subscribe("b", 0, "", 0, /*accepts_patches=*/true);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string at = FirstEvent(**a).subscription_token;
  const std::string bt = FirstEvent(**b).subscription_token;
  int copies = 0, sums = 0;
  // A device bucket as the GPU backend emits it: its host copy and its checksum on request.
  auto device_bucket = [&](uint64_t version) {
    auto d = std::make_shared<Bucket>();
    d->version = version;
    d->location = BucketLocation::kDevice;
    d->manifest.index = 0;
    d->manifest.nbytes = bytes.size();  // checksum 0: computed on the device
    d->device.copy_to_host = [&, version]() -> absl::StatusOr<std::shared_ptr<const Bucket>> {
      ++copies;
      auto h = std::make_shared<Bucket>();
      h->version = version;
      h->manifest.index = 0;
      h->manifest.nbytes = bytes.size();
      h->manifest.checksum = sum;
      h->bytes = bytes;
      return std::shared_ptr<const Bucket>(std::move(h));
    };
    d->device.checksum_to_host = [&]() -> absl::StatusOr<uint64_t> {
      ++sums;
      return sum;
    };
    return d;
  };
  auto begin = [&](uint64_t version) {
    PublicationManifest m;
    m.version = version;
    BucketManifest bm;
    bm.index = 0;
    bm.nbytes = bytes.size();
    m.buckets.push_back(bm);
    EXPECT_TRUE((*group)->Begin(m).ok());
    EXPECT_TRUE((*group)->Send(device_bucket(version)).ok());
  };
  auto commit = [&](uint64_t version, std::vector<std::pair<Subscription*, std::string>> subs) {
    for (auto& [s, t] : subs) ASSERT_TRUE(s->Ack(t, version, 0, sum).ok());
    ASSERT_TRUE((*group)->WaitAcknowledged(absl::Now() + absl::Seconds(10)).ok());
    ASSERT_TRUE((*group)->Commit().ok());
  };
  // v1: nobody holds a base: the host copy.
  begin(1);
  EXPECT_EQ(copies, 1);
  EXPECT_EQ((*(*a)->ReadBucket(at, 1, 0))->bytes, bytes);
  commit(1, {{a->get(), at}, {b->get(), bt}});
  // v2: both take patches: no host copy; the checksum is the producer's, asked after the
  // device reader took the bucket.
  base = 1;
  order.clear();
  begin(2);
  EXPECT_EQ(copies, 1);
  EXPECT_EQ(sums, 1);
  EXPECT_EQ(order, (std::vector<std::string>{"device", "defer?"}));
  auto p = (*a)->ReadBucket(at, 2, 0, 1, /*patch=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->bytes, std::vector<uint8_t>{0xAB});
  EXPECT_EQ((*p)->manifest.checksum, sum);
  // Whole, twice (b, then a): read once, from the source.
  for (auto& [s, t] :
       std::vector<std::pair<Subscription*, std::string>>{{b->get(), bt}, {a->get(), at}}) {
    auto w = s->ReadBucket(t, 2, 0, 1, /*patch=*/false);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->bytes, bytes);
    EXPECT_EQ((*w)->manifest.checksum, sum);
  }
  EXPECT_EQ(wholes, 1);
  EXPECT_EQ(made, 1);
  std::weak_ptr<const Bucket> whole_read = *(*a)->ReadBucket(at, 2, 0, 1, false);
  EXPECT_FALSE(whole_read.expired());
  // A subscriber that is not a participant (it came after the Begin) reads nothing deferred.
  auto outsider = (*transport)->Subscribe("outsider", 0, "", 0, true);
  ASSERT_TRUE(outsider.ok());
  const std::string ot = FirstEvent(**outsider).subscription_token;
  EXPECT_EQ((*outsider)->ReadBucket(ot, 2, 0, 1, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wholes, 1);
  (*outsider)->Close();
  commit(2, {{a->get(), at}, {b->get(), bt}});
  EXPECT_TRUE(whole_read.expired());  // let go with the publication
  // v3: a patch not worth it goes whole, from the source; an unreadable source reaches the
  // reader (every reader: read once).
  base = 2;
  worth = false;
  readable = false;
  begin(3);
  EXPECT_EQ(copies, 1);
  EXPECT_EQ((*a)->ReadBucket(at, 3, 0, 1, true).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*b)->ReadBucket(bt, 3, 0, 1, false).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(wholes, 2);
  (*group)->Abort("test: unreadable");
  worth = true;
  readable = true;
  // v3 again, with a receiver that takes buckets whole: the host copy, nothing deferred.
  auto c = (*transport)->Subscribe("c", 2, "", 0, /*accepts_patches=*/false);
  ASSERT_TRUE(c.ok());
  const std::string ct = FirstEvent(**c).subscription_token;
  begin(3);
  EXPECT_EQ(copies, 2);
  EXPECT_EQ((*(*c)->ReadBucket(ct, 3, 0))->bytes, bytes);
  commit(3, {{a->get(), at}, {b->get(), bt}, {c->get(), ct}});
  (*c)->Close();
  // v4: the source does not keep the version: the host copy.
  base = 3;
  keeps = false;
  begin(4);
  EXPECT_EQ(copies, 3);
  commit(4, {{a->get(), at}, {b->get(), bt}});
  // A deferred bucket sent where it cannot be read is refused.
  base = 4;
  PublicationManifest m;
  m.version = 5;
  m.buckets.push_back(device_bucket(5)->manifest);
  auto c2 = (*transport)->Subscribe("c2", 4, "", 0, /*accepts_patches=*/false);
  ASSERT_TRUE(c2.ok());
  ASSERT_TRUE((*transport)->Begin(m).ok());
  auto deferred = std::make_shared<Bucket>();
  deferred->version = 5;
  deferred->manifest = m.buckets[0];
  deferred->manifest.checksum = sum;
  deferred->bytes_deferred = true;
  EXPECT_EQ((*transport)->Send(deferred).code(), absl::StatusCode::kInternal);
  (*transport)->Abort("test");
}

}  // namespace
}  // namespace wpub::transport
