// Bucket patches end to end (wpubd --patches, core/delta/bucket_patch.h): an in-process daemon
// (engine with the retained copy, gRPC server) and in-process wpub-recv receivers. A receiver
// that holds the committed version in memory pulls only the changed words of each bucket and
// holds, after every version, exactly what a receiver pulling whole buckets holds (which the
// daemon's whole-bucket checksums verify); an unchanged version costs each bucket a patch
// header; every full_every-th version goes whole; a receiver without the base is caught up
// whole; a version aborted mid-patch (another receiver's checksum fails) leaves the base in
// place and the next version is patched against it. The same with the copy in a retained memory
// that makes patches where its bytes live (the GPU path's device copy: the engine asks the
// memory, and diffs host copies only when the memory cannot), stood in for here by host arenas.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "clients/recv/receiver.h"
#include "core/delta/bucket_patch.h"
#include "core/engine/engine.h"
#include "core/metrics/metrics.h"
#include "core/transport/checksum.h"
#include "server/client/publisher_client.h"
#include "server/service/daemon_server.h"
#include "tests/daemon/harness.h"

namespace wpub::server {
namespace {

namespace pb = ::wpub::v1;

// A retained memory that keeps each version in host vectors and makes patches itself
// (delta::DiffBucket over its own bytes) the way the GPU layer's device memory makes them on the
// device: Patch waits for the staging bucket and is UNIMPLEMENTED nowhere. `fail`: every Patch
// is an INTERNAL error (the engine then diffs host copies). Counts the patches it made.
class HostArenaMemory final : public transport::RetainedMemory {
 public:
  explicit HostArenaMemory(bool fail) : fail_(fail) {}
  transport::RetainWhere where() const override { return transport::RetainWhere::kDevice; }
  transport::LocationSet accepts() const override { return transport::kHostOnly; }
  absl::StatusOr<std::shared_ptr<transport::RetainedBytes>> Reserve(
      const transport::PublicationManifest& manifest) override {
    return std::shared_ptr<transport::RetainedBytes>(std::make_shared<Arena>(this, manifest));
  }
  uint64_t held_bytes() const override { return 0; }
  uint64_t patches_made() const { return made_.load(); }
  uint64_t patches_asked() const { return asked_.load(); }
  // Asks it could not answer because the staging stopped (an aborted publication).
  uint64_t patches_unmade() const { return unmade_.load(); }

 private:
  class Arena final : public transport::RetainedBytes {
   public:
    Arena(HostArenaMemory* memory, const transport::PublicationManifest& manifest)
        : memory_(memory), buckets_(manifest.buckets.size()) {}
    absl::Status Stage(const transport::Bucket& bucket) override {
      std::lock_guard lock(mu_);
      if (bucket.manifest.index != staged_) return absl::InternalError("out of order");
      buckets_[staged_++] = bucket.bytes;
      cv_.notify_all();
      return absl::OkStatus();
    }
    absl::StatusOr<std::vector<uint64_t>> Seal() override {
      std::lock_guard lock(mu_);
      std::vector<uint64_t> sums;
      for (const auto& b : buckets_) sums.push_back(transport::Checksum(b.data(), b.size()));
      return sums;
    }
    absl::StatusOr<std::shared_ptr<const transport::Bucket>> Emit(
        uint64_t version, const transport::BucketManifest& manifest) override {
      return HostCopy(version, manifest);
    }
    absl::StatusOr<std::shared_ptr<const transport::Bucket>> HostCopy(
        uint64_t version, const transport::BucketManifest& manifest) override {
      auto b = std::make_shared<transport::Bucket>();
      b->version = version;
      b->manifest = manifest;
      std::lock_guard lock(mu_);
      b->bytes = buckets_.at(manifest.index);
      return std::shared_ptr<const transport::Bucket>(std::move(b));
    }
    absl::StatusOr<transport::RetainedPatch> Patch(const transport::RetainedBytes& base,
                                                   const transport::BucketManifest& base_bucket,
                                                   const transport::BucketManifest& next,
                                                   uint64_t next_checksum, double fraction,
                                                   absl::Duration wait) override {
      ++memory_->asked_;
      if (memory_->fail_) return absl::InternalError("test: this memory's patches fail");
      std::vector<uint8_t> bytes;
      {
        std::unique_lock lock(mu_);
        if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(wait),
                          [&] { return staged_ > next.index || abandoned_; }) ||
            staged_ <= next.index) {
          ++memory_->unmade_;  // the staging stopped (an abort): the engine diffs host copies
          return absl::DeadlineExceededError("test: not staged");
        }
        bytes = buckets_[next.index];
      }
      const auto& from = static_cast<const Arena&>(base);
      std::vector<uint8_t> old;
      {
        std::lock_guard lock(from.mu_);
        old = from.buckets_.at(base_bucket.index);
      }
      delta::BucketPatchPlan plan = delta::DiffBucket(
          old, base_bucket.checksum, bytes, next_checksum, {.max_patch_fraction = fraction});
      transport::RetainedPatch out;
      out.made = !plan.full;
      out.why = plan.why;
      out.bytes = std::move(plan.patch);
      out.changed_units = plan.changed_units;
      if (out.made) ++memory_->made_;
      return out;
    }
    void Abandon() override {
      std::lock_guard lock(mu_);
      abandoned_ = true;
      cv_.notify_all();
    }

