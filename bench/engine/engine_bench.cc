// Whole-path CPU throughput of the publication engine: a synthetic GLM-style MoE (>= 2 GB of
// BF16 by default) streamed into the engine as inline chunks (or read in place from POSIX shared
// memory), policy, NVFP4 quantization with the CPU reference, packing into flattened buckets and
// transfer to in-process pull receivers that verify every bucket's checksum. Reports MB/s per
// phase (MB = 1e6 bytes) and, as the baseline measured in the same run, a plain memcpy of the
// same input bytes.
//
// Usage: engine_bench [--layers=N] [--experts=N] [--hidden=N] [--moe_intermediate=N]
//          [--iterations=N] [--threads=N] [--receivers=N] [--bucket_mib=N] [--chunk_kib=N]
//          [--source=inline|shm] [--recipe=nvfp4]
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/engine/engine.h"
#include "core/synthetic/synthetic.h"
#include "core/transport/testing/inproc_receiver.h"

namespace {

using namespace wpub;

struct Args {
  int layers = 5;
  int experts = 64;
  int64_t hidden = 2048;
  int64_t moe_intermediate = 768;
  int iterations = 2;
  int threads = 2;
  int receivers = 2;
  uint64_t bucket_mib = 256;
  uint64_t chunk_kib = 4096;
  std::string source = "inline";
  std::string recipe = "nvfp4";
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
    const std::string key = arg.substr(2, eq - 2), v = arg.substr(eq + 1);
    int64_t n = 0;
    const bool num = absl::SimpleAtoi(v, &n);
    if (key == "source")
      a->source = v;
    else if (key == "recipe")
      a->recipe = v;
    else if (!num || n < 0 || (n == 0 && key != "receivers"))
      return false;
    else if (key == "layers")
      a->layers = static_cast<int>(n);
    else if (key == "experts")
      a->experts = static_cast<int>(n);
    else if (key == "hidden")
      a->hidden = n;
    else if (key == "moe_intermediate")
      a->moe_intermediate = n;
    else if (key == "iterations")
      a->iterations = static_cast<int>(n);
    else if (key == "threads")
      a->threads = static_cast<int>(n);
    else if (key == "receivers")
      a->receivers = static_cast<int>(n);
    else if (key == "bucket_mib")
      a->bucket_mib = static_cast<uint64_t>(n);
    else if (key == "chunk_kib")
      a->chunk_kib = static_cast<uint64_t>(n);
    else
      return false;
  }
  return a->source == "inline" || a->source == "shm";
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 0 when the phase did not run (e.g. quantize with the bf16 recipe).
double MBps(double bytes, double seconds) { return seconds > 1e-6 ? bytes / seconds / 1e6 : 0; }

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr, "usage: see the header of bench/engine/engine_bench.cc\n");
    return 2;
  }
  synthetic::ModelShape shape = synthetic::ModelShape::GlmLike();
  shape.num_layers = args.layers;
  shape.first_k_dense = 1;
  shape.num_experts = args.experts;
  shape.hidden_size = args.hidden;
  shape.moe_intermediate_size = args.moe_intermediate;
  shape.intermediate_size = 4 * args.hidden;
  shape.vocab_size = 32768;
  shape.num_attention_heads = 16;
  shape.num_key_value_heads = 4;
  shape.head_dim = 128;
  auto model = synthetic::SyntheticModel::Create(shape);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const uint64_t model_bytes = static_cast<uint64_t>(model->num_bytes());

  // A pool of valid BF16 values that every tensor's bytes are taken from (cyclically), so the
  // benchmark measures the engine rather than the value generator.
  const uint64_t pool_bytes = uint64_t{256} << 20;
  uint8_t* pool = nullptr;
  std::string shm_name;
  if (args.source == "shm") {
    shm_name = absl::StrCat("/wpub_engine_bench_", getpid());
    const int fd = shm_open(shm_name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(2 * pool_bytes)) != 0) return 1;
    pool = static_cast<uint8_t*>(
        mmap(nullptr, 2 * pool_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  } else {
    pool = new uint8_t[2 * pool_bytes];
  }
  {
    // Valid BF16 values over the whole doubled pool, so any [offset, offset + n) with
    // offset < pool_bytes and n <= pool_bytes is readable.
    const TensorDesc d{"pool", DType::kBFloat16, {static_cast<int64_t>(pool_bytes)}};
    if (!synthetic::FillTensor(d, 1, absl::MakeSpan(pool, 2 * pool_bytes)).ok()) return 1;
  }

  engine::EngineOptions options;
  options.bucket_bytes = args.bucket_mib << 20;
  options.cpu_threads = args.threads;
  options.ack_deadline = absl::Minutes(10);
  auto eng = engine::Engine::Create(options, nullptr);
  if (!eng.ok()) return 1;
  std::vector<std::unique_ptr<transport::testing::InprocReceiver>> receivers;
  for (int r = 0; r < args.receivers; ++r) {
    auto rec = transport::testing::InprocReceiver::Start(
        (*eng)->pull_transport(), {.name = absl::StrCat("recv", r), .keep_tensors = false});
    if (!rec.ok()) return 1;
    receivers.push_back(std::move(*rec));
  }

  // Baseline: one memcpy pass over the model's byte count.
  double memcpy_seconds = 0;
  {
    std::vector<uint8_t> dst(pool_bytes);
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t done = 0; done < model_bytes; done += pool_bytes) {
      std::memcpy(dst.data(), pool, std::min(pool_bytes, model_bytes - done));
    }
    memcpy_seconds = Seconds(t0);
  }

  std::printf(
      "model: GLM-style, %d layers (1 dense), %d experts of [%ld, %ld], %.3f GB BF16, "
      "%ld tensors; source %s, recipe %s, bucket %lu MiB, %d quantizer threads, "
      "%d in-process receivers\n",
      args.layers, args.experts, static_cast<long>(args.moe_intermediate),
      static_cast<long>(args.hidden), model_bytes / 1e9, static_cast<long>(model->num_tensors()),
      args.source.c_str(), args.recipe.c_str(), static_cast<unsigned long>(args.bucket_mib),
      args.threads, args.receivers);
  std::printf("baseline memcpy of %.3f GB: %.3f s = %.0f MB/s\n", model_bytes / 1e9, memcpy_seconds,
              MBps(model_bytes, memcpy_seconds));
  std::printf("%-4s %-9s %8s %8s %8s %8s %8s %8s %8s %9s %9s %9s %9s %9s\n", "ver", "status",
              "wall_s", "ingest", "policy", "quant", "pack", "xfer", "commit", "in_MB/s",
              "quant_MB/s", "pack_MB/s", "xfer_MB/s", "out_GB");

  const uint64_t chunk = args.chunk_kib << 10;
  for (int it = 0; it < args.iterations; ++it) {
    const uint64_t version = static_cast<uint64_t>(it + 1);
    engine::PublicationHeader header;
    header.version = version;
    header.model_id = "glm-bench";
    header.recipe = args.recipe;
    auto session = (*eng)->Open(header);
    if (!session.ok()) {
      std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
      return 1;
    }
    uint64_t cursor = 0, quantized_in = 0;
    for (const auto& b : model->batches()) {
      engine::BatchInput in{b.megatron_name, {}};
      std::vector<uint64_t> offsets;
      for (const TensorDesc& d : b.tensors) {
        const uint64_t n = static_cast<uint64_t>(d.nbytes());
        const uint64_t off = (cursor % (pool_bytes / 2)) & ~uint64_t{15};
        cursor += n + 4096;
        offsets.push_back(off);
        engine::TensorPart part{engine::InlineSource{}, d.shape};
        if (args.source == "shm") part.source = engine::ShmSource{shm_name, off, n};
        in.tensors.push_back(engine::TensorInput{d, {part}, 0});
        if (b.megatron_name.find(".mlp.experts.") != std::string::npos) quantized_in += n;
      }
      if (absl::Status s = (*session)->AddBatch(in); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
      if (args.source == "inline") {
        const uint64_t bi = (*session)->num_batches() - 1;
        for (size_t t = 0; t < b.tensors.size(); ++t) {
          const uint64_t n = static_cast<uint64_t>(b.tensors[t].nbytes());
          for (uint64_t o = 0; o < n; o += chunk) {
            const uint64_t len = std::min(chunk, n - o);
            // Sources wrap inside the doubled pool.
            const uint8_t* src = pool + (offsets[t] + o) % pool_bytes;
            if (absl::Status s = (*session)->AppendInline(bi, static_cast<uint32_t>(t), 0, o,
                                                          absl::MakeConstSpan(src, len));
                !s.ok()) {
              std::fprintf(stderr, "%s\n", s.ToString().c_str());
              return 1;
            }
          }
        }
      }
    }
    auto report = (*session)->Commit();
    if (!report.ok()) {
      std::fprintf(stderr, "%s\n", report.status().ToString().c_str());
      return 1;
    }
    const engine::PhaseSeconds& p = report->phases;
    std::printf(
        "%-4lu %-9s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %9.0f %9.0f %9.0f %9.0f %9.3f\n",
        static_cast<unsigned long>(version), engine::PublicationStatusName(report->status),
        report->wall_seconds, p.ingest, p.policy, p.quantize, p.pack, p.transfer, p.commit,
        MBps(report->bytes_in, p.ingest), MBps(quantized_in, p.quantize),
        MBps(report->bytes_out, p.pack), MBps(report->bytes_out, p.transfer),
        report->bytes_out / 1e9);
    std::printf(
        "  whole path: %.0f MB/s of BF16 input (%.2fx the memcpy baseline's time); "
        "%lu buckets, %lu tensors quantized, %lu passed, host syncs %lu, "
        "non-finite %lu\n",
        MBps(report->bytes_in, report->wall_seconds), report->wall_seconds / memcpy_seconds,
        static_cast<unsigned long>(report->buckets),
        static_cast<unsigned long>(report->tensors_quantized),
        static_cast<unsigned long>(report->tensors_passthrough),
        static_cast<unsigned long>(report->host_syncs),
        static_cast<unsigned long>(report->non_finite));
    for (const auto& r : receivers) {
      if (r->committed_version() != version && !r->WaitForOutcome(version, absl::Seconds(60))) {
        std::fprintf(stderr, "receiver did not see version %lu\n",
                     static_cast<unsigned long>(version));
        return 1;
      }
      if (r->checksum_mismatches() != 0) {
        std::fprintf(stderr, "receiver saw checksum mismatches\n");
        return 1;
      }
    }
    if (report->status != engine::PublicationStatus::kCommitted) return 1;
  }
  receivers.clear();
  if (args.source == "shm") {
    munmap(pool, 2 * pool_bytes);
    shm_unlink(shm_name.c_str());
  } else {
    delete[] pool;
  }
  return 0;
}
