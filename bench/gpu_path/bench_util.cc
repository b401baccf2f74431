// Shared pieces of the GPU-path benchmarks: timed publications, plain broadcasts.
#include "bench/gpu_path/bench_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/nccl/nccl_comm.h"

namespace wpub::bench {

using json = nlohmann::json;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

json RunWpub(const char* label, bool nvfp4, const RunSettings& args,
             const testing::ModelLayout& layout, const uint8_t* base, gpu::GpuBackend& backend,
             transport::Transport& transport, uint64_t* version, uint64_t* bytes_out) {
  std::vector<engine::InputTensor> inputs;
  std::vector<double> wall, amax, compute, total, h_setup, h_checks, h_buckets, h_emit;
  std::vector<double> p_begin, p_execute, p_ack, p_commit;
  uint64_t syncs = 0;
  int64_t executed_ns = 0;  // the last publication's (testing::PublishResult::executed_ns)
  size_t buckets = 0;
  for (int it = -1; it < args.iters; ++it) {
    auto built = testing::BuildPlan(layout, base, nvfp4, args.bucket_bytes, ++*version, &inputs,
                                    engine::PartMemory::kDevice);  // as CUDA IPC parts are
    BENCH_OK(built.status());
    testing::PublishResult r = testing::Publish(backend, transport, *built, absl::Seconds(600));
    BENCH_OK(r.status);
    *bytes_out = built->bytes_out;
    buckets = built->manifest.buckets.size();
    if (it < 0) continue;  // warm-up: group formation, buffer growth, NCCL lazy init
    const gpu::GpuTiming& t = backend.last_timing();
    wall.push_back(r.wall_seconds);
    p_begin.push_back(r.begin_seconds);
    p_execute.push_back(r.execute_seconds);
    p_ack.push_back(r.acknowledge_seconds);
    p_commit.push_back(r.commit_seconds);
    amax.push_back(t.amax_seconds);
    compute.push_back(t.compute_seconds);
    total.push_back(t.total_seconds);
    h_setup.push_back(t.host_setup_seconds);
    h_checks.push_back(t.host_checks_seconds);
    h_buckets.push_back(t.host_buckets_seconds);
    h_emit.push_back(t.host_emit_seconds);
    syncs = r.host_syncs;
    executed_ns = r.executed_ns;
  }
  json row = {{"case", label},
              {"wall_seconds", Median(wall)},
              {"wall_all", wall},
              {"device_amax_seconds", Median(amax)},
              {"device_quantize_pack_seconds", Median(compute)},
              {"device_total_seconds", Median(total)},
              {"bytes_in", layout.total_bytes},
              {"bytes_out", *bytes_out},
              {"buckets", buckets},
              {"gbps", *bytes_out / Median(wall) / 1e9},
              {"host_syncs", syncs},
              {"host_setup_seconds", Median(h_setup)},
              {"host_checks_seconds", Median(h_checks)},
              {"host_buckets_seconds", Median(h_buckets)},
              {"host_emit_seconds", Median(h_emit)},
              {"publication_phases",
               {{"begin_seconds", Median(p_begin)},
                {"execute_seconds", Median(p_execute)},
                {"acknowledge_seconds", Median(p_ack)},
                {"commit_seconds", Median(p_commit)}}},
              {"last_executed_ns", executed_ns}};
  std::printf(
      "%-22s wall %8.4f s  amax %7.4f  quant+pack %7.4f  device total %7.4f  %9.1f GB/s"
      "  %lu B out  %zu buckets  %lu host syncs\n",
      label, Median(wall), Median(amax), Median(compute), Median(total),
      *bytes_out / Median(wall) / 1e9, static_cast<unsigned long>(*bytes_out), buckets,
      static_cast<unsigned long>(syncs));
  std::printf("%-22s host: setup %7.4f  checks %7.4f  buckets %7.4f  emit %7.4f s\n", "",
              Median(h_setup), Median(h_checks), Median(h_buckets), Median(h_emit));
  std::printf("%-22s phases: begin %7.4f  execute %7.4f  acknowledged %7.4f  commit %7.4f s\n", "",
              Median(p_begin), Median(p_execute), Median(p_ack), Median(p_commit));
  return row;
}

json RunPlainBroadcast(const char* label, uint64_t bytes, const RunSettings& args,
                       const std::vector<rollout::EngineSpec>& engines, const std::string& route,
                       rendezvous::TcpStoreServer& store, int generation) {
  const uint64_t chunk = std::min(args.bucket_bytes, bytes);
  const int count = static_cast<int>((bytes + chunk - 1) / chunk);
  rollout::SglangDriverOptions d;
  d.engines = engines;
  d.master_port = store.port();
  d.group_name = absl::StrCat("wpub_bench_raw_", generation);
  auto driver = rollout::SglangDriver::Create(d);
  BENCH_OK(driver.status());
  auto id = nccl::NewUniqueId();
  BENCH_OK(id.status());
  store.Set(*rendezvous::UniqueIdKey(rendezvous::kDefaultUniqueIdKeyTemplate, d.group_name, 0),
            std::vector<uint8_t>(id->begin(), id->end()));
  nccl::NcclCommOptions co;
  co.nranks = (*driver)->layout().world_size;
  co.id = *id;
  co.ctas = args.nccl_ctas;
  auto comm = nccl::NcclComm::Create(co);
  BENCH_OK(comm.status());
  (*driver)->StartJoin();
  BENCH_OK((*driver)->WaitIdle(absl::Now() + absl::Seconds(120)));
  void* buf = nullptr;
  cudaMalloc(&buf, chunk);
  cudaMemset(buf, 1, chunk);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> wall, device;
  for (int it = -1; it < args.iters; ++it) {
    const std::string body =
        json({{"group_name", d.group_name}, {"nbytes", chunk}, {"count", count}}).dump();
    std::vector<absl::Status> recv_status(engines.size());
    std::vector<std::thread> receivers;
    for (size_t e = 0; e < engines.size(); ++e) {
      receivers.emplace_back([&, e] {
        const std::string& url = engines[e].url;
        const int port = std::atoi(url.substr(url.rfind(':') + 1).c_str());
        recv_status[e] = testing::HttpPost(port, route, body, absl::Seconds(600)).status();
      });
    }
    BENCH_OK((*comm)->WaitReady(absl::Now() + absl::Seconds(120), nullptr));
    const auto t0 = std::chrono::steady_clock::now();
    cudaEventRecord(e0, s);
    for (int i = 0; i < count; ++i) BENCH_OK((*comm)->Broadcast(buf, chunk, 0, s));
    cudaEventRecord(e1, s);
    // Polled with a deadline: a receiver that failed never posts its receives.
    for (const auto until = t0 + std::chrono::seconds(600);;) {
      const cudaError_t q = cudaEventQuery(e1);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady || std::chrono::steady_clock::now() > until) {
        std::fprintf(stderr, "%s: the broadcasts did not complete (%s)\n", label,
                     cudaGetErrorString(q));
        std::exit(1);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (std::thread& t : receivers) t.join();
    for (const absl::Status& st : recv_status) BENCH_OK(st);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (it < 0) continue;
    wall.push_back(w);
    device.push_back(ms / 1e3);
  }
  const uint64_t moved = chunk * static_cast<uint64_t>(count);
  json row = {{"case", label},
              {"wall_seconds", Median(wall)},
              {"device_seconds", Median(device)},
              {"bytes", moved},
              {"messages", count},
              {"message_bytes", chunk},
              {"gbps", moved / Median(wall) / 1e9}};
  std::printf("%-22s wall %8.4f s  device %7.4f s  %9.1f GB/s  %d x %lu B\n", label, Median(wall),
              Median(device), moved / Median(wall) / 1e9, count, static_cast<unsigned long>(chunk));
  (*driver)->Leave();
  (void)(*driver)->WaitIdle(absl::Now() + absl::Seconds(10));
  comm->reset();
  cudaFree(buf);
  cudaStreamDestroy(s);
  return row;
}

}  // namespace wpub::bench
