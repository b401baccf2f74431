// Delta publication on the GPU path (a program, not a test): a model shaped like Qwen3-30B-A3B
// (routed experts of [768, 2048] in NVFP4, attention and norms in BF16) in GPU 0 memory, moved by
// an RL-like update model step after step and published by the engine as wpubd runs it -- the
// GPU backend, the retained copy in device memory, gRPC pull -- to a wpub-recv receiver
// (clients/recv, in process, over the daemon's gRPC service on loopback), twice:
//   full     every version whole (wpubd --retain=device),
//   patches  every version after the first as bucket patches (wpubd --retain=device --patches
//            --patches_full_every=0): the engine diffs each bucket against the retained copy on
//            the device and only the patch crosses to the host and the wire.
// The update model (bench/gpu_path/fill.h, FillAdamBf16): an fp32 master with AdamW at --lr on
// i.i.d. N(0, 1) gradients, its bf16 copy published each step; --warmup steps are published and
// not counted (Adam's first steps are its largest). Per version and mode: the publication's wall
// clock (Open .. Commit returned: every receiver acknowledged every bucket, rebuilt and checked
// against the whole bucket's checksum), its phases, the bytes the receiver pulled, the buckets
// that came as patches; and after each version a digest of the receiver's buckets (checksums of
// every bucket, summed) that must be the same in both modes: the patched receiver holds every
// version byte for byte. The CUDA IPC mapping is replaced by pointers into this process's model
// allocation (the engine reads them in place, as it reads mapped trainer memory).
// With --nccl_engine WPUB_RECV the receiver is instead an NCCL engine: that wpub-recv binary
// started as `--engine_listen --engine_patches` on GPU 0 (a host identity of its own: NCCL's
// socket transport when it shares the GPU), in a weight-update group of the engine's rollout
// group -- the patches mode broadcasts each bucket's format 3 patch, made on the device against
// the retained copy, which the engine applies to its kept weights on the GPU and verifies; the
// bytes are then those broadcast, the digest the sum of the engine's bucket checksums (/stats).
// Usage: delta_bench [--layers 24] [--experts 128] [--hidden 2048] [--inter 768]
//        [--bucket_mib 512] [--versions 10] [--full_versions N] [--warmup 2] [--lr 1e-6]
//        [--init_std 0.02] [--seed 2026] [--patch_threads 8] [--nccl_engine WPUB_RECV]
//        [--json FILE]
// The patches mode runs first; --full_versions (default --versions) bounds the full mode's
// counted versions, whose pulls are the slow half (the whole model through the pull transport
// each version). The digests are compared over the versions both modes ran; the time ratio is
// each patched version's wall clock over the full mode's median, the bytes ratio its pulled
// bytes over a full version's (bytes_out: what a whole pull takes).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/gpu_path/bench_util.h"
#include "bench/gpu_path/fill.h"
#include "clients/recv/receiver.h"
#include "core/common/parallel_for.h"
#include "core/engine/engine.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/retained_memory.h"
#include "core/rollout/rollout_group.h"
#include "core/transport/checksum.h"
#include "nlohmann/json.hpp"
#include "server/service/daemon_server.h"
#include "tests/multi_gpu/loopback_transport.h"
#include "tests/multi_gpu/moe_fixture.h"
#include "tests/multi_gpu/shared_gpu.h"

