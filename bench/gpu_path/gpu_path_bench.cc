// GPU publication path benchmark (a program, not a test): a synthetic model shaped like
// Qwen3-30B-A3B (48 layers, 128 routed experts of [768, 2048], hidden 2048, attention and norms
// in BF16) in GPU 0 memory, published to GPU 1 (or, on a machine of one GPU, to engines sharing
// GPU 0 over NCCL's loopback sockets: correct bytes, a socket's speed), measured in one run:
//   (a) wpub NVFP4: GPU backend (amax, quantize, pack, checksums) + NCCL transport, to a C++
//       engine on GPU 1 (multi_gpu_cpp_receiver: SGLang's weight-update routes over
//       wpub::recv::nccl::ReceiverEndpoint, every bucket checksummed on the device), three update
//       requests in flight;
//   (a-emu) the same to the SGLang emulator on GPU 1 (Python, torch.distributed as SGLang uses
//       it, one HTTP request per bucket handled in Python);
//   (a1) as (a) with one update request in flight per engine (SGLang's protocol); (a2) with two;
//   (a') as (a) with the amax pass pipelined per bucket (non-finite weights rejected after the
//       transfer, before commit);
//   (b) wpub BF16 passthrough of the same model to the C++ engine; (b-emu) to the emulator;
//   (d) a plain NCCL broadcast of (a)'s byte count (and of (b)'s), in bucket-sized messages,
//       through a group formed the same way: the transfer limit.
//   (e) the GPU backend alone (NVFP4 and BF16) into a sink that discards each bucket once it
//       is packed: the backend's own speed, without the receiver's per-bucket pace.
// (c), the PyTorch per-expert baseline, is torch_baseline.py (run_h200x2.sh runs both).
// Each case: warm-up, then --iters timed publications; median wall clock, device phases, GB/s
// (bytes published / wall, GB = 1e9), host syncs, and the ratios. JSON with --json.
// Usage: gpu_path_bench [--layers 48] [--experts 128] [--hidden 2048] [--inter 768]
//        [--bucket_mib 512] [--iters 3] [--json FILE] [--log_dir DIR] [--copy_gbps 4293]
//        [--cpp_receiver PATH] [--compute_sms N] [--sm_sweep N,N,...] [--kernel_trace 1]
//        [--ctas_per_sm N] [--ctas_sweep N,N,...] [--backend_only 1] [--nccl_ctas N]
//        [--pause_windows 1] [--restore 1]
// --nccl_ctas N sets NCCL's channel count on both sides of every group: wpub's communicators and
// the C++ engine's through their configs, the emulator's through NCCL_MIN_CTAS/NCCL_MAX_CTAS in
// its environment.
// --backend_only 1 runs case (e) alone, which needs one GPU.
// --colocated 1 runs (e) and (g) alone on GPU 0: (g) the same publication handed over in GPU
// memory (CUDA IPC, core/rollout/ipc_channel.h) to colocated SGLang emulators on the same GPU
// (/update_weights_from_tensor with torch's own rebuild; each copies every bucket whole,
// --tensor-load=bucket, so the row is the handover's cost and not a Python loop over tensors),
// one with TP=1 and, as (g2), one engine of TP=2; the goal is (g) <= 1.15x (e).
// --pause_windows 1 runs (a), (a1) and (a-emu) alone and prints each engine's pause window (its
// pause answered .. its resume answered: waiting for wpub, transfer, finalization) against the
// transfer.
// --restore 1 runs the retained copy's cases alone (core/transport/retained_copy.h): (a) without
// a copy, then (a) with the copy kept in device, pinned and host memory (its cost on the
// publication), each followed by --iters restores of the retained version to the C++ engine
// (the replay's transport calls: Begin with the replay manifest, every retained bucket, the
// acknowledgements, Commit), against (a)'s transfer phase and the plain broadcast (d) of the
// same bytes.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_path/bench_util.h"
#include "bench/gpu_path/fill.h"
#include "bench/gpu_path/kernel_trace.h"
#include "core/gpu/gpu_backend.h"
#include "core/gpu/retained_memory.h"
#include "core/nccl/nccl_comm.h"
#include "core/nccl/nccl_transport.h"
#include "core/rendezvous/tcp_store_server.h"
#include "core/rollout/ipc_channel.h"
#include "core/rollout/rollout_group.h"
#include "core/rollout/sglang_driver.h"
#include "core/transport/pull_transport.h"
#include "core/transport/retained_copy.h"
#include "core/transport/testing/inproc_receiver.h"
#include "core/transport/transport_group.h"
#include "nlohmann/json.hpp"
#include "tests/multi_gpu/loopback_transport.h"
#include "tests/multi_gpu/moe_fixture.h"
#include "tests/multi_gpu/shared_gpu.h"

