// The retained copy as a member of a transport group: what it keeps of committed, aborted and
// replayed publications, its memory bound, and that it is never counted as a participant.
#include "core/transport/retained_copy.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/transport/checksum.h"
#include "core/transport/testing/quiet_transport.h"
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
class Recording final : public testing::QuietTransport {
 public:
  Recording() : QuietTransport("r") {}
  TransportCapabilities capabilities() const override { return {.name = "recording"}; }
  absl::Status Send(std::shared_ptr<const Bucket>) override {
    ++sent;
    return absl::OkStatus();
  }
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

// Memory where the copy's bytes live, as the GPU layer's does (retained_memory.h), in host
// vectors: device buckets here point at host bytes; the events are only compared.
class FakeMemory final : public RetainedMemory {
 public:
  struct Bytes final : RetainedBytes {
    FakeMemory* owner = nullptr;
    std::vector<std::vector<uint8_t>> copies;
    std::vector<uint64_t> sizes;
    bool sealed = false;
    absl::Status Stage(const Bucket& b) override {
      const uint32_t i = b.manifest.index;
      if (i != copies.size() || b.manifest.nbytes != sizes[i]) {
        return absl::InternalError("out of order");
      }
      if (owner->fail_at == static_cast<int>(i)) return absl::InternalError("copy engine fault");
      if (b.location == BucketLocation::kDevice) {
        copies.emplace_back(b.device.data, b.device.data + b.manifest.nbytes);
        owner->done_recorded.push_back(b.device.done);
      } else {
        copies.push_back(b.bytes);
      }
      return absl::OkStatus();
    }
    absl::StatusOr<std::vector<uint64_t>> Seal() override {
      if (owner->fail_seal) return absl::InternalError("cudaEventSynchronize: an illegal address");
      if (copies.size() != sizes.size()) return absl::FailedPreconditionError("incomplete");
      sealed = true;
      std::vector<uint64_t> sums;
      for (const auto& c : copies) sums.push_back(Checksum(c.data(), c.size()));
      return sums;
    }
    absl::StatusOr<std::shared_ptr<const Bucket>> HostCopy(uint64_t version,
                                                           const BucketManifest& m) override {
      return Emit(version, m);
    }
    absl::StatusOr<std::shared_ptr<const Bucket>> Emit(uint64_t version,
                                                       const BucketManifest& m) override {
      if (!sealed) return absl::InternalError("not sealed");
      auto b = std::make_shared<Bucket>();
      b->version = version;
      b->manifest = m;
      b->bytes = copies[m.index];
      return std::shared_ptr<const Bucket>(std::move(b));
    }
    void Abandon() override { ++owner->abandoned; }
  };
  RetainWhere where() const override { return RetainWhere::kDevice; }
  LocationSet accepts() const override { return kHostOrDevice; }
  absl::StatusOr<std::shared_ptr<RetainedBytes>> Reserve(const PublicationManifest& m) override {
    if (refuse) return absl::ResourceExhaustedError("cannot allocate 40 bytes of device memory");
    auto b = std::make_shared<Bytes>();
    b->owner = this;
    for (const BucketManifest& bm : m.buckets) b->sizes.push_back(bm.nbytes);
    held += m.total_bytes();
    last_reserved = b.get();
    return std::shared_ptr<RetainedBytes>(std::move(b));
  }
  uint64_t held_bytes() const override { return held; }

  bool refuse = false;
  int fail_at = -1;
  bool fail_seal = false;
  uint64_t held = 0;
  std::vector<CUevent_st*> done_recorded;
  const RetainedBytes* last_reserved = nullptr;
  int abandoned = 0;  // Abandon calls: staging that stopped before its seal
};

// The bytes of bucket `index` of `m` (as HostBucket's), and a device bucket over them with
// distinct (never dereferenced) reader events.
struct DeviceBucketOf {
  std::vector<uint8_t> bytes;
  std::shared_ptr<Bucket> bucket;
  DeviceBucketOf(const PublicationManifest& m, uint32_t index) {
    bytes = HostBucket(m, index)->bytes;
    bucket = std::make_shared<Bucket>();
    bucket->version = m.version;
    bucket->manifest = m.buckets[index];  // checksum 0, as a device bucket's
    bucket->location = BucketLocation::kDevice;
    bucket->device.data = bytes.data();
    for (size_t r = 0; r < kMaxDeviceReaders; ++r) {
      bucket->device.reader_done[r] = reinterpret_cast<CUevent_st*>(0x1000 + 16 * r);
    }
    bucket->device.done = bucket->device.reader_done[0];
  }
};

// A device reader that records the `done` it was given.
class DeviceRecording final : public Transport {
 public:
  TransportCapabilities capabilities() const override {
    return {.name = "device", .accepts = kHostOrDevice};
  }
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest&) override {
    return std::vector<std::string>{"engine"};
  }
  absl::Status Send(std::shared_ptr<const Bucket> b) override {
    done.push_back(b->device.done);
    return absl::OkStatus();
  }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  std::vector<ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<ReceiverInfo> Receivers() const override { return {}; }
  std::vector<CUevent_st*> done;
};