namespace wpub::bench {
namespace {

using json = nlohmann::json;

struct Args {
  testing::MoeShape shape;
  uint64_t bucket_bytes = uint64_t{512} << 20;
  int versions = 10;
  int full_versions = -1;  // -1: as many as --versions
  int warmup = 2;
  double lr = 1e-6;
  double init_std = 0.02;
  uint64_t seed = 2026;
  int patch_threads = 8;    // the receiver's (ReceiverOptions::patch_threads)
  std::string nccl_engine;  // a wpub-recv binary: the receiver is its NCCL engine
  std::string json_path;
};

Args Parse(int argc, char** argv) {
  Args a;
  a.shape = testing::Qwen3MoeShape();
  a.shape.layers = 24;  // bf16 model + two retained versions fit an 80 GB GPU
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--layers") {
      a.shape.layers = std::atoi(v.c_str());
    } else if (k == "--experts") {
      a.shape.experts = std::atoi(v.c_str());
    } else if (k == "--hidden") {
      a.shape.hidden = std::atoll(v.c_str());
    } else if (k == "--inter") {
      a.shape.inter = std::atoll(v.c_str());
    } else if (k == "--bucket_mib") {
      a.bucket_bytes = std::strtoull(v.c_str(), nullptr, 10) << 20;
    } else if (k == "--versions") {
      a.versions = std::atoi(v.c_str());
    } else if (k == "--full_versions") {
      a.full_versions = std::atoi(v.c_str());
    } else if (k == "--warmup") {
      a.warmup = std::atoi(v.c_str());
    } else if (k == "--lr") {
      a.lr = std::atof(v.c_str());
    } else if (k == "--init_std") {
      a.init_std = std::atof(v.c_str());
    } else if (k == "--patch_threads") {
      a.patch_threads = std::atoi(v.c_str());
    } else if (k == "--seed") {
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "--nccl_engine") {
      a.nccl_engine = v;
    } else if (k == "--json") {
      a.json_path = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.full_versions < 0 || a.full_versions > a.versions) a.full_versions = a.versions;
  if (a.full_versions == 0 || a.versions < 1) {
    std::fprintf(stderr, "--versions and --full_versions must be >= 1\n");
    std::exit(2);
  }
  return a;
}

// The CUDA IPC mapping of this benchmark: a part's `offset` is its offset in the model's
// allocation (the handle is not opened: the model lives in this process).
class InProcessResolver final : public engine::CudaIpcResolver {
 public:
  InProcessResolver(const uint8_t* base, uint64_t bytes) : base_(base), bytes_(bytes) {}
  absl::StatusOr<const uint8_t*> Resolve(const engine::CudaIpcSource& source,
                                         uint64_t expected_bytes,
                                         absl::string_view tensor) override {
    if (source.offset + expected_bytes > bytes_) {
      return absl::OutOfRangeError(absl::StrCat(tensor, " is outside the model"));
    }
    return base_ + source.offset;
  }
  void EndPublication() override {}

 private:
  const uint8_t* const base_;
  const uint64_t bytes_;
};

// One batch per tensor, but an up_proj joins its gate_proj's (the pair shares one global amax:
// the policy wants both in one conversion batch), each read in place from the model.
std::vector<engine::BatchInput> Batches(const testing::ModelLayout& layout) {
  std::vector<engine::BatchInput> out;
  std::vector<size_t> batch_of(layout.tensors.size());
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const testing::ModelTensor& t = layout.tensors[i];
    engine::CudaIpcSource ipc;
    ipc.handle[0] = 1;
    ipc.device_uuid = "GPU-00000000-0000-0000-0000-000000000000";
    ipc.offset = t.offset;
    ipc.length = t.nbytes;
    engine::TensorInput in;
    in.desc = TensorDesc{t.name, t.dtype, t.shape};
    in.parts.push_back({ipc, t.shape});
    if (t.pair >= 0 && static_cast<size_t>(t.pair) < i) {
      batch_of[i] = batch_of[static_cast<size_t>(t.pair)];
      out[batch_of[i]].tensors.push_back(std::move(in));
      continue;
    }
    batch_of[i] = out.size();
    out.push_back({t.name, {std::move(in)}});
  }
  return out;
}

// Sum of the checksums of the receiver's buckets of its committed version (0: none).
uint64_t Digest(const recv::Receiver& r) {
  const std::shared_ptr<const recv::CommittedModel> m = r.committed();
  if (m == nullptr) return 0;
  std::vector<uint64_t> sums(m->buckets.size());
  ParallelFor(sums.size(), 16, [&](size_t i) {
    sums[i] = transport::Checksum(m->buckets[i].data(), m->buckets[i].size());
  });
  uint64_t digest = 0;
  for (uint64_t s : sums) digest += s;
  return digest;
}

// The NCCL engine of --nccl_engine: a wpub-recv process keeping its weights on GPU 0, and the
// rollout group that reaches it.
struct NcclEngine {
  std::unique_ptr<testing::Child> process;
  int port = 0;
  rollout::RolloutGroup* group = nullptr;  // owned by the engine

