// Replays of the retained committed version against the transfer of a full publication of the
// same model, on the CPU path: a synthetic GLM-style MoE quantized to NVFP4 by the CPU reference.
//  (a) restore: `--engines` SGLang-like engines (load every bucket into their live weights on
//      receipt, core/transport/testing/fake_rollout_engine.h) -- Engine::Restore's wall clock
//      against the publication's transfer phase to the same engines;
//  (b) catch-up: a pull receiver (in process, verifies every checksum) that subscribes holding
//      nothing -- the catch-up's wall clock against the transfer phase of a publication to one
//      such receiver.
// Also the retained copy's size (held by reference on the CPU path: no bytes are copied).
//
// Usage: replay_bench [--layers=N] [--experts=N] [--hidden=N] [--moe_intermediate=N]
//                     [--iterations=N] [--engines=N] [--threads=N] [--bucket_mib=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "core/engine/engine.h"
#include "core/synthetic/synthetic.h"
#include "core/transport/testing/fake_rollout_engine.h"
#include "core/transport/testing/inproc_receiver.h"

namespace {

using namespace wpub;

struct Args {
  int layers = 4;
  int experts = 32;
  int64_t hidden = 2048;
  int64_t moe_intermediate = 768;
  int iterations = 3;
  int engines = 2;
  int threads = 2;
  uint64_t bucket_mib = 64;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    int64_t n = 0;
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos ||
        !absl::SimpleAtoi(arg.substr(eq + 1), &n) || n <= 0) {
      return false;
    }
    const std::string key = arg.substr(2, eq - 2);
    if (key == "layers")
      a->layers = static_cast<int>(n);
    else if (key == "experts")
      a->experts = static_cast<int>(n);
    else if (key == "hidden")
      a->hidden = n;
    else if (key == "moe_intermediate")
      a->moe_intermediate = n;
    else if (key == "iterations")
      a->iterations = static_cast<int>(n);
    else if (key == "engines")
      a->engines = static_cast<int>(n);
    else if (key == "threads")
      a->threads = static_cast<int>(n);
    else if (key == "bucket_mib")
      a->bucket_mib = static_cast<uint64_t>(n);
    else
      return false;
  }
  return true;
}

// The model's conversion batches with inline parts, and each tensor's bytes (batch, tensor).
std::vector<engine::BatchInput> Batches(const synthetic::SyntheticModel& model,
                                        std::vector<std::vector<std::vector<uint8_t>>>* bytes) {
  std::vector<engine::BatchInput> out;
  for (const synthetic::ConversionBatch& cb : model.batches()) {
    engine::BatchInput b;
    b.megatron_name = cb.megatron_name;
    std::vector<std::vector<uint8_t>> data;
    for (const TensorDesc& d : cb.tensors) {
      engine::TensorInput in;
      in.desc = d;
      in.parts.push_back(engine::TensorPart{engine::InlineSource{}, d.shape});
      b.tensors.push_back(std::move(in));
      std::vector<uint8_t> v(static_cast<size_t>(d.nbytes()));
      if (!synthetic::FillTensor(d, 7, absl::MakeSpan(v)).ok()) std::exit(1);
      data.push_back(std::move(v));
    }
    bytes->push_back(std::move(data));
    out.push_back(std::move(b));
  }
  return out;
}