TEST(RetainedCopyInMemory, IsTheNextDeviceReaderAndKeepsTheChecksumsOfWhatItCopied) {
  auto memory = std::make_shared<FakeMemory>();
  DeviceRecording engine;
  auto copy = RetainedCopy::Create({.where = RetainWhere::kDevice}, memory);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ((*copy)->capabilities().accepts, kHostOrDevice);
  auto group = TransportGroup::Create({&engine, copy->get()});
  ASSERT_TRUE(group.ok());
  const PublicationManifest v1 = Manifest(1, 3, 40);
  ASSERT_TRUE((*group)->Begin(v1).ok());
  for (uint32_t i = 0; i < 3; ++i) {
    DeviceBucketOf d(v1, i);
    ASSERT_TRUE((*group)->Send(d.bucket).ok());
    // The engine records the producer's first event, the copy the second: no host copy made.
    EXPECT_EQ(engine.done.back(), d.bucket->device.reader_done[0]);
    EXPECT_EQ(memory->done_recorded.back(), d.bucket->device.reader_done[1]);
  }
  ASSERT_TRUE((*group)->WaitAcknowledged(absl::Now() + absl::Seconds(1)).ok());
  ASSERT_TRUE((*group)->Commit().ok());
  const std::shared_ptr<const RetainedVersion> r = (*copy)->Retained();
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->bucket_count(), 3u);
  EXPECT_EQ(r->bytes, 120u);
  for (uint32_t i = 0; i < 3; ++i) {
    // The device buckets carried no checksum; the sealed copy's are in the manifest.
    EXPECT_EQ(r->manifest.buckets[i].checksum, HostBucket(v1, i)->manifest.checksum);
    auto b = r->BucketAt(i);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->bytes, HostBucket(v1, i)->bytes);
  }
  EXPECT_EQ(r->BucketAt(3).status().code(), absl::StatusCode::kOutOfRange);
  const RetainedCopyInfo info = (*copy)->Info();
  EXPECT_EQ(info.where, RetainWhere::kDevice);
  EXPECT_EQ(info.buckets, 3u);
  EXPECT_EQ(info.held_bytes, 120u);
}

TEST(RetainedCopyInMemory,
     ARefusedReservationOrAFailedCopyRetainsNothingAndNeverFailsThePublication) {
  auto memory = std::make_shared<FakeMemory>();
  auto copy = RetainedCopy::Create({.where = RetainWhere::kDevice}, memory);
  ASSERT_TRUE(copy.ok());
  RetainedCopy& c = **copy;
  Publish(c, Manifest(1, 2, 40), /*commit=*/true);
  ASSERT_NE(c.Retained(), nullptr);

  // An aborted version leaves the sealed one as it was.
  const std::shared_ptr<const RetainedVersion> v1 = c.Retained();
  Publish(c, Manifest(2, 2, 40), /*commit=*/false);
  EXPECT_EQ(c.Retained(), v1);
  EXPECT_EQ((*v1->BucketAt(1))->bytes, HostBucket(Manifest(1, 2, 40), 1)->bytes);

  // Memory refused: the publication goes on (Begin takes no part), nothing is retained, and
  // the older copy is dropped -- it is not the committed version.
  memory->refuse = true;
  auto names = c.Begin(Manifest(3, 2, 40));
  ASSERT_TRUE(names.ok());
  EXPECT_TRUE(names->empty());
  ASSERT_TRUE(c.Commit().ok());
  EXPECT_EQ(c.Retained(), nullptr);
  EXPECT_NE(c.Info().reason.find("v3 was not retained: device memory for the copy: cannot "
                                 "allocate 40 bytes"),
            std::string::npos)
      << c.Info().reason;
  EXPECT_EQ(c.Info().over_bound, 1u);

  // A copy that fails mid-version: every Send still succeeds.
  memory->refuse = false;
  memory->fail_at = 1;
  Publish(c, Manifest(4, 3, 40), /*commit=*/true);
  EXPECT_EQ(c.Retained(), nullptr);
  EXPECT_NE(c.Info().reason.find("the copy of bucket 1 failed: copy engine fault"),
            std::string::npos)
      << c.Info().reason;
  EXPECT_EQ(c.Info().over_bound, 2u);

  memory->fail_at = -1;
  Publish(c, Manifest(5, 3, 40), /*commit=*/true);
  ASSERT_NE(c.Retained(), nullptr);
  EXPECT_EQ(c.Retained()->manifest.version, 5u);

  // A seal that fails at commit: the commit still succeeds, nothing is retained.
  memory->fail_seal = true;
  Publish(c, Manifest(6, 2, 40), /*commit=*/true);
  EXPECT_EQ(c.Retained(), nullptr);
  EXPECT_NE(c.Info().reason.find("v6 was not retained: its copy could not be sealed: "
                                 "cudaEventSynchronize"),
            std::string::npos)
      << c.Info().reason;
  memory->fail_seal = false;
  Publish(c, Manifest(7, 2, 40), /*commit=*/true);
  ASSERT_NE(c.Retained(), nullptr);
}