   private:
    HostArenaMemory* const memory_;  // outlives its arenas (the test's engine holds both)
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::vector<uint8_t>> buckets_;
    uint32_t staged_ = 0;
    bool abandoned_ = false;
  };

  const bool fail_;
  std::atomic<uint64_t> made_{0}, asked_{0}, unmade_{0};
};

// Where the retained copy lives in a run of the test.
enum class CopyIn { kHost, kPatchingMemory, kFailingMemory };

// A receiver running on its own thread until Stop.
struct RunningReceiver {
  std::unique_ptr<recv::Receiver> receiver;
  std::thread thread;
  absl::Status status;
  RunningReceiver(const std::string& target, const std::string& name, bool patches,
                  int64_t corrupt_bucket = -1) {
    recv::ReceiverOptions o;
    o.target = target;
    o.name = name;
    o.patches = patches;
    o.corrupt_bucket = corrupt_bucket;
    o.resubscribe_timeout = absl::ZeroDuration();
    auto r = recv::Receiver::Create(o);
    EXPECT_TRUE(r.ok()) << r.status();
    receiver = *std::move(r);
    thread = std::thread([this] { status = receiver->Run(); });
  }
  ~RunningReceiver() {
    receiver->Stop();
    thread.join();
  }
  uint64_t version() const {
    auto c = receiver->committed();
    return c == nullptr ? 0 : c->manifest.version;
  }
};

class Patches : public ::testing::TestWithParam<CopyIn> {
 protected:
  void SetUp() override {
    engine::EngineOptions o;
    o.bucket_bytes = 64 << 10;  // many buckets
    o.min_bucket_bytes = 4 << 10;
    engine::EngineComponents components;
    if (GetParam() == CopyIn::kHost) {
      o.retain.where = transport::RetainWhere::kHost;
    } else {
      memory_ = std::make_shared<HostArenaMemory>(GetParam() == CopyIn::kFailingMemory);
      components.retained_memory = memory_;
      o.retain.where = transport::RetainWhere::kDevice;
    }
    o.patches.enabled = true;
    o.patches.full_every = 3;
    o.max_attempts = 1;
    auto metrics = metrics::EngineMetrics::Create(&registry_);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *std::move(metrics);
    auto eng = engine::Engine::Create(o, metrics_.get(), std::move(components));
    ASSERT_TRUE(eng.ok()) << eng.status();
    engine_ = *std::move(eng);
    DaemonServerOptions so;
    so.listen = "127.0.0.1:0";
    auto server = DaemonServer::Create(so, engine_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    target_ = absl::StrCat("127.0.0.1:", server_->port());
    client::ClientOptions co;
    co.target = target_;
    auto c = client::PublisherClient::Create(co);
    ASSERT_TRUE(c.ok());
    client_ = *std::move(c);
    auto model = synthetic::SyntheticModel::Create(
        synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm, 2));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<synthetic::SyntheticModel>(*std::move(model));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Now() + absl::Seconds(5));
  }

  void WaitForReceivers(int n) {
    for (int i = 0; i < 1000; ++i) {
      auto s = client_->GetStatus();
      ASSERT_TRUE(s.ok()) << s.status();
      if (s->receivers_size() == n) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    FAIL() << "receivers did not subscribe";
  }

  // Version `version`: the previous version with the tensors of routed expert `changed` (-1:
  // none) drawn again -- an RL step that moved one expert (in every layer).
  pb::PublicationReport Publish(uint64_t version, int changed) {
    if (changed >= 0) seeds_[changed] = 100 + version;
    client::TensorFiller fill = [seeds = seeds_](const TensorDesc& d, absl::Span<uint8_t> out) {
      uint64_t seed = 1;
      for (const auto& [expert, s] : seeds) {
        if (absl::StrContains(d.name, absl::StrCat(".experts.", expert, "."))) seed = s;
      }
      return synthetic::FillTensor(d, seed, out);
    };
    auto r = client_->Publish(testing::MakeHeader(testing::TestSettings(), version),
                              model_->batches(), fill, {});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : pb::PublicationReport{};
  }

  std::shared_ptr<HostArenaMemory> memory_;  // kPatchingMemory, kFailingMemory
  prometheus::Registry registry_;
  std::unique_ptr<metrics::EngineMetrics> metrics_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<DaemonServer> server_;
  std::string target_;
  std::unique_ptr<client::PublisherClient> client_;
  std::unique_ptr<synthetic::SyntheticModel> model_;
  std::map<int, uint64_t> seeds_;  // routed expert -> the seed of its tensors (others: 1)
};

