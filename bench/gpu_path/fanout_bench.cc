// Fan-out benchmark (a program, not a test): one publisher on GPU 0, k receiving ranks on GPUs
// 1..k as C++ engines (multi_gpu_cpp_receiver: SGLang's weight-update routes over
// wpub::recv::nccl::ReceiverEndpoint, checksums on the device), engines of --tp GPUs each (TP ranks
// joining from their rank_offset, as SGLang engines do). For every k: the Qwen3-30B-A3B-shaped
// model published as NVFP4 (median wall clock of --iters after a warm-up), and a plain NCCL
// broadcast of the same bytes in bucket-sized messages through a group formed the same way (the
// transfer limit; busbw = algbw for a broadcast). Prints a table and writes JSON with --json.
// Usage: fanout_bench [--ranks 1,3,7] [--tp 1] [--iters 3] [--bucket_mib 1024] [--layers 48]
//        [--experts 128] [--json FILE] [--log_dir DIR] [--cpp_receiver PATH]
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_path/bench_util.h"
#include "bench/gpu_path/fill.h"
#include "core/rollout/rollout_group.h"
#include "tests/multi_gpu/loopback_transport.h"

namespace wpub::bench {
namespace {

using json = nlohmann::json;

struct Args {
  testing::MoeShape shape;
  RunSettings run;
  std::vector<int> ranks;  // receiving ranks per measurement; empty: 1 .. devices - 1
  int tp = 1;
  std::string json_path;
  std::string log_dir = "/tmp";
  std::string cpp_receiver;
};

Args Parse(int argc, char** argv) {
  Args a;
  a.shape = testing::Qwen3MoeShape();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") {
      for (absl::string_view r : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        int n = 0;
        if (!absl::SimpleAtoi(r, &n) || n < 1) {
          std::fprintf(stderr, "--ranks: '%s' is not a positive count\n", std::string(r).c_str());
          std::exit(2);
        }
        a.ranks.push_back(n);
      }
    } else if (k == "--tp") {
      a.tp = std::atoi(v.c_str());
    } else if (k == "--iters") {
      a.run.iters = std::atoi(v.c_str());
    } else if (k == "--bucket_mib") {
      a.run.bucket_bytes = std::strtoull(v.c_str(), nullptr, 10) << 20;
    } else if (k == "--layers") {
      a.shape.layers = std::atoi(v.c_str());
    } else if (k == "--experts") {
      a.shape.experts = std::atoi(v.c_str());
    } else if (k == "--json") {
      a.json_path = v;
    } else if (k == "--log_dir") {
      a.log_dir = v;
    } else if (k == "--cpp_receiver") {
      a.cpp_receiver = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.tp < 1) {
    std::fprintf(stderr, "--tp must be >= 1\n");
    std::exit(2);
  }
  return a;
}

// k receiving ranks on GPUs 1..k as engines of `tp` GPUs, each a child process; the engines'
// specs once every one answers /health.
std::vector<rollout::EngineSpec> StartEngines(const Args& args, int k, int generation,
                                              std::vector<std::unique_ptr<testing::Child>>* out) {
  std::vector<rollout::EngineSpec> specs;
  struct Started {
    testing::Child* child;
    int port;
    std::string log;
  };
  std::vector<Started> started;  // all spawned first, so the engines start together
  for (int g = 1; g <= k; g += args.tp) {
    std::vector<int> gpus;
    for (int i = g; i <= std::min(k, g + args.tp - 1); ++i) gpus.push_back(i);
    const int port = testing::FreePort();
    const std::string log =
        absl::StrCat(args.log_dir, "/fanout_", generation, "_engine", g, ".log");
    auto c = testing::SpawnCppReceiver(port, gpus, {"device"}, log, args.cpp_receiver);
    BENCH_OK(c.status());
    out->push_back(*std::move(c));
    started.push_back({out->back().get(), port, log});
    specs.push_back({absl::StrCat("http://127.0.0.1:", port), static_cast<int>(gpus.size())});
  }
  for (size_t i = 0; i < started.size(); ++i) {
    BENCH_OK(testing::WaitForHealth(*started[i].child, started[i].port, absl::Seconds(30),
                                    specs[i].url, started[i].log));
  }
  return specs;
}

int Main(int argc, char** argv) {
  Args args = Parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    std::fprintf(stderr, "fanout_bench needs 2 or more GPUs (found %d)\n", devices);
    return 1;
  }
  if (args.ranks.empty()) {
    for (int k = 1; k < devices; ++k) args.ranks.push_back(k);
  }
  for (int k : args.ranks) {
    if (k >= devices) {
      std::fprintf(stderr, "%d receiving ranks need %d GPUs; %d visible\n", k, k + 1, devices);
      return 1;
    }
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const testing::ModelLayout layout = testing::LayoutModel(args.shape);
  std::printf("device: %d x %s; model %.2f GB bf16; buckets of %lu MiB; engines of %d GPU(s)\n",
              devices, prop.name, layout.total_bytes / 1e9,
              static_cast<unsigned long>(args.run.bucket_bytes >> 20), args.tp);
  cudaSetDevice(0);
  void* model = nullptr;
  if (cudaMalloc(&model, layout.total_bytes) != cudaSuccess) return 1;
  if (FillBf16(model, layout.total_bytes / 2, 2026, nullptr) != cudaSuccess) return 1;
  cudaDeviceSynchronize();
  const auto* base = static_cast<const uint8_t*>(model);

  json rows = json::array();
  uint64_t version = 0;
  int generation = 0;
  for (const int k : args.ranks) {
    ++generation;
    std::vector<std::unique_ptr<testing::Child>> children;
    const std::vector<rollout::EngineSpec> specs = StartEngines(args, k, generation, &children);
    uint64_t bytes = 0;
    json pub;
    {
      // Three requests in flight: the C++ engines order them by wpub_sequence.
      auto transport = rollout::RolloutGroup::Create(testing::LoopbackTransportOptions(
          specs, absl::StrCat("wpub_fanout_", generation), 3, absl::Seconds(600)));
      BENCH_OK(transport.status());
      gpu::GpuBackendOptions bo;
      auto backend = gpu::GpuBackend::Create(bo);
      BENCH_OK(backend.status());
      const std::string label = absl::StrCat("wpub nvfp4 -> ", k, " ranks");
      pub = RunWpub(label.c_str(), true, args.run, layout, base, **backend, **transport, &version,
                    &bytes);
    }
    auto store = rendezvous::TcpStoreServer::Create({"127.0.0.1"});
    BENCH_OK(store.status());
    const std::string label = absl::StrCat("nccl bcast -> ", k, " ranks");
    json plain = RunPlainBroadcast(label.c_str(), bytes, args.run, specs, "/receive_raw", **store,
                                   generation);
    const double w = pub["wall_seconds"], p = plain["wall_seconds"];
    json row = {{"receiving_ranks", k},
                {"engines", specs.size()},
                {"tp", args.tp},
                {"bytes", bytes},
                {"wpub_wall_seconds", w},
                {"wpub_gbps", bytes / w / 1e9},
                {"bcast_wall_seconds", p},
                {"bcast_busbw_gbps", bytes / p / 1e9},
                {"wpub_over_bcast", w / p},
                {"wpub", pub},
                {"bcast", plain}};
    std::printf(
        "ranks %d (%zu engines): wpub %.4f s (%.1f GB/s), bcast %.4f s (busbw %.1f GB/s), "
        "ratio %.2f\n",
        k, specs.size(), w, bytes / w / 1e9, p, bytes / p / 1e9, w / p);
    std::fflush(stdout);
    rows.push_back(row);
  }
  json out = {{"device", prop.name},
              {"gpus", devices},
              {"tp", args.tp},
              {"bucket_bytes", args.run.bucket_bytes},
              {"iters", args.run.iters},
              {"model_bytes_bf16", layout.total_bytes},
              {"rows", rows}};
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  cudaFree(model);
  return 0;
}

}  // namespace
}  // namespace wpub::bench

int main(int argc, char** argv) { return wpub::bench::Main(argc, argv); }
