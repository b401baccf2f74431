// The rollout group of colocated engines on the CPU (no GPU): a channel that shares each bucket
// (GroupChannel::Share, as core/rollout/ipc_channel.h does on the device) against SGLang-like
// HTTP engines (fake_http.h): the description reaches each engine's /update_weights_from_tensor
// request, in SGLang's session, and a channel that failed makes the next publication re-form the
// group (as the device channel's failure does after an engine died mid-handover).
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/escaping.h"
#include "core/rollout/rollout_group.h"
#include "core/rollout/torch_ipc.h"
#include "nlohmann/json.hpp"
#include "tests/rollout/fake_http.h"

namespace wpub::rollout {
namespace {

class SharingChannel final : public transport::GroupChannel {
 public:
  struct Counts {
    std::atomic<int> opens{0}, shares{0}, sends{0};
  };
  explicit SharingChannel(std::shared_ptr<Counts> counts) : counts_(std::move(counts)) {}
  absl::StatusOr<transport::GroupId> NewId() override { return transport::GroupId{}; }
  absl::Status Open(int, const transport::GroupId&, std::function<std::string(int)>) override {
    ++counts_->opens;
    std::lock_guard lock(mu_);
    open_ = true;
    failure_ = absl::OkStatus();
    return absl::OkStatus();
  }
  void Close() override {
    std::lock_guard lock(mu_);
    open_ = false;
  }
  bool usable() const override {
    std::lock_guard lock(mu_);
    return open_;
  }
  std::string Describe() const override { return "a sharing test channel"; }
  absl::Status WarmUp(absl::Time) override { return absl::OkStatus(); }
  void Begin(transport::PublicationWatch) override {}
  absl::StatusOr<std::optional<transport::SharedDeviceBytes>> Share(
      const transport::Bucket& bucket) override {
    ++counts_->shares;
    transport::SharedDeviceBytes s;
    s.mem_handle = std::string(64, '\x5a');
    s.event_handle = std::string(64, '\x00');
    s.nbytes = bucket.manifest.nbytes;
    s.allocation_bytes = bucket.manifest.nbytes;
    s.device_uuid = "GPU-00000000-0000-0000-0000-0000000000aa";
    s.ref_counter = "/wpub_test_counters";
    s.ref_counter_offset = 7;
    return std::optional<transport::SharedDeviceBytes>(std::move(s));
  }
  absl::Status Send(const transport::Bucket&, absl::Span<const uint64_t>) override {
    ++counts_->sends;
    return failure();
  }
  absl::Status WaitSent(absl::Time) override { return failure(); }
  void End() override {}
  void Fail(absl::Status why) override {
    std::lock_guard lock(mu_);
    if (failure_.ok()) failure_ = why;
    open_ = false;
  }
  absl::Status failure() const override {
    std::lock_guard lock(mu_);
    return failure_;
  }

 private:
  std::shared_ptr<Counts> counts_;
  mutable std::mutex mu_;
  bool open_ = false;
  absl::Status failure_;
};

transport::PublicationManifest Manifest(uint64_t version) {
  transport::PublicationManifest m;
  m.version = version;
  transport::BucketManifest b;
  b.index = 0;
  b.nbytes = 36;
  b.tensors.push_back({"model.norm.weight", DType::kFloat32, {1}, 0, 4});
  b.tensors.push_back({"lm_head.weight", DType::kBFloat16, {4, 4}, 4, 32});
  m.buckets.push_back(b);
  return m;
}

absl::Status Publish(RolloutGroup& g, uint64_t version) {
  const transport::PublicationManifest m = Manifest(version);
  absl::StatusOr<std::vector<std::string>> names = g.Begin(m);
  if (!names.ok()) return names.status();
  auto bucket = std::make_shared<transport::Bucket>();
  bucket->version = version;
  bucket->manifest = m.buckets[0];
  bucket->location = transport::BucketLocation::kDevice;  // the channel shares it
  absl::Status s = g.Send(bucket);
  if (s.ok()) s = g.WaitAcknowledged(absl::Now() + absl::Seconds(10));
  if (!s.ok()) {
    g.Abort(s.message());
    return s;
  }
  return g.Commit();
}

TEST(ColocatedGroup, EachBucketReachesTheEngineAsItsSharedDescriptionAndAFailureReforms) {
  testing::ScriptedEngine engine;
  auto counts = std::make_shared<SharingChannel::Counts>();
  RolloutGroupOptions o;
  o.colocated = true;
  o.engines = {{engine.url(), 1, "sglang-ipc"}};
  o.group_name = "wpub_coloc_test";
  o.engine_watch_interval = absl::ZeroDuration();
  o.publication_deadline = absl::Seconds(20);
  auto group = RolloutGroup::Create(o, std::make_unique<SharingChannel>(counts));
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ((*group)->capabilities().name, "ipc");
  ASSERT_TRUE(Publish(**group, 1).ok());
  EXPECT_EQ(counts->opens.load(), 1);
  EXPECT_EQ(counts->shares.load(), 1);
  // The engine's calls: no weight-update group joined, the bucket as tensors in the session.
  std::vector<std::string> updates;
  std::string body;
  const std::vector<std::string> calls = engine.calls();
  const std::vector<std::string> bodies = engine.bodies();
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_NE(calls[i], "/init_weights_update_group");
    // (The join's probe GETs the route with no body.)
    if (calls[i] == "/update_weights_from_tensor" && !bodies[i].empty()) {
      updates.push_back(calls[i]);
      body = bodies[i];
    }
  }
  ASSERT_EQ(updates.size(), 1u);
  const nlohmann::json j = nlohmann::json::parse(body);
  std::string pickle;
  ASSERT_TRUE(absl::Base64Unescape(j["serialized_named_tensors"][0].get<std::string>(), &pickle));
  EXPECT_NE(pickle.find(std::string(64, '\x5a')), std::string::npos) << "the shared handle";
  EXPECT_NE(pickle.find("lm_head.weight"), std::string::npos);
  // A channel that failed (an engine died mid-handover) is re-formed by the next publication.
  (*group)->Abort("test");
  ASSERT_TRUE(Publish(**group, 2).ok());
  EXPECT_EQ(counts->opens.load(), 2) << "the failed channel re-formed the group";
}

}  // namespace
}  // namespace wpub::rollout