// Waits until `r` holds `version`.
void WaitFor(const RunningReceiver& r, uint64_t version) {
  for (int i = 0; i < 2000 && r.version() < version; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(r.version(), version);
}

void ExpectSameBuckets(const RunningReceiver& a, const RunningReceiver& b) {
  auto x = a.receiver->committed(), y = b.receiver->committed();
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(x->manifest.version, y->manifest.version);
  ASSERT_EQ(x->buckets.size(), y->buckets.size());
  ASSERT_EQ(x->manifest.buckets.size(), y->manifest.buckets.size());
  for (size_t i = 0; i < x->buckets.size(); ++i) {
    // (A manifest announced before packing carries no checksums; a replayed one does.)
    EXPECT_EQ(x->manifest.buckets[i].tensors, y->manifest.buckets[i].tensors) << "bucket " << i;
    EXPECT_EQ(x->buckets[i], y->buckets[i]) << "bucket " << i;
  }
}

TEST_P(Patches, AReceiverHoldingTheCommittedVersionPullsOnlyWhatChangedAndHoldsEveryVersion) {
  RunningReceiver patched(target_, "patched", true);
  RunningReceiver whole(target_, "whole", false);
  WaitForReceivers(2);
  struct Step {
    uint64_t version;
    int changed;   // the routed expert that moved (-1: none)
    bool patches;  // the patched receiver is offered patches
  };
  // full_every 3: v4 (the third in a row after v1) and v7 go whole.
  const Step steps[] = {{1, -1, false}, {2, 3, true}, {3, -1, true}, {4, 5, false}, {5, 2, true}};
  uint64_t buckets = 0;
  // A snapshot someone holds (v2's) is never written over: the receiver rebuilds patched
  // buckets into the buffers of the version before last only when nothing else holds them.
  std::shared_ptr<const recv::CommittedModel> held;
  std::vector<std::vector<uint8_t>> held_bytes;
  for (const Step& s : steps) {
    SCOPED_TRACE(absl::StrCat("v", s.version));
    const recv::ReceiverStats p0 = patched.receiver->stats(), w0 = whole.receiver->stats();
    const pb::PublicationReport r = Publish(s.version, s.changed);
    ASSERT_EQ(r.status(), pb::PUBLICATION_STATUS_COMMITTED) << r.error_message();
    buckets = r.num_buckets();
    ASSERT_GT(buckets, 8u);
    WaitFor(patched, s.version);
    WaitFor(whole, s.version);
    ExpectSameBuckets(patched, whole);
    const recv::ReceiverStats p1 = patched.receiver->stats(), w1 = whole.receiver->stats();
    const uint64_t patched_bytes = p1.bytes - p0.bytes, whole_bytes = w1.bytes - w0.bytes;
    EXPECT_EQ(whole_bytes, r.bytes_out());
    std::printf("v%llu: the patched receiver pulled %llu bytes, the whole one %llu (%u buckets)\n",
                static_cast<unsigned long long>(s.version),
                static_cast<unsigned long long>(patched_bytes),
                static_cast<unsigned long long>(whole_bytes), static_cast<unsigned>(buckets));
    EXPECT_EQ(p1.checksum_mismatches, 0u);
    if (s.version == 2) {
      held = patched.receiver->committed();
      held_bytes = held->buckets;
    } else if (held != nullptr) {
      EXPECT_EQ(held->manifest.version, 2u);
      EXPECT_TRUE(held->buckets == held_bytes) << "a held snapshot was written over";
    }
    if (!s.patches) {
      EXPECT_EQ(p1.patched_buckets, p0.patched_buckets);
      EXPECT_EQ(patched_bytes, whole_bytes);
    } else if (s.changed < 0) {
      // Nothing changed: every bucket is a patch header.
      EXPECT_EQ(p1.patched_buckets - p0.patched_buckets, buckets);
      EXPECT_EQ(patched_bytes, buckets * 48);
    } else {
      // One routed expert of two layers moved: a small share of the bytes.
      EXPECT_GT(p1.patched_buckets - p0.patched_buckets, buckets / 2);
      EXPECT_LT(patched_bytes * 5, whole_bytes) << patched_bytes << " of " << whole_bytes;
      EXPECT_GT(patched_bytes, buckets * 48);
    }
  }

  // A receiver that subscribes now holds nothing: it is caught up whole from the retained
  // copy, then offered patches like the others.
  RunningReceiver late(target_, "late", true);
  WaitFor(late, 5);
  EXPECT_EQ(late.receiver->stats().patched_buckets, 0u);
  ExpectSameBuckets(late, whole);

  // Every patch so far was made once, for one pull (no version was aborted yet).
  const uint64_t patched_before_abort = patched.receiver->stats().patched_buckets;
  // An aborted version: a receiver whose copy of bucket 3 is corrupted (its checksum fails)
  // while the others pull patches. They keep v5, the copy too; v7 is patched against v5.
  {
    RunningReceiver corrupter(target_, "corrupter", false, /*corrupt_bucket=*/3);
    WaitForReceivers(4);
    const pb::PublicationReport aborted = Publish(6, 4);
    EXPECT_EQ(aborted.status(), pb::PUBLICATION_STATUS_ABORTED);
    EXPECT_TRUE(absl::StrContains(aborted.error_message(), "corrupter")) << aborted.error_message();
  }
  EXPECT_EQ(patched.version(), 5u);
  const uint64_t before = patched.receiver->stats().patched_buckets;
  const pb::PublicationReport r7 = Publish(7, 6);
  ASSERT_EQ(r7.status(), pb::PUBLICATION_STATUS_COMMITTED) << r7.error_message();
  WaitFor(patched, 7);
  WaitFor(whole, 7);
  WaitFor(late, 7);
  ExpectSameBuckets(patched, whole);
  ExpectSameBuckets(late, whole);
  EXPECT_GT(patched.receiver->stats().patched_buckets, before);

  // Where the patches were made: by the memory when it can (every patched bucket; whole
  // buckets too are decided there), else from host copies after the memory's error. Counted up
  // to the aborted v6: from there a pull cut by the abort may be served again (a patch made
  // once, applied twice) or asked while the staging stopped (host copies).
  if (memory_ != nullptr) {
    EXPECT_GT(memory_->patches_asked(), 0u);
    if (GetParam() == CopyIn::kPatchingMemory) {
      EXPECT_GE(memory_->patches_made(), patched_before_abort);
    } else {
      EXPECT_EQ(memory_->patches_made(), 0u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CopyIn, Patches,
                         ::testing::Values(CopyIn::kHost, CopyIn::kPatchingMemory,
                                           CopyIn::kFailingMemory),
                         [](const ::testing::TestParamInfo<CopyIn>& p) {
                           switch (p.param) {
                             case CopyIn::kHost:
                               return "HostCopy";
                             case CopyIn::kPatchingMemory:
                               return "MemoryMakesPatches";
                             case CopyIn::kFailingMemory:
                               return "MemoryPatchesFail";
                           }
                           return "";
                         });

TEST(PatchesOptions, PatchesWithoutTheRetainedCopyAreRefused) {
  engine::EngineOptions o;
  o.patches.enabled = true;
  auto e = engine::Engine::Create(o, nullptr);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(e.status().message(), "it needs --retain")) << e.status();
  o.retain.where = transport::RetainWhere::kHost;
  for (double fraction : {0.0, -1.0, 1.5}) {
    o.patches.max_patch_fraction = fraction;
    e = engine::Engine::Create(o, nullptr);
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << fraction;
    EXPECT_TRUE(absl::StrContains(e.status().message(), "max_patch_fraction")) << e.status();
  }
  o.patches.max_patch_fraction = 1.0;
  EXPECT_TRUE(engine::Engine::Create(o, nullptr).ok());
}

}  // namespace
}  // namespace wpub::server