// One publication of the model; its report (status must be committed).
engine::PublicationReport Publish(engine::Engine& e, uint64_t version,
                                  const std::vector<engine::BatchInput>& batches,
                                  const std::vector<std::vector<std::vector<uint8_t>>>& bytes) {
  engine::PublicationHeader h;
  h.version = version;
  h.recipe = "nvfp4";
  auto session = e.Open(h);
  if (!session.ok()) {
    std::fprintf(stderr, "open: %s\n", session.status().ToString().c_str());
    std::exit(1);
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    bool ok = (*session)->AddBatch(batches[i]).ok();
    for (size_t t = 0; ok && t < bytes[i].size(); ++t) {
      ok = (*session)->AppendInline(i, static_cast<uint32_t>(t), 0, 0, bytes[i][t]).ok();
    }
    if (!ok) {
      std::fprintf(stderr, "ingest failed\n");
      std::exit(1);
    }
  }
  absl::StatusOr<engine::PublicationReport> r = (*session)->Commit();
  if (!r.ok() || r->status != engine::PublicationStatus::kCommitted) {
    std::fprintf(stderr, "publication %llu did not commit: %s\n",
                 static_cast<unsigned long long>(version),
                 r.ok() ? r->error.c_str() : r.status().ToString().c_str());
    std::exit(1);
  }
  return *r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: replay_bench [--layers=N] [--experts=N] [--hidden=N] "
                 "[--moe_intermediate=N] [--iterations=N] [--engines=N] [--threads=N] "
                 "[--bucket_mib=N]\n");
    return 2;
  }
  synthetic::ModelShape shape = synthetic::ModelShape::Tiny(synthetic::NamingStyle::kGlm);
  shape.num_layers = a.layers;
  shape.num_experts = a.experts;
  shape.hidden_size = a.hidden;
  shape.moe_intermediate_size = a.moe_intermediate;
  shape.intermediate_size = 2 * a.hidden;
  absl::StatusOr<synthetic::SyntheticModel> model = synthetic::SyntheticModel::Create(shape);
  if (!model.ok()) return std::fprintf(stderr, "%s\n", model.status().ToString().c_str()), 2;
  std::vector<std::vector<std::vector<uint8_t>>> bytes;
  const std::vector<engine::BatchInput> batches = Batches(*model, &bytes);
  const uint64_t bytes_in = static_cast<uint64_t>(model->num_bytes());

  engine::EngineOptions options;
  options.bucket_bytes = a.bucket_mib << 20;
  options.cpu_threads = a.threads;
  options.retain = {.where = transport::RetainWhere::kHost};

  // (a) Restore to SGLang-like engines.
  std::vector<std::unique_ptr<transport::testing::FakeRolloutEngine>> fakes;
  engine::EngineComponents components;
  for (int i = 0; i < a.engines; ++i) {
    fakes.push_back(
        std::make_unique<transport::testing::FakeRolloutEngine>("engine-" + std::to_string(i)));
    // Borrowed: a pass-through owner the engine may destroy.
    struct Borrowed final : transport::Transport {
      explicit Borrowed(transport::Transport* t) : t(t) {}
      transport::Transport* t;
      transport::TransportCapabilities capabilities() const override { return t->capabilities(); }
      absl::StatusOr<std::vector<std::string>> Begin(
          const transport::PublicationManifest& m) override {
        return t->Begin(m);
      }
      absl::Status Send(std::shared_ptr<const transport::Bucket> b) override {
        return t->Send(std::move(b));
      }
      absl::Status WaitAcknowledged(absl::Time d) override { return t->WaitAcknowledged(d); }
      absl::Status Commit() override { return t->Commit(); }
      void Abort(absl::string_view r) override { t->Abort(r); }
      std::vector<transport::ReceiverOutcome> Outcomes() const override { return t->Outcomes(); }
      std::vector<transport::ReceiverInfo> Receivers() const override { return t->Receivers(); }
    };
    components.transports.push_back(std::make_unique<Borrowed>(fakes.back().get()));
  }
  std::vector<double> pub_transfer, pub_wall, restore;
  uint64_t retained_bytes = 0, bytes_out = 0;
  {
    auto e = engine::Engine::Create(options, nullptr, std::move(components));
    if (!e.ok()) return std::fprintf(stderr, "%s\n", e.status().ToString().c_str()), 1;
    for (int it = 0; it < a.iterations; ++it) {
      const engine::PublicationReport r = Publish(**e, 1 + it, batches, bytes);
      pub_transfer.push_back(r.phases.transfer);
      pub_wall.push_back(r.wall_seconds);
      bytes_out = r.bytes_out;
      absl::StatusOr<engine::ReplayReport> rr = (*e)->Restore("replay_bench");
      if (!rr.ok() || !rr->completed) {
        std::fprintf(stderr, "restore failed: %s\n",
                     rr.ok() ? rr->error.c_str() : rr.status().ToString().c_str());
        return 1;
      }
      restore.push_back(rr->seconds);
      retained_bytes = (*e)->GetStatus().retained.bytes;
    }
  }

  // (b) Catch-up of a pull receiver that subscribes holding nothing.
  std::vector<double> one_transfer, one_wall, catch_up;
  {
    auto e = engine::Engine::Create(options, nullptr);
    if (!e.ok()) return std::fprintf(stderr, "%s\n", e.status().ToString().c_str()), 1;
    for (int it = 0; it < a.iterations; ++it) {
      auto r0 = transport::testing::InprocReceiver::Start(
          (*e)->pull_transport(), {.name = "r" + std::to_string(it),
                                   .keep_tensors = false,
                                   .held_version = static_cast<uint64_t>(it)});
      const engine::PublicationReport r = Publish(**e, 1 + it, batches, bytes);
      one_transfer.push_back(r.phases.transfer);
      one_wall.push_back(r.wall_seconds);
      (*r0)->Stop();
      auto late = transport::testing::InprocReceiver::Start(
          (*e)->pull_transport(), {.name = "late" + std::to_string(it), .keep_tensors = false});
      if (!late.ok() || !(*late)->WaitForCommitted(1 + it, absl::Seconds(600))) {
        std::fprintf(stderr, "catch-up did not reach the late receiver\n");
        return 1;
      }
      std::vector<engine::ReplayReport> reports;
      for (int w = 0; w < 60000; ++w) {
        reports = (*e)->GetStatus().last_replays;
        if (static_cast<int>(reports.size()) > it) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (reports.empty() || !reports[0].completed) {
        std::fprintf(stderr, "no completed catch-up report\n");
        return 1;
      }
      catch_up.push_back(reports[0].seconds);
      (*late)->Stop();
    }
  }

  std::printf(
      "model: %d layers x %d experts, hidden %lld, moe_intermediate %lld: %.3f GB bf16 in, "
      "%.3f GB out (NVFP4 + high precision)\n",
      a.layers, a.experts, static_cast<long long>(a.hidden),
      static_cast<long long>(a.moe_intermediate), bytes_in / 1e9, bytes_out / 1e9);
  std::printf("retained copy: %.3f GB in host memory (the emitted buckets, held by reference)\n",
              retained_bytes / 1e9);
  std::printf(
      "| figure | median of %d | baseline (same run) | ratio |\n| --- | --- | --- | --- |\n",
      a.iterations);
  std::printf(
      "| restore to %d SGLang-like engines | %.4f s | publication transfer phase %.4f s "
      "(wall %.4f s) | %.2f |\n",
      a.engines, Median(restore), Median(pub_transfer), Median(pub_wall),
      Median(restore) / Median(pub_transfer));
  // A pull receiver reads at its own pace while the publication still quantizes: the
  // publication's transfer phase is only what remained after the last bucket was packed, so
  // the baseline of a catch-up is what it replaces -- the trainer publishing the version again.
  std::printf(
      "| catch-up of 1 late pull receiver (%.2f GB/s) | %.4f s | a publication of the version to "
      "1 receiver %.4f s (its transfer phase, overlapped with quantization: %.4f s) | %.3f |\n",
      bytes_out / 1e9 / Median(catch_up), Median(catch_up), Median(one_wall), Median(one_transfer),
      Median(catch_up) / Median(one_wall));
  return 0;
}
