// The retained copy as a member of a transport group: what it keeps of committed, aborted and
// replayed publications, its memory bound, and that it is never counted as a participant.
#include "core/transport/retained_copy.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/transport/checksum.h"
#include "core/transport/transport_group.h"

namespace wpub::transport {
namespace {

// A manifest of `n` buckets of `bytes` bytes each.
PublicationManifest Manifest(uint64_t version, uint32_t n, uint64_t bytes) {
  PublicationManifest m;
  m.version = version;
  for (uint32_t i = 0; i < n; ++i) {
    BucketManifest b;
    b.index = i;
    b.nbytes = bytes;
    b.tensors.push_back(ManifestTensor{absl::StrCat("t", i), DType::kUInt8,
                                       Shape{static_cast<int64_t>(bytes)}, 0, bytes});
    m.buckets.push_back(b);
  }
  return m;
}

std::shared_ptr<const Bucket> HostBucket(const PublicationManifest& m, uint32_t index) {
  auto b = std::make_shared<Bucket>();
  b->version = m.version;
  b->manifest = m.buckets[index];
  b->bytes.assign(b->manifest.nbytes, static_cast<uint8_t>(m.version * 16 + index));
  b->manifest.checksum = Checksum(b->bytes.data(), b->bytes.size());
  return b;
}

// Begin, every bucket, WaitAcknowledged; then commit or abort.
void Publish(Transport& t, const PublicationManifest& m, bool commit) {
  ASSERT_TRUE(t.Begin(m).ok());
  for (uint32_t i = 0; i < m.buckets.size(); ++i) ASSERT_TRUE(t.Send(HostBucket(m, i)).ok());
  ASSERT_TRUE(t.WaitAcknowledged(absl::Now() + absl::Seconds(1)).ok());
  if (commit) {
    ASSERT_TRUE(t.Commit().ok());
  } else {
    t.Abort("test");
  }
}

TEST(RetainedCopy, OffRetainsNothingAndSaysWhy) {
  RetainedCopy copy({.where = RetainWhere::kOff});
  auto names = copy.Begin(Manifest(1, 2, 64));
  ASSERT_TRUE(names.ok());
  EXPECT_TRUE(names->empty());
  EXPECT_TRUE(copy.Commit().ok());
  EXPECT_EQ(copy.Retained(), nullptr);
  EXPECT_NE(copy.Info().reason.find("--retain=off"), std::string::npos) << copy.Info().reason;
}

TEST(RetainedCopy, KeepsTheCommittedVersionBucketForBucketAndAnAbortKeepsIt) {
  RetainedCopy copy({.where = RetainWhere::kHost});
  EXPECT_NE(copy.Info().reason.find("no version committed"), std::string::npos);
  const PublicationManifest v1 = Manifest(1, 3, 100);
  Publish(copy, v1, /*commit=*/true);
  std::shared_ptr<const RetainedVersion> r = copy.Retained();
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->manifest.version, 1u);
  ASSERT_EQ(r->buckets.size(), 3u);
  EXPECT_EQ(r->bytes, 300u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r->buckets[i]->bytes, HostBucket(v1, i)->bytes);
    // The manifest keeps the checksums the buckets carried.
    EXPECT_EQ(r->manifest.buckets[i].checksum, HostBucket(v1, i)->manifest.checksum);
  }
  // An aborted version leaves the committed one retained, whatever it had staged.
  Publish(copy, Manifest(2, 3, 100), /*commit=*/false);
  ASSERT_NE(copy.Retained(), nullptr);
  EXPECT_EQ(copy.Retained()->manifest.version, 1u);
  // A committed one replaces it.
  Publish(copy, Manifest(3, 2, 50), /*commit=*/true);
  EXPECT_EQ(copy.Retained()->manifest.version, 3u);
  EXPECT_EQ(copy.Info().bytes, 100u);
  EXPECT_EQ(copy.Info().buckets, 2u);
}