// The staging version's memory is handed out (for a patch made where the bytes live, a bucket
// read back) only while that version is in flight; a staging that stops is abandoned, so a patch
// waiting on it returns, and a committed one is not. After a failed copy the memory stays
// readable until the publication ends (buckets copied before it may have been taken without
// their bytes), but the version no longer counts as staging.
TEST(RetainedCopyInMemory, StagingBytesAreTheVersionInFlightsAndAbandonedWhenItStops) {
  auto memory = std::make_shared<FakeMemory>();
  auto copy = RetainedCopy::Create({.where = RetainWhere::kDevice}, memory);
  ASSERT_TRUE(copy.ok());
  RetainedCopy& c = **copy;
  EXPECT_EQ(c.StagingBytes(1), nullptr);
  const PublicationManifest v1 = Manifest(1, 2, 40);
  ASSERT_TRUE(c.Begin(v1).ok());
  const std::shared_ptr<RetainedBytes> staging = c.StagingBytes(1);
  ASSERT_NE(staging, nullptr);
  EXPECT_EQ(staging.get(), memory->last_reserved);
  EXPECT_EQ(c.StagingBytes(2), nullptr);  // another version
  ASSERT_TRUE(c.Send(HostBucket(v1, 0)).ok());
  EXPECT_EQ(c.StagingBytes(1), staging);  // while staging
  EXPECT_TRUE(c.Staging(1));
  EXPECT_FALSE(c.Staging(2));
  ASSERT_TRUE(c.Send(HostBucket(v1, 1)).ok());
  ASSERT_TRUE(c.Commit().ok());
  EXPECT_EQ(c.StagingBytes(1), nullptr);  // sealed: the retained version now
  EXPECT_FALSE(c.Staging(1));
  EXPECT_EQ(c.Retained()->memory, staging);
  EXPECT_EQ(memory->abandoned, 0);

  const PublicationManifest v2 = Manifest(2, 2, 40);
  ASSERT_TRUE(c.Begin(v2).ok());
  ASSERT_NE(c.StagingBytes(2), nullptr);
  c.Abort("test");
  EXPECT_EQ(c.StagingBytes(2), nullptr);
  EXPECT_EQ(memory->abandoned, 1);

  memory->fail_at = 0;  // the copy of bucket 0 fails: staging stops, its memory abandoned
  ASSERT_TRUE(c.Begin(Manifest(3, 2, 40)).ok());
  const std::shared_ptr<RetainedBytes> stopped = c.StagingBytes(3);
  ASSERT_NE(stopped, nullptr);
  ASSERT_TRUE(c.Send(HostBucket(Manifest(3, 2, 40), 0)).ok());
  EXPECT_FALSE(c.Staging(3));
  EXPECT_EQ(c.StagingBytes(3), stopped);  // abandoned, still readable in flight
  EXPECT_EQ(memory->abandoned, 2);
  c.Abort("test");
  EXPECT_EQ(c.StagingBytes(3), nullptr);
  EXPECT_EQ(memory->abandoned, 2);  // nothing left to abandon

  // A replay stages nothing.
  memory->fail_at = -1;
  PublicationManifest replay = Manifest(1, 2, 40);
  replay.replay = true;
  ASSERT_TRUE(c.Begin(replay).ok());
  EXPECT_EQ(c.StagingBytes(1), nullptr);
  c.Abort("test");
}

TEST(RetainedCopyInMemory, DeviceOrPinnedNeedsTheGpuPathsMemory) {
  auto none = RetainedCopy::Create({.where = RetainWhere::kPinned}, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("--retain=pinned"), std::string::npos) << none.status();
  EXPECT_NE(none.status().message().find("--gpu_path"), std::string::npos) << none.status();
  auto other =
      RetainedCopy::Create({.where = RetainWhere::kPinned}, std::make_shared<FakeMemory>());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRetainWhere("pinned").value(), RetainWhere::kPinned);
  EXPECT_EQ(ParseRetainWhere("device").value(), RetainWhere::kDevice);
  EXPECT_NE(ParseRetainWhere("gpu").status().message().find("off, host, device, pinned"),
            std::string::npos);
}

}  // namespace
}  // namespace wpub::transport