  static NcclEngine Start(const Args& args, const std::string& log) {
    NcclEngine e;
    e.port = testing::FreePort();
    auto child =
        testing::Child::Spawn({args.nccl_engine, absl::StrCat("--engine_listen=127.0.0.1:", e.port),
                               "--gpu_device=0", "--engine_patches", "--log_level=warn"},
                              log, /*pipes=*/false, testing::OwnNcclHostEnv(true));
    BENCH_OK(child.status());
    e.process = *std::move(child);
    BENCH_OK(testing::WaitForHealth(*e.process, e.port, absl::Seconds(60), "the NCCL engine", log));
    return e;
  }
  std::unique_ptr<rollout::RolloutGroup> Group() {
    rollout::RolloutGroupOptions o = testing::LoopbackTransportOptions(
        {{absl::StrCat("http://127.0.0.1:", port), 1}}, "wpub_delta", 1, absl::Seconds(600));
    o.join_timeout = absl::Seconds(120);
    o.engine_watch_interval = absl::ZeroDuration();
    auto g = rollout::RolloutGroup::Create(o);
    BENCH_OK(g.status());
    group = g->get();
    return *std::move(g);
  }
  // The engine's checksums of `version`'s buckets, summed (0: it has none).
  uint64_t Digest(uint64_t version) const {
    auto body = testing::HttpGet(port, "/stats");
    BENCH_OK(body.status());
    const json j = json::parse(*body, nullptr, false);
    const std::string v = std::to_string(version);
    uint64_t digest = 0;
    if (j.is_object() && j.contains(v)) {
      for (const json& c : j[v]["checksums"]) digest += c.get<uint64_t>();
    }
    return digest;
  }
};

struct VersionRow {
  uint64_t version = 0;
  double wall = 0, quantize = 0, transfer = 0, commit = 0;
  uint64_t bytes_out = 0, pulled = 0, patched = 0, buckets = 0, syncs = 0, digest = 0;
  double patch_pull = 0, patch_rebuild = 0;  // the receiver's (ReceiverStats)
};

std::vector<VersionRow> RunVersions(bool patches, int versions, const Args& args,
                                    const testing::ModelLayout& layout, uint8_t* model,
                                    engine::Engine& eng, recv::Receiver* receiver,
                                    const NcclEngine* engine);

// Every step of the update model published in one mode; the rows of the counted versions.
std::vector<VersionRow> RunMode(bool patches, int versions, const Args& args,
                                const testing::ModelLayout& layout, uint8_t* model) {
  engine::EngineOptions eo;
  eo.bucket_bytes = args.bucket_bytes;
  eo.max_bucket_bytes = std::max(eo.max_bucket_bytes, args.bucket_bytes);
  eo.ack_deadline = absl::Seconds(600);
  eo.retain.where = transport::RetainWhere::kDevice;
  eo.patches.enabled = patches;
  eo.patches.full_every = 0;  // never forced: the figure is the steady state
  engine::EngineComponents components;
  gpu::GpuBackendOptions bo;
  bo.overlap_ctas_per_sm = 0;  // nothing is broadcast beside the kernels
  auto backend = gpu::GpuBackend::Create(bo);
  BENCH_OK(backend.status());
  components.backend = *std::move(backend);
  auto memory = gpu::GpuRetainedMemory::Create({0, transport::RetainWhere::kDevice});
  BENCH_OK(memory.status());
  components.retained_memory = *memory;
  components.cuda_ipc = std::make_unique<InProcessResolver>(model, layout.total_bytes);
  const bool nccl = !args.nccl_engine.empty();
  NcclEngine engine;
  if (nccl) {
    const char* dir = std::getenv("WPUB_TEST_LOG_DIR");
    engine =
        NcclEngine::Start(args, absl::StrCat(dir != nullptr ? dir : "/tmp", "/delta_bench_engine_",
                                             patches ? "patches" : "full", ".log"));
    components.transports.push_back(engine.Group());
  }
  auto eng = engine::Engine::Create(eo, nullptr, std::move(components));
  BENCH_OK(eng.status());
  if (nccl) return RunVersions(patches, versions, args, layout, model, **eng, nullptr, &engine);
  server::DaemonServerOptions so;
  so.listen = "127.0.0.1:0";
  so.max_message_bytes = 64 << 20;
  auto srv = server::DaemonServer::Create(so, eng->get());
  BENCH_OK(srv.status());
  recv::ReceiverOptions ro;
  ro.target = absl::StrCat("127.0.0.1:", (*srv)->port());
  ro.name = patches ? "patched" : "whole";
  ro.patches = patches;
  ro.patch_threads = args.patch_threads;
  auto receiver = recv::Receiver::Create(ro);
  BENCH_OK(receiver.status());
  absl::Status run_status;
  std::thread thread([&] { run_status = (*receiver)->Run(); });
  for (int i = 0; (*eng)->pull_transport()->Receivers().empty(); ++i) {
    if (i == 6000) {
      std::fprintf(stderr, "the receiver did not subscribe\n");
      std::exit(1);
    }
    absl::SleepFor(absl::Milliseconds(5));
  }

  std::vector<VersionRow> rows =
      RunVersions(patches, versions, args, layout, model, **eng, receiver->get(), nullptr);
  (*receiver)->Stop();
  thread.join();
  (*srv)->Shutdown(absl::Now() + absl::Seconds(10));
  return rows;
}