namespace wpub::bench {
namespace {

using json = nlohmann::json;

struct Args {
  testing::MoeShape shape;
  uint64_t bucket_bytes = uint64_t{512} << 20;
  int iters = 3;
  std::string json_path;
  std::string log_dir = "/tmp";
  double copy_gbps = 4293;      // D2D copy (read + write) on the lent H200, engines spec
  std::string cpp_receiver;     // default: multi_gpu_cpp_receiver next to this binary
  int compute_sms = 0;          // GpuBackendOptions::compute_sms of every wpub case
  std::vector<int> sm_sweep;    // extra (a)/(a') rows with the compute stream on this many SMs
  bool kernel_trace = false;    // extra traced publications: what runs beside each broadcast
  int ctas_per_sm = 3;          // GpuBackendOptions::overlap_ctas_per_sm of every wpub case
  std::vector<int> ctas_sweep;  // extra (a)/(a') rows with that cap (0: none)
  bool backend_only = false;    // case (e) alone, on one GPU
  bool colocated = false;       // --colocated 1: (e) against (g), colocated engines, one GPU
  bool pause_windows = false;   // --pause_windows 1: (a), (a1), (a-emu) with pause windows
  bool restore = false;         // --restore 1: the retained copy's cost and its restores
  int nccl_ctas = 0;            // NcclCommOptions::ctas on both sides (0: NCCL's choice)
};

// "4,8,16" -> {4, 8, 16}.
std::vector<int> IntList(const std::string& v) {
  std::vector<int> out;
  for (absl::string_view n : absl::StrSplit(v, ',', absl::SkipEmpty())) {
    out.push_back(std::atoi(std::string(n).c_str()));
  }
  return out;
}

Args Parse(int argc, char** argv) {
  Args a;
  a.shape = testing::Qwen3MoeShape();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--layers")
      a.shape.layers = std::atoi(v.c_str());
    else if (k == "--experts")
      a.shape.experts = std::atoi(v.c_str());
    else if (k == "--hidden")
      a.shape.hidden = std::atoll(v.c_str());
    else if (k == "--inter")
      a.shape.inter = std::atoll(v.c_str());
    else if (k == "--bucket_mib")
      a.bucket_bytes = std::strtoull(v.c_str(), nullptr, 10) << 20;
    else if (k == "--iters")
      a.iters = std::atoi(v.c_str());
    else if (k == "--json")
      a.json_path = v;
    else if (k == "--log_dir")
      a.log_dir = v;
    else if (k == "--copy_gbps")
      a.copy_gbps = std::atof(v.c_str());
    else if (k == "--cpp_receiver")
      a.cpp_receiver = v;
    else if (k == "--compute_sms")
      a.compute_sms = std::atoi(v.c_str());
    else if (k == "--sm_sweep")
      a.sm_sweep = IntList(v);
    else if (k == "--nccl_ctas")
      a.nccl_ctas = std::atoi(v.c_str());
    else if (k == "--ctas_per_sm")
      a.ctas_per_sm = std::atoi(v.c_str());
    else if (k == "--ctas_sweep")
      a.ctas_sweep = IntList(v);
    else if (k == "--kernel_trace")
      a.kernel_trace = v != "0";
    else if (k == "--backend_only")
      a.backend_only = v != "0";
    else if (k == "--colocated")
      a.colocated = v != "0";
    else if (k == "--pause_windows")
      a.pause_windows = v != "0";
    else if (k == "--restore")
      a.restore = v != "0";
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Case (e): a transport of one pretend participant that reads device buckets and discards each
// after its `ready` event (`done` is recorded right after it on its own stream).
class DiscardSink final : public transport::Transport {
 public:
  DiscardSink() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~DiscardSink() override { cudaStreamDestroy(stream_); }
  transport::TransportCapabilities capabilities() const override {
    transport::TransportCapabilities c;
    c.name = "discard";
    c.accepts = transport::kHostOrDevice;
    return c;
  }
  absl::StatusOr<std::vector<std::string>> Begin(const transport::PublicationManifest&) override {
    return std::vector<std::string>{"discard"};
  }
  absl::Status Send(std::shared_ptr<const transport::Bucket> b) override {
    if (b->location != transport::BucketLocation::kDevice) return absl::OkStatus();
    if (cudaStreamWaitEvent(stream_, b->device.ready, 0) != cudaSuccess ||
        cudaEventRecord(b->device.done, stream_) != cudaSuccess) {
      return absl::InternalError("discarding sink: event calls failed");
    }
    return absl::OkStatus();
  }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  std::vector<transport::ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<transport::ReceiverInfo> Receivers() const override { return {}; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Case (f): the GPU backend publishing to one in-process gRPC-pull receiver.
json RunPull(const char* label, const RunSettings& run, const testing::ModelLayout& layout,
             const uint8_t* model, const Args& args, uint64_t* version) {
  auto pull = transport::PullTransport::Create({});
  BENCH_OK(pull.status());
  transport::testing::InprocReceiverOptions ro;
  ro.name = "bench-pull";
  ro.keep_tensors = false;
  auto receiver = transport::testing::InprocReceiver::Start(pull->get(), ro);
  BENCH_OK(receiver.status());
  while ((*pull)->Receivers().empty()) absl::SleepFor(absl::Milliseconds(1));
  gpu::GpuBackendOptions bo;
  bo.compute_sms = args.compute_sms;
  bo.overlap_ctas_per_sm = 0;  // nothing is broadcast beside the kernels
  auto backend = gpu::GpuBackend::Create(bo);
  BENCH_OK(backend.status());
  uint64_t unused = 0;
  json row = RunWpub(label, true, run, layout, model, **backend, **pull, version, &unused);
  if ((*receiver)->checksum_mismatches() != 0) {
    std::fprintf(stderr, "%s: the receiver saw checksum mismatches\n", label);
    std::exit(1);
  }
  return row;
}

// --colocated 1: (e), then (g) and (g2) -- the same publication to colocated SGLang emulators on
// GPU 0 through an IpcChannel rollout group (TP=1, then one engine of TP=2).
int RunColocated(const Args& args, const RunSettings& run, const testing::ModelLayout& layout,
                 const uint8_t* model, const char* device) {
  DiscardSink discard;
  gpu::GpuBackendOptions bo;
  bo.compute_sms = args.compute_sms;
  bo.overlap_ctas_per_sm = 0;  // nothing is broadcast beside the kernels
  auto backend = gpu::GpuBackend::Create(bo);
  BENCH_OK(backend.status());
  uint64_t version = 0, unused = 0;
  json rows = json::array();
  rows.push_back(RunWpub("(e) backend only nvfp4", true, run, layout, model, **backend, discard,
                         &version, &unused));
  for (int tp : {1, 2}) {
    const int port = testing::FreePort();
    auto emulator = testing::StartEmulator(
        port, 0, {"--tensor-load=bucket", "--timings", absl::StrCat("--tp=", tp)},
        absl::StrCat(args.log_dir, "/bench_colocated_tp", tp, ".log"));
    BENCH_OK(emulator.status());
    rollout::RolloutGroupOptions ro;
    ro.colocated = true;
    ro.engines = {{absl::StrCat("http://127.0.0.1:", port), tp, "sglang-ipc"}};
    ro.group_name = "wpub_bench_ipc";
    ro.publication_deadline = absl::Seconds(600);
    ro.sglang.driver.request_timeout = absl::Seconds(600);
    ro.engine_watch_interval = absl::ZeroDuration();
    auto channel = rollout::IpcChannel::Create({});
    BENCH_OK(channel.status());
    auto group = rollout::RolloutGroup::Create(ro, *std::move(channel));
    BENCH_OK(group.status());
    json row = RunWpub(tp == 1 ? "(g) colocated ipc tp1" : "(g2) colocated ipc tp2", true, run,
                       layout, model, **backend, **group, &version, &unused);
    row["over_backend_only"] =
        row["wall_seconds"].get<double>() / rows[0]["wall_seconds"].get<double>();
    std::printf("%-24s %.3fx the backend alone (goal <= 1.15x)\n", "",
                row["over_backend_only"].get<double>());
    rows.push_back(row);
    group->reset();
  }
  json out = {{"device", device}, {"rows", rows}};
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  return 0;
}

int Main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  const RunSettings run{args.iters, args.bucket_bytes, args.nccl_ctas};
  // The engines' GPU: GPU 1, or GPU 0 itself on a machine of one GPU (shared_gpu.h: NCCL's
  // socket transport on loopback, so the figures are a socket's, not NVLink's).
  const int engine_gpu = testing::EngineGpu();
  if (engine_gpu < 0) {
    std::fprintf(stderr, "gpu_path_bench needs a GPU\n");
    return 1;
  }
  const bool shared = testing::SharesPublisherGpu(engine_gpu);
  testing::AdoptOwnNcclHost(shared && !args.backend_only && !args.colocated);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const testing::ModelLayout layout = testing::LayoutModel(args.shape);
  std::printf(
      "device: %s; engines on GPU %d%s; model: %d layers, %d experts [%ld, %ld], hidden %ld: %.2f "
      "GB bf16 "
      "(%.2f GB routed experts); buckets of %lu MiB\n",
      prop.name, engine_gpu, shared ? " (shared: NCCL over loopback sockets)" : "",
      args.shape.layers, args.shape.experts, static_cast<long>(args.shape.inter),
      static_cast<long>(args.shape.hidden), static_cast<long>(args.shape.hidden),
      layout.total_bytes / 1e9, layout.expert_bytes / 1e9,
      static_cast<unsigned long>(args.bucket_bytes >> 20));
  cudaSetDevice(0);
  void* model = nullptr;
  if (cudaMalloc(&model, layout.total_bytes) != cudaSuccess) {
    std::fprintf(stderr, "cannot allocate %lu bytes on GPU 0\n",
                 static_cast<unsigned long>(layout.total_bytes));
    return 1;
  }
  if (FillBf16(model, layout.total_bytes / 2, 2026, nullptr) != cudaSuccess) return 1;
  cudaDeviceSynchronize();
  if (args.colocated) {
    const int rc = RunColocated(args, run, layout, static_cast<const uint8_t*>(model), prop.name);
    cudaFree(model);
    return rc;
  }
  if (args.backend_only) {
    // (e) only: the backend's own speed into a discarding sink, on GPU 0.
    DiscardSink discard;
    gpu::GpuBackendOptions bo;
    bo.compute_sms = args.compute_sms;
    bo.overlap_ctas_per_sm = args.ctas_per_sm;
    auto alone = gpu::GpuBackend::Create(bo);
    BENCH_OK(alone.status());
    uint64_t version = 0, unused = 0;
    json rows = json::array(
        {RunWpub("(e) backend only nvfp4", true, run, layout, static_cast<const uint8_t*>(model),
                 **alone, discard, &version, &unused),
         RunWpub("(e) backend only bf16", false, run, layout, static_cast<const uint8_t*>(model),
                 **alone, discard, &version, &unused)});
    // (f): the same publication to an in-process gRPC-pull receiver (host buckets: one
    // device-to-host copy per bucket; the receiver reads and checksums every bucket).
    rows.push_back(RunPull("(f) backend -> pull nvfp4", run, layout,
                           static_cast<const uint8_t*>(model), args, &version));
    json out = {{"device", prop.name}, {"rows", rows}};
    if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
    cudaFree(model);
    return 0;
  }

  // The two engines on the engine GPU: the SGLang emulator (also the receiver of the plain
  // broadcasts) and the C++ engine. Each gets its own NCCL transport (own store, own group).
  const int port = testing::FreePort();
  // The emulator's torch.distributed takes NCCL's channel bounds from its environment only: with
  // --nccl_ctas it gets that count there (the ranks of a group must agree on them, or NCCL fails
  // the broadcasts).
  std::vector<std::string> emulator_env = testing::OwnNcclHostEnv(shared);
  if (args.nccl_ctas > 0) {
    emulator_env.push_back(absl::StrCat("NCCL_MIN_CTAS=", args.nccl_ctas));
    emulator_env.push_back(absl::StrCat("NCCL_MAX_CTAS=", args.nccl_ctas));
  }
  auto emulator = testing::StartEmulator(
      port, engine_gpu, {}, absl::StrCat(args.log_dir, "/bench_emulator.log"), emulator_env);
  BENCH_OK(emulator.status());
  const int cpp_port = testing::FreePort();
  const std::string cpp_log = absl::StrCat(args.log_dir, "/bench_cpp_engine.log");
  auto cpp_engine = testing::SpawnCppReceiver(
      cpp_port, {engine_gpu}, {"device", "-1", std::to_string(args.nccl_ctas)}, cpp_log,
      args.cpp_receiver, testing::OwnNcclHostEnv(shared));
  BENCH_OK(cpp_engine.status());
  BENCH_OK(
      testing::WaitForHealth(**cpp_engine, cpp_port, absl::Seconds(30), "the C++ engine", cpp_log));
  auto make_transport = [&args](int engine_port, const char* group, int in_flight) {
    rollout::RolloutGroupOptions to =
        testing::LoopbackTransportOptions({{absl::StrCat("http://127.0.0.1:", engine_port), 1}},
                                          group, in_flight, absl::Seconds(600));
    to.nccl_ctas = args.nccl_ctas;
    auto t = rollout::RolloutGroup::Create(to);
    BENCH_OK(t.status());
    return *std::move(t);
  };
  // The C++ engine orders requests by wpub_sequence: three in flight, so it decodes the next
  // buckets' requests while bucket k is on the wire. The emulator, like SGLang, takes one at a
  // time.
  std::unique_ptr<rollout::RolloutGroup> to_cpp = make_transport(cpp_port, "wpub_bench_cpp", 3);
  std::unique_ptr<rollout::RolloutGroup> to_emu = make_transport(port, "wpub_bench", 1);
  auto backend_for = [&args](transport::Transport* /*reader*/, bool reject_first, int sms = -1,
                             int ctas = -1) {
    gpu::GpuBackendOptions bo;
    bo.reject_before_send = reject_first;
    bo.compute_sms = sms >= 0 ? sms : args.compute_sms;
    bo.overlap_ctas_per_sm = ctas >= 0 ? ctas : args.ctas_per_sm;
    auto b = gpu::GpuBackend::Create(bo);
    BENCH_OK(b.status());
    return *std::move(b);
  };

  const auto* base = static_cast<const uint8_t*>(model);
  uint64_t version = 0, bytes_a = 0, bytes_b = 0, unused = 0;
  // Each engine's pause window of the row's last publication (from its own answers), against
  // the publisher's transfer phase (Execute): the paused seconds and where they went.
  auto pause_windows = [](json* row, const rollout::RolloutGroup& group) {
    json windows = json::array();
    const double execute = (*row)["publication_phases"]["execute_seconds"].get<double>();
    for (const transport::ReceiverOutcome& o : group.Outcomes()) {
      const transport::PauseWindow& w = o.pause;
      windows.push_back({{"engine", o.name},
                         {"paused_seconds", w.seconds},
                         {"waiting_seconds", w.waiting},
                         {"transfer_seconds", w.transfer},
                         {"finalization_seconds", w.finalization},
                         {"paused_over_transfer", w.transfer > 0 ? w.seconds / w.transfer : 0},
                         {"within_goal", w.seconds <= 1.2 * w.transfer + w.finalization}});
      std::printf(
          "%-22s paused %7.4f s = waiting %6.4f + transfer %7.4f + finalization %6.4f"
          "  (%.3fx the transfer; publisher's execute %7.4f s)%s\n",
          "", w.seconds, w.waiting, w.transfer, w.finalization,
          w.transfer > 0 ? w.seconds / w.transfer : 0.0, execute,
          w.seconds <= 1.2 * w.transfer + w.finalization ? "" : "  OVER 1.2x + finalization");
    }
    (*row)["pause_windows"] = windows;
  };
  if (args.pause_windows) {
    // (a) to the C++ engine (three update requests in flight), (a1) with SGLang's one, (a-emu)
    // to the SGLang emulator (Python, torch.distributed): the engines' pause windows.
    json rows = json::array();
    auto be = backend_for(to_cpp.get(), true);
    for (int in_flight : {3, 1}) {
      auto t = in_flight == 3 ? std::move(to_cpp)
                              : make_transport(cpp_port, "wpub_bench_cpp1", in_flight);
      json row = RunWpub(in_flight == 3 ? "(a) nvfp4 -> C++ engine" : "(a1) nvfp4 1 in flight",
                         true, run, layout, base, *be, *t, &version, &unused);
      pause_windows(&row, *t);
      rows.push_back(row);
    }
    json emu = RunWpub("(a-emu) nvfp4 -> emu", true, run, layout, base,
                       *backend_for(to_emu.get(), true), *to_emu, &version, &unused);
    pause_windows(&emu, *to_emu);
    rows.push_back(emu);
    json out = {{"device", prop.name}, {"engines_share_gpu", shared}, {"rows", rows}};
    if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
    cudaFree(model);
    return 0;
  }
  if (args.restore) {
    // (a) without a copy; then with the copy in each place, and restores from it.
    json rows = json::array();
    auto be = backend_for(to_cpp.get(), true);
    json plain =
        RunWpub("(a) nvfp4, no copy", true, run, layout, base, *be, *to_cpp, &version, &bytes_a);
    const double transfer = plain["publication_phases"]["execute_seconds"].get<double>();
    rows.push_back(plain);
    auto raw_store = rendezvous::TcpStoreServer::Create({"127.0.0.1"});
    BENCH_OK(raw_store.status());
    const std::vector<rollout::EngineSpec> emu = {{absl::StrCat("http://127.0.0.1:", port), 1}};
    json d = RunPlainBroadcast("(d) nccl bcast nvfp4B", bytes_a, run, emu, "/bench_recv",
                               **raw_store, 1);
    const double bcast = d["wall_seconds"].get<double>();
    rows.push_back(d);
    for (transport::RetainWhere where :
         {transport::RetainWhere::kDevice, transport::RetainWhere::kPinned,
          transport::RetainWhere::kHost}) {
      const char* name = transport::RetainWhereName(where);
      std::shared_ptr<transport::RetainedMemory> memory;
      if (where != transport::RetainWhere::kHost) {
        auto m = gpu::GpuRetainedMemory::Create({0, where});
        BENCH_OK(m.status());
        memory = *std::move(m);
      }
      auto copy = transport::RetainedCopy::Create({.where = where}, memory);
      BENCH_OK(copy.status());
      auto group = transport::TransportGroup::Create({to_cpp.get(), copy->get()});
      BENCH_OK(group.status());
      json row = RunWpub(absl::StrCat("(a) + copy in ", name).c_str(), true, run, layout, base, *be,
                         **group, &version, &unused);
      const std::shared_ptr<const transport::RetainedVersion> retained = (*copy)->Retained();
      if (retained == nullptr) {
        std::fprintf(stderr, "nothing retained in %s memory: %s\n", name,
                     (*copy)->Info().reason.c_str());
        return 1;
      }
      std::vector<double> restore;
      for (int it = -1; it < args.iters; ++it) {
        transport::PublicationManifest manifest = retained->manifest;
        manifest.replay = true;
        const auto t0 = std::chrono::steady_clock::now();
        BENCH_OK((*group)->Begin(manifest).status());
        for (size_t i = 0; i < retained->bucket_count(); ++i) {
          auto bucket = retained->BucketAt(i);
          BENCH_OK(bucket.status());
          BENCH_OK((*group)->Send(*bucket));
        }
        BENCH_OK((*group)->WaitAcknowledged(absl::Now() + absl::Seconds(600)));
        BENCH_OK((*group)->Commit());
        if (it >= 0) {
          restore.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      const transport::RetainedCopyInfo info = (*copy)->Info();
      const double r = Median(restore);
      row["retained"] = {{"where", name},
                         {"bytes", info.bytes},
                         {"held_bytes", info.held_bytes},
                         {"restore_seconds", r},
                         {"restore_all", restore},
                         {"restore_over_transfer", r / transfer},
                         {"restore_over_plain_broadcast", r / bcast}};
      std::printf(
          "%-22s restore %7.4f s = %.3fx (a)'s transfer phase (%.4f s), %.3fx the plain "
          "broadcast (%.4f s); copy %.2f GB, %.2f GB held in %s memory\n",
          "", r, r / transfer, transfer, r / bcast, bcast, info.bytes / 1e9, info.held_bytes / 1e9,
          name);
      rows.push_back(row);
    }
    json out = {{"device", prop.name}, {"engines_share_gpu", shared}, {"rows", rows}};
    if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
    cudaFree(model);
    return 0;
  }
  // The C++ engine's own account of the row's last publication (sums over its buckets) and the
  // publisher's broadcasts as its comm stream timed them.
  auto engine_side = [&](json* row, const rollout::RolloutGroup& group) {
    const nccl::NcclTransport::BroadcastTiming bt =
        dynamic_cast<const nccl::NcclTransport&>(group.channel()).last_broadcast_timing();
    double busy = 0, idle = 0, busy_max = 0;
    for (double x : bt.busy) busy += x, busy_max = std::max(busy_max, x);
    for (double x : bt.idle) idle += x;
    (*row)["publisher_broadcasts"] = {{"busy_seconds", busy},
                                      {"idle_seconds", idle},
                                      {"busy_max_seconds", busy_max},
                                      {"busy_each", bt.busy},
                                      {"idle_each", bt.idle}};
    std::printf("%-22s broadcasts: busy %7.4f s (max %.4f)  idle between %7.4f s\n", "", busy,
                busy_max, idle);
    absl::StatusOr<std::string> body = testing::HttpGet(cpp_port, "/stats");
    if (!body.ok()) return;
    const json v = json::parse(*body, nullptr, false)[std::to_string(version)];
    if (!v.is_object()) return;
    (*row)["engine_side"] = {{"decode_seconds", v["decode_seconds"]},
                             {"wait_seconds", v["wait_seconds"]},
                             {"receive_seconds", v["receive_seconds"]},
                             {"receive_device_seconds", v.value("receive_device_seconds", 0.0)}};
    // The engine's last bucket verified, against the publisher's Execute return (both
    // steady_clock on this host): how much of the acknowledgement phase is the engine's.
    const int64_t verified = v.value("last_verified_ns", int64_t{0});
    const int64_t executed = row->value("last_executed_ns", int64_t{0});
    if (verified > 0 && executed > 0) {
      (*row)["engine_side"]["last_verified_after_execute_seconds"] = (verified - executed) * 1e-9;
      std::printf("%-22s engine: last bucket verified %+.3f ms after the publisher's Execute\n", "",
                  (verified - executed) * 1e-6);
    }
    std::printf(
        "%-22s engine: decode %7.4f  wait %7.4f  receive %7.4f  receive kernels %7.4f s (sums)\n",
        "", v["decode_seconds"].get<double>(), v["wait_seconds"].get<double>(),
        v["receive_seconds"].get<double>(), v.value("receive_device_seconds", 0.0));
  };
  // One row to the C++ engine, with both sides' account of its last publication.
  auto to_engine = [&](const std::string& label, bool nvfp4, gpu::GpuBackend& be,
                       rollout::RolloutGroup& t, uint64_t* bytes_out) {
    json row = RunWpub(label.c_str(), nvfp4, run, layout, base, be, t, &version, bytes_out);
    engine_side(&row, t);
    return row;
  };
  json rows = json::array();
  {
    auto be = backend_for(to_cpp.get(), true);
    rows.push_back(to_engine("(a) wpub nvfp4", true, *be, *to_cpp, &bytes_a));
    rows.push_back(to_engine("(b) wpub bf16", false, *be, *to_cpp, &bytes_b));
  }
  // (a'): amax pipelined per bucket; a non-finite weight is then rejected after the transfer
  // (before commit) instead of before the first broadcast.
  json a2 =
      to_engine("(a') nvfp4 pipelined", true, *backend_for(to_cpp.get(), false), *to_cpp, &unused);
  // The compute stream on part of the SMs (a green context), the others left to the broadcast.
  json sweep = json::array();
  for (const int sms : args.sm_sweep) {
    for (const bool reject_first : {true, false}) {
      sweep.push_back(to_engine(absl::StrCat(reject_first ? "(a)" : "(a')", " compute on ", sms),
                                true, *backend_for(to_cpp.get(), reject_first, sms), *to_cpp,
                                &unused));
      sweep.back()["compute_sms"] = sms;
    }
  }
  // The quantize/amax kernels beside the broadcasts at other occupancy caps (0: none).
  for (const int ctas : args.ctas_sweep) {
    for (const bool reject_first : {true, false}) {
      sweep.push_back(to_engine(absl::StrCat(reject_first ? "(a)" : "(a')", " ", ctas, " CTAs/SM"),
                                true, *backend_for(to_cpp.get(), reject_first, -1, ctas), *to_cpp,
                                &unused));
      sweep.back()["overlap_ctas_per_sm"] = ctas;
    }
  }
  // (a2), (a1): as (a) with two requests in flight (the engine decodes one ahead) and with one
  // (SGLang's protocol), each through a group of its own that replaces the previous one.
  auto fewer_in_flight = [&](int in_flight, const char* label, const char* group) {
    to_cpp.reset();
    auto t = make_transport(cpp_port, group, in_flight);
    return to_engine(label, true, *backend_for(t.get(), true), *t, &unused);
  };
  json a_two = fewer_in_flight(2, "(a2) nvfp4 2 in flight", "wpub_bench_cpp2");
  json a_serial = fewer_in_flight(1, "(a1) nvfp4 1 in flight", "wpub_bench_cpp1");
  json emu_rows = json::array();
  {
    auto be = backend_for(to_emu.get(), true);
    emu_rows.push_back(
        RunWpub("(a-emu) nvfp4 -> emu", true, run, layout, base, *be, *to_emu, &version, &unused));
    emu_rows.push_back(
        RunWpub("(b-emu) bf16 -> emu", false, run, layout, base, *be, *to_emu, &version, &unused));
  }
  // (e): the same backend work into a discarding sink.
  DiscardSink discard;
  json e_nvfp4, e_bf16;
  {
    auto alone = backend_for(&discard, true);
    e_nvfp4 = RunWpub("(e) backend only nvfp4", true, run, layout, base, *alone, discard, &version,
                      &unused);
    e_bf16 = RunWpub("(e) backend only bf16", false, run, layout, base, *alone, discard, &version,
                     &unused);
  }
  // The plain broadcasts need their own store entry and group (to the emulator's /bench_recv).
  auto raw_store = rendezvous::TcpStoreServer::Create({"127.0.0.1"});
  BENCH_OK(raw_store.status());
  const std::vector<rollout::EngineSpec> emu = {{absl::StrCat("http://127.0.0.1:", port), 1}};
  rows.push_back(
      RunPlainBroadcast("(d) nccl bcast nvfp4B", bytes_a, run, emu, "/bench_recv", **raw_store, 1));
  rows.push_back(
      RunPlainBroadcast("(d') nccl bcast bf16B", bytes_b, run, emu, "/bench_recv", **raw_store, 2));

  // Traced publications (not timed): the broadcast kernels on GPU 0 and what overlapped them.
  json traces = json::array();
  if (args.kernel_trace) {
    RunSettings once = run;
    once.iters = 1;
    auto traced = [&](const std::string& label, const std::function<void()>& publish) {
      KernelTrace trace;
      std::string err;
      if (!trace.Start(&err)) {
        std::printf("kernel trace unavailable: %s\n", err.c_str());
        return;
      }
      publish();
      const BroadcastNeighbours n = SummarizeBroadcasts(trace.Stop(), 0);
      json overlap = json::object();
      std::string line;
      for (const auto& [cls, sec] : n.overlap_seconds) {
        overlap[cls] = sec / std::max(n.broadcasts, 1);
        line += absl::StrFormat(" %s %.2f", cls, 1e3 * sec / std::max(n.broadcasts, 1));
      }
      traces.push_back({{"case", label},
                        {"broadcast_kernels", n.broadcasts},
                        {"mean_seconds", n.mean_seconds},
                        {"min_seconds", n.min_seconds},
                        {"max_seconds", n.max_seconds},
                        {"grid", n.grid},
                        {"block", n.block},
                        {"registers", n.registers},
                        {"cluster", n.cluster},
                        {"overlap_seconds_per_broadcast", overlap}});
      std::printf(
          "trace %-22s %3d broadcast kernels: mean %.3f ms (min %.3f, max %.3f), %d CTAs x %d "
          "threads x %u regs, clusters of %d; overlapped per broadcast (ms):%s\n",
          label.c_str(), n.broadcasts, 1e3 * n.mean_seconds, 1e3 * n.min_seconds,
          1e3 * n.max_seconds, n.grid, n.block, n.registers, n.cluster, line.c_str());
    };
    auto to_cpp_traced = make_transport(cpp_port, "wpub_bench_trace", 3);
    for (const bool reject_first : {true, false}) {
      std::vector<int> sm_counts = {0};
      sm_counts.insert(sm_counts.end(), args.sm_sweep.begin(), args.sm_sweep.end());
      for (const int sms : sm_counts) {
        const std::string label = absl::StrCat(reject_first ? "(a)" : "(a')",
                                               sms ? absl::StrCat(" on ", sms, " SMs") : "");
        auto be = backend_for(to_cpp_traced.get(), reject_first, sms);
        traced(label, [&] {
          RunWpub(label.c_str(), true, once, layout, base, *be, *to_cpp_traced, &version, &unused);
        });
      }
    }
    traced("(b)", [&] {
      auto be = backend_for(to_cpp_traced.get(), true);
      RunWpub("(b)", false, once, layout, base, *be, *to_cpp_traced, &version, &unused);
    });
    traced("(d)",
           [&] { RunPlainBroadcast("(d)", bytes_a, once, emu, "/bench_recv", **raw_store, 3); });
  }

  const double a = rows[0]["wall_seconds"], b = rows[1]["wall_seconds"];
  const double d = rows[2]["wall_seconds"], d2 = rows[3]["wall_seconds"];
  const double roofline = (layout.total_bytes + bytes_a) / (args.copy_gbps * 1e9);
  const double ap = a2["wall_seconds"];
  const double a_emu = emu_rows[0]["wall_seconds"];
  json summary = {{"a_over_d", a / d},
                  {"a_pipelined_over_d", ap / d},
                  {"a_pipelined_over_max_roofline_d", ap / std::max(roofline, d)},
                  {"b_over_d_bf16", b / d2},
                  {"a_emu_over_max_roofline_d", a_emu / std::max(roofline, d)},
                  {"quantize_roofline_seconds", roofline},
                  {"a_over_max_roofline_d", a / std::max(roofline, d)},
                  {"goal_a_within_1_3x", a <= 1.3 * std::max(roofline, d)},
                  {"goal_a_pipelined_within_1_3x", ap <= 1.3 * std::max(roofline, d)}};
  std::printf(
      "ratios: (a)/(d) %.2f; (a)/max(quantize roofline %.4f s, (d)) %.2f (goal <= 1.3); "
      "(a')/max %.2f; (b)/(d') %.2f; (a-emu)/max %.2f\n",
      a / d, roofline, a / std::max(roofline, d), ap / std::max(roofline, d), b / d2,
      a_emu / std::max(roofline, d));
  json out = {{"device", prop.name},
              {"model",
               {{"layers", args.shape.layers},
                {"experts", args.shape.experts},
                {"hidden", args.shape.hidden},
                {"inter", args.shape.inter},
                {"bytes_bf16", layout.total_bytes}}},
              {"bucket_bytes", args.bucket_bytes},
              {"iters", args.iters},
              {"rows", rows},
              {"pipelined", a2},
              {"to_emulator", emu_rows},
              {"one_request_in_flight", a_serial},
              {"two_requests_in_flight", a_two},
              {"compute_sms", args.compute_sms},
              {"overlap_ctas_per_sm", args.ctas_per_sm},
              {"nccl_ctas", args.nccl_ctas},
              {"sm_sweep", sweep},
              {"kernel_trace", traces},
              {"backend_only", {e_nvfp4, e_bf16}},
              {"summary", summary}};
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  to_cpp.reset();
  to_emu.reset();
  cudaFree(model);
  return 0;
}

}  // namespace
}  // namespace wpub::bench

int main(int argc, char** argv) { return wpub::bench::Main(argc, argv); }