TEST(RetainedCopy, AVersionOverTheBoundCommittedDropsTheOlderCopy) {
  RetainedCopy copy({.where = RetainWhere::kHost, .max_bytes = 250});
  Publish(copy, Manifest(1, 2, 100), /*commit=*/true);  // 200 bytes: kept
  ASSERT_NE(copy.Retained(), nullptr);
  // 300 bytes, aborted: the committed v1 stays.
  Publish(copy, Manifest(2, 3, 100), /*commit=*/false);
  ASSERT_NE(copy.Retained(), nullptr);
  EXPECT_EQ(copy.Info().over_bound, 0u);
  // 300 bytes, committed: v1 is no longer the committed version, and v3 is not kept.
  Publish(copy, Manifest(3, 3, 100), /*commit=*/true);
  EXPECT_EQ(copy.Retained(), nullptr);
  const RetainedCopyInfo info = copy.Info();
  EXPECT_EQ(info.over_bound, 1u);
  EXPECT_NE(info.reason.find("over the bound of 250 bytes"), std::string::npos) << info.reason;
  // The next version within the bound is kept again.
  Publish(copy, Manifest(4, 1, 100), /*commit=*/true);
  ASSERT_NE(copy.Retained(), nullptr);
  EXPECT_EQ(copy.Retained()->manifest.version, 4u);
}

TEST(RetainedCopy, AReplayIsNotRetainedAgainAndADeviceBucketIsRefused) {
  RetainedCopy copy({.where = RetainWhere::kHost});
  Publish(copy, Manifest(1, 2, 10), /*commit=*/true);
  const std::shared_ptr<const RetainedVersion> before = copy.Retained();
  PublicationManifest replay = Manifest(1, 2, 10);
  replay.replay = true;
  auto names = copy.Begin(replay);
  ASSERT_TRUE(names.ok());
  EXPECT_TRUE(names->empty());
  EXPECT_TRUE(copy.Commit().ok());
  EXPECT_EQ(copy.Retained(), before);  // the same object, untouched

  const PublicationManifest v2 = Manifest(2, 1, 10);
  ASSERT_TRUE(copy.Begin(v2).ok());
  auto device = std::make_shared<Bucket>();
  device->version = 2;
  device->manifest = v2.buckets[0];
  device->location = BucketLocation::kDevice;
  const absl::Status s = copy.Send(device);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  copy.Abort("test");
  EXPECT_EQ(copy.Retained(), before);
}

// A transport with one receiver that records what it was sent.
class Recording final : public Transport {
 public:
  TransportCapabilities capabilities() const override { return {.name = "recording"}; }
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest&) override {
    return std::vector<std::string>{"r"};
  }
  absl::Status Send(std::shared_ptr<const Bucket>) override {
    ++sent;
    return absl::OkStatus();
  }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  std::vector<ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<ReceiverInfo> Receivers() const override { return {}; }
  int sent = 0;
};

TEST(RetainedCopy, InATransportGroupItTakesEveryBucketAndIsNoParticipant) {
  Recording recording;
  RetainedCopy copy({.where = RetainWhere::kHost});
  auto group = TransportGroup::Create({&recording, &copy});
  ASSERT_TRUE(group.ok());
  EXPECT_TRUE((*group)->capabilities().acknowledges_checksums);
  const PublicationManifest v1 = Manifest(1, 4, 32);
  auto names = (*group)->Begin(v1);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"r"});
  for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE((*group)->Send(HostBucket(v1, i)).ok());
  ASSERT_TRUE((*group)->WaitAcknowledged(absl::Now() + absl::Seconds(1)).ok());
  ASSERT_TRUE((*group)->Commit().ok());
  EXPECT_EQ(recording.sent, 4);
  ASSERT_NE(copy.Retained(), nullptr);
  EXPECT_EQ(copy.Retained()->buckets.size(), 4u);
  EXPECT_TRUE((*group)->Receivers().empty());
}

}  // namespace
}  // namespace wpub::transport