// The update model's steps published by `eng` to `receiver` (gRPC pull) or `engine` (NCCL).
std::vector<VersionRow> RunVersions(bool patches, int versions, const Args& args,
                                    const testing::ModelLayout& layout, uint8_t* model,
                                    engine::Engine& eng, recv::Receiver* receiver,
                                    const NcclEngine* engine) {
  const std::vector<engine::BatchInput> batches = Batches(layout);
  std::vector<VersionRow> rows;
  for (int step = 1; step <= args.warmup + versions; ++step) {
    if (FillAdamBf16(model, layout.total_bytes / 2, args.seed, step, static_cast<float>(args.lr),
                     static_cast<float>(args.init_std), nullptr) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      std::fprintf(stderr, "the update model's fill failed\n");
      std::exit(1);
    }
    const recv::ReceiverStats before =
        receiver != nullptr ? receiver->stats() : recv::ReceiverStats{};
    engine::PublicationHeader header;
    header.version = static_cast<uint64_t>(step);
    header.model_id = "qwen3-moe-delta-bench";
    header.recipe = "nvfp4";
    auto session = eng.Open(header);
    BENCH_OK(session.status());
    for (const engine::BatchInput& b : batches) BENCH_OK((*session)->AddBatch(b));
    auto report = (*session)->Commit();
    BENCH_OK(report.status());
    if (report->status != engine::PublicationStatus::kCommitted) {
      std::fprintf(stderr, "v%d did not commit: %s\n", step, report->error.c_str());
      std::exit(1);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (receiver != nullptr &&
           receiver->stats().last_committed_version < static_cast<uint64_t>(step)) {
      if (absl::Now() > deadline) {
        std::fprintf(stderr, "the receiver did not apply v%d\n", step);
        std::exit(1);
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    const recv::ReceiverStats after =
        receiver != nullptr ? receiver->stats() : recv::ReceiverStats{};
    VersionRow row;
    row.version = static_cast<uint64_t>(step);
    row.wall = report->wall_seconds;
    row.quantize = report->phases.quantize;
    row.transfer = report->phases.transfer;
    row.commit = report->phases.commit;
    row.bytes_out = report->bytes_out;
    row.buckets = report->buckets;
    row.syncs = report->host_syncs;
    row.pulled = after.bytes - before.bytes;
    row.patched = after.patched_buckets - before.patched_buckets;
    row.patch_pull = after.patch_pull_seconds - before.patch_pull_seconds;
    row.patch_rebuild = after.patch_rebuild_seconds - before.patch_rebuild_seconds;
    if (receiver != nullptr) {
      row.digest = Digest(*receiver);
    } else {  // what was broadcast, and what the engine holds
      const rollout::EnginePatchStats p = engine->group->last_patches();
      row.pulled = p.patch_bytes + p.whole_bytes;
      row.patched = p.patched_buckets;
      row.digest = engine->Digest(row.version);
    }
    std::printf(
        "%-8s v%-3d wall %7.3f s (quantize %7.3f, transfer %7.3f, commit %6.3f)  %12lu B out  "
        "pulled %12lu B (%7.4f%%)  %3lu of %3lu buckets patched (pull %6.3f s, rebuild %6.3f s)  "
        "%lu host syncs%s\n",
        patches ? "patches" : "full", step, row.wall, row.quantize, row.transfer, row.commit,
        static_cast<unsigned long>(row.bytes_out), static_cast<unsigned long>(row.pulled),
        100.0 * static_cast<double>(row.pulled) / static_cast<double>(row.bytes_out),
        static_cast<unsigned long>(row.patched), static_cast<unsigned long>(row.buckets),
        row.patch_pull, row.patch_rebuild, static_cast<unsigned long>(row.syncs),
        step <= args.warmup ? "  (warm-up)" : "");
    std::fflush(stdout);
    if (step > args.warmup) rows.push_back(row);
  }
  return rows;
}

int Main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "delta_bench needs a GPU\n");
    return 1;
  }
  // The NCCL engine shares GPU 0: this process's rank needs a host identity of its own.
  testing::AdoptOwnNcclHost(!args.nccl_engine.empty());
  cudaSetDevice(0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const testing::ModelLayout layout = testing::LayoutModel(args.shape);
  std::printf(
      "device: %s; model: %d layers, %d experts [%ld, %ld]: %.2f GB bf16 (%.2f GB routed "
      "experts); buckets of %lu MiB; AdamW lr %g on N(0,1) gradients, master N(0, %g); %d "
      "warm-up + %d versions\n",
      prop.name, args.shape.layers, args.shape.experts, static_cast<long>(args.shape.inter),
      static_cast<long>(args.shape.hidden), layout.total_bytes / 1e9, layout.expert_bytes / 1e9,
      static_cast<unsigned long>(args.bucket_bytes >> 20), args.lr, args.init_std, args.warmup,
      args.versions);
  void* model = nullptr;
  if (cudaMalloc(&model, layout.total_bytes) != cudaSuccess) {
    std::fprintf(stderr, "cannot allocate %lu bytes on GPU 0\n",
                 static_cast<unsigned long>(layout.total_bytes));
    return 1;
  }
  const std::vector<VersionRow> patched =
      RunMode(true, args.versions, args, layout, static_cast<uint8_t*>(model));
  const std::vector<VersionRow> full =
      RunMode(false, args.full_versions, args, layout, static_cast<uint8_t*>(model));
  cudaFree(model);

  std::vector<double> full_wall, patch_wall;
  for (const VersionRow& f : full) full_wall.push_back(f.wall);
  const double full_median = Median(full_wall);
  const uint64_t full_bytes = full.empty() ? 0 : full.front().bytes_out;
  json versions = json::array();
  std::vector<double> byte_ratio, time_ratio;
  bool same = !full.empty();
  for (size_t i = 0; same && i < patched.size(); ++i) {
    const VersionRow& p = patched[i];
    const VersionRow* f = i < full.size() ? &full[i] : nullptr;
    if (f != nullptr) same = f->digest == p.digest && f->bytes_out == p.bytes_out;
    byte_ratio.push_back(static_cast<double>(p.pulled) / static_cast<double>(full_bytes));
    time_ratio.push_back(p.wall / full_median);
    patch_wall.push_back(p.wall);
    json row = {{"version", p.version},
                {"patches_wall_seconds", p.wall},
                {"patches_quantize_seconds", p.quantize},
                {"patches_transfer_seconds", p.transfer},
                {"patches_commit_seconds", p.commit},
                {"patches_receiver_pull_seconds", p.patch_pull},
                {"patches_receiver_rebuild_seconds", p.patch_rebuild},
                {"bytes_out", p.bytes_out},
                {"patches_pulled_bytes", p.pulled},
                {"patched_buckets", p.patched},
                {"buckets", p.buckets},
                {"patches_host_syncs", p.syncs},
                {"bytes_ratio", byte_ratio.back()},
                {"time_ratio", time_ratio.back()}};
    if (f != nullptr) {
      row.update({{"full_wall_seconds", f->wall},
                  {"full_quantize_seconds", f->quantize},
                  {"full_transfer_seconds", f->transfer},
                  {"full_commit_seconds", f->commit},
                  {"full_pulled_bytes", f->pulled},
                  {"full_host_syncs", f->syncs},
                  {"digest_equal", f->digest == p.digest}});
    }
    versions.push_back(row);
  }
  if (!same) {
    std::fprintf(stderr, "the patched receiver does not hold what the whole one holds\n");
    return 1;
  }
  const double bytes_median = Median(byte_ratio), time_median = Median(time_ratio);
  std::printf(
      "\nmedian over %zu patched versions: bytes pulled %.4f%% of a full version; publication "
      "%.3f s vs %.3f s full (median of %zu) = %.3fx; the %zu versions both modes ran hold "
      "identical buckets\n",
      patched.size(), 100 * bytes_median, Median(patch_wall), full_median, full.size(), time_median,
      std::min(full.size(), patched.size()));
  json out = {{"device", prop.name},
              {"receiver", args.nccl_engine.empty() ? "wpub-recv (gRPC pull)"
                                                    : "wpub-recv NCCL engine (--engine_patches)"},
              {"layers", args.shape.layers},
              {"experts", args.shape.experts},
              {"bucket_mib", args.bucket_bytes >> 20},
              {"lr", args.lr},
              {"patch_threads", args.patch_threads},
              {"init_std", args.init_std},
              {"warmup", args.warmup},
              {"model", "fp32 master, AdamW(0.9, 0.999, 1e-8) on i.i.d. N(0,1) gradients"},
              {"versions", versions},
              {"median_bytes_ratio", bytes_median},
              {"median_time_ratio", time_median},
              {"full_versions", full.size()},
              {"median_full_wall_seconds", full_median},
              {"median_patches_wall_seconds", Median(patch_wall)}};
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  return 0;
}

}  // namespace
}  // namespace wpub::bench

int main(int argc, char** argv) { return wpub::bench::Main(argc, argv); }
