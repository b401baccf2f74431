// NVFP4 kernel benchmark (a program, not a test): device-to-device copy bandwidth measured in the
// same run as the baseline, then each kernel's effective bandwidth (every byte it must read and
// write) as a fraction of it, and as a fraction of a copy moving the same byte count (small
// inputs are judged against what the memory system gives at their size). Cases: amax; quantize
// standard, 4over6 (MSE, exact) and TE's default 4over6 (MAE, E = 256, exact) on bf16 [4096,6144],
// [7168,2048], [2048,7168], 128 experts [768,2048] in one launch and one 1 GiB tensor; fused QDQ of
// 8 x [4096,6144] bf16 against our own amax + quantize + dequantize.
//
// Timing: CUDA events around every iteration, after warm-up; median over iterations. Inputs
// rotate over enough buffer sets (>= 512 MiB) that no iteration reads data another left in L2.
// --all_modes adds the six other 4over6 modes' quantize on 128 experts and on 1 GiB.
// Usage: nvfp4_kernels_bench [--iters N] [--warmup N] [--json FILE] [--quick] [--qdq_only]
// [--all_modes] [--qdq_count N] [--qdq_rows N] [--qdq_cols N]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernels/bench_check.h"
#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::kernels::cuda::bench {
namespace {

constexpr int64_t kRotateBytes = int64_t{512} << 20;

// Inside Bench members: the launcher's message lands in m_.
#define BENCH_KERNEL(expr)                                                                         \
  do {                                                                                             \
    const KernelStatus s_ = (expr);                                                                \
    if (s_ != KernelStatus::kOk) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s %s\n", __FILE__, __LINE__, #expr, KernelStatusString(s_), \
                   m_.c_str());                                                                    \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

struct Options {
  int iters = 50;
  int warmup = 5;
  std::string json;
  bool quick = false;
  bool qdq_only = false;   // the fused-QDQ case alone
  bool all_modes = false;  // quantize in the six other 4over6 modes too
  // The fused-QDQ case's list: qdq_count weights of [qdq_rows, qdq_cols] bf16.
  int qdq_count = 8;
  int64_t qdq_rows = 4096;
  int64_t qdq_cols = 6144;
};

struct Row {
  std::string name;
  double us = 0;        // median microseconds per call
  double bytes = 0;     // bytes the operation must move
  double gbps = 0;      // bytes / time, GB = 1e9
  double fraction = 0;  // gbps / copy gbps
  std::string note;
  double same_gbps = 0;      // a device-to-device copy moving `bytes` (bytes / 2 read + written)
  double same_fraction = 0;  // gbps / same_gbps
};

// Median of per-iteration event timings of fn(iteration).
double TimeMedianUs(const Options& o, cudaStream_t s, const std::function<void(int)>& fn) {
  for (int i = 0; i < o.warmup; ++i) fn(i);
  std::vector<Event> start(o.iters), stop(o.iters);
  for (int i = 0; i < o.iters; ++i) {
    BENCH_CHECK(Event::Create(true, &start[i]));
    BENCH_CHECK(Event::Create(true, &stop[i]));
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  for (int i = 0; i < o.iters; ++i) {
    BENCH_CHECK(start[i].Record(s));
    fn(i);
    BENCH_CHECK(stop[i].Record(s));
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<double> us(o.iters);
  for (int i = 0; i < o.iters; ++i) {
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start[i].get(), stop[i].get()));
    us[i] = 1000.0 * ms;
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

DeviceBuffer Alloc(int64_t bytes, int fill) {
  DeviceBuffer b;
  BENCH_CHECK(DeviceBuffer::Create(bytes, &b));
  BENCH_CHECK(cudaMemset(b.data(), fill, bytes));
  return b;
}

// Fills bf16 buffers with finite pseudo-random values (never zeros: they could run faster).
void FillRandomBf16(void* dev, int64_t elems, uint64_t seed) {
  std::vector<uint16_t> host(static_cast<size_t>(std::min<int64_t>(elems, 1 << 24)));
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint16_t& h : host) {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    h = static_cast<uint16_t>(((z >> 20) & 0x8000u) | ((112u + (z >> 40) % 24) << 7) | (z & 0x7Fu));
  }
  for (int64_t off = 0; off < elems; off += static_cast<int64_t>(host.size())) {
    const int64_t n = std::min<int64_t>(host.size(), elems - off);
    BENCH_CHECK(
        cudaMemcpy(static_cast<uint16_t*>(dev) + off, host.data(), n * 2, cudaMemcpyHostToDevice));
  }
}

// A set of weights of one shape list, with their quantize outputs, rotated across sets.
struct WeightSet {
  std::vector<DeviceBuffer> in, packed, scales, deq;
  DeviceBuffer amax, dec;
  std::vector<QuantizeJob> qjobs;
  std::vector<QdqJob> qdq;
  std::vector<DequantizeJob> djobs;
  std::vector<WeightDesc> descs;
  DeviceBuffer ws;
};

WeightSet MakeSet(int count, int64_t rows, int64_t cols, uint64_t seed, bool with_deq) {
  WeightSet s;
  s.amax = Alloc(count * 4, 0);
  s.dec = Alloc(count * 4, 0);
  for (int i = 0; i < count; ++i) {
    s.in.push_back(Alloc(rows * cols * 2, 0));
    FillRandomBf16(s.in.back().data(), rows * cols, seed * 1000 + i);
    s.packed.push_back(Alloc(rows * cols / 2, 0));
    s.scales.push_back(Alloc(rows * cols / 16, 0));
    if (with_deq) s.deq.push_back(Alloc(rows * cols * 2, 0));
    const WeightDesc w = WeightDesc::Dense(s.in.back().data(), rows, cols, ElemType::kBF16);
    s.descs.push_back(w);
    QuantizeJob q;
    q.weight = w;
    q.out.packed = s.packed.back().as<uint8_t>();
    q.out.scales = s.scales.back().as<uint8_t>();
    q.out.decode_scale = s.dec.as<float>() + i;
    q.amax = s.amax.as<float>() + i;
    s.qjobs.push_back(q);
    if (with_deq) {
      QdqJob f;
      f.weight = w;
      f.out = s.deq.back().data();
      f.amax = s.amax.as<float>() + i;
      s.qdq.push_back(f);
      DequantizeJob d;
      d.in.packed = q.out.packed;
      d.in.scales = q.out.scales;
      d.in.amax = q.amax;
      d.in.rows = rows;
      d.in.cols = cols;
      d.out = s.deq.back().data();
      s.djobs.push_back(d);
    }
  }
  if (with_deq) {
    BENCH_CHECK(DeviceBuffer::Create(QdqComputeAmaxWorkspaceBytes(s.qdq.data(), count), &s.ws));
  }
  // The fills ran on the legacy stream, which the benchmark's non-blocking stream does not wait
  // for.
  BENCH_CHECK(cudaDeviceSynchronize());
  return s;
}

class Bench {
 public:
  explicit Bench(const Options& o) : o_(o) { BENCH_CHECK(Stream::Create(&stream_)); }

  void Run() {
    cudaDeviceProp prop{};
    BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
    device_ = prop.name;
    std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    MeasureCopy();
    const std::vector<std::pair<int64_t, int64_t>> shapes = {
        {4096, 6144}, {7168, 2048}, {2048, 7168}};
    const QuantMode modes[] = {QuantMode::Standard(),
                               QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kExact),
                               QuantMode::FourOverSixDefault()};  // TE's: MAE, E = 256, exact
    if (!o_.qdq_only) {
      for (const auto& [r, c] : shapes) QuantizeCase(1, r, c, modes);
      QuantizeCase(128, 768, 2048, modes);
      if (!o_.quick) QuantizeCase(1, 32768, 16384, modes);
    }
    if (!o_.qdq_only && o_.all_modes) {
      const QuantMode others[] = {QuantMode::FourOverSix(ErrMetric::kMAE, 448, ErrKind::kExact),
                                  QuantMode::FourOverSix(ErrMetric::kMSE, 256, ErrKind::kExact),
                                  QuantMode::FourOverSix(ErrMetric::kMAE, 448, ErrKind::kFP16),
                                  QuantMode::FourOverSix(ErrMetric::kMAE, 256, ErrKind::kFP16),
                                  QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kFP16),
                                  QuantMode::FourOverSix(ErrMetric::kMSE, 256, ErrKind::kFP16)};
      QuantizeCase(128, 768, 2048, others);
      if (!o_.quick) QuantizeCase(1, 32768, 16384, others);
    }
    const QuantMode qdq_modes[] = {QuantMode::Standard(),
                                   QuantMode::FourOverSix(ErrMetric::kMAE, 448, ErrKind::kFP16),
                                   QuantMode::FourOverSix(ErrMetric::kMAE, 256, ErrKind::kFP16),
                                   QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kFP16),
                                   QuantMode::FourOverSix(ErrMetric::kMSE, 256, ErrKind::kFP16),
                                   QuantMode::FourOverSix(ErrMetric::kMSE, 448, ErrKind::kExact)};
    QdqCase(qdq_modes);
    Print();
  }

 private:
  void Add(Row r) {
    r.gbps = r.bytes / (r.us * 1e-6) / 1e9;
    r.fraction = copy_gbps_ > 0 ? r.gbps / copy_gbps_ : 1.0;
    r.same_gbps = SameSizeCopyGbps(r.bytes);
    r.same_fraction = r.same_gbps > 0 ? r.gbps / r.same_gbps : 0.0;
    rows_.push_back(r);
  }

  // Bandwidth of cudaMemcpyAsync device-to-device of bytes / 2 (so read + write = bytes), timed
  // like the kernels; iterations rotate through the 2 GiB baseline buffers so that, like the
  // kernels' inputs, no copy reads what the previous one left in L2. Cached per byte count.
  double SameSizeCopyGbps(double bytes) {
    const int64_t n = (static_cast<int64_t>(bytes / 2) + 255) / 256 * 256;
    if (n <= 0 || n > copy_bytes_) return 0;
    for (const auto& [size, gbps] : same_size_) {
      if (size == n) return gbps;
    }
    const int64_t slots = std::max<int64_t>(1, copy_bytes_ / n);
    const double us = TimeMedianUs(o_, stream_.get(), [&](int i) {
      const int64_t off = (i % slots) * n;
      BENCH_CHECK(cudaMemcpyAsync(copy_dst_.as<uint8_t>() + off, copy_src_.as<uint8_t>() + off, n,
                                  cudaMemcpyDeviceToDevice, stream_.get()));
    });
    const double gbps = 2.0 * n / (us * 1e-6) / 1e9;
    same_size_.emplace_back(n, gbps);
    return gbps;
  }

  void MeasureCopy() {
    const int64_t bytes = copy_bytes_;
    copy_src_ = Alloc(bytes, 1);
    copy_dst_ = Alloc(bytes, 2);
    const double us = TimeMedianUs(o_, stream_.get(), [&](int) {
      BENCH_CHECK(cudaMemcpyAsync(copy_dst_.data(), copy_src_.data(), bytes,
                                  cudaMemcpyDeviceToDevice, stream_.get()));
    });
    copy_gbps_ = 0;
    Row r{"copy D2D 2 GiB (baseline)", us, 2.0 * bytes, 0, 0, "read + write"};
    r.gbps = r.bytes / (us * 1e-6) / 1e9;
    copy_gbps_ = r.gbps;
    r.fraction = 1.0;
    r.same_gbps = r.gbps;
    r.same_fraction = 1.0;
    rows_.push_back(r);
  }

  template <size_t N>
  void QuantizeCase(int count, int64_t rows, int64_t cols, const QuantMode (&modes)[N]) {
    const int64_t set_bytes = count * rows * cols * 2;
    const int sets = static_cast<int>(std::max<int64_t>(1, kRotateBytes / set_bytes));
    std::vector<WeightSet> s;
    for (int i = 0; i < sets; ++i) s.push_back(MakeSet(count, rows, cols, i + 1, false));
    for (WeightSet& w : s) {  // amax once per set
      BENCH_KERNEL(LaunchAmax(w.descs.data(), count, nullptr, count, w.amax.as<float>(), nullptr,
                              stream_.get(), &m_));
    }
    const std::string shape = (count > 1 ? std::to_string(count) + " x " : std::string()) + "[" +
                              std::to_string(rows) + "," + std::to_string(cols) + "]";
    const double elems = static_cast<double>(count) * rows * cols;
    const double q_bytes = elems * 2 + elems / 2 + elems / 16;
    for (QuantMode mode : modes) {
      const double us = TimeMedianUs(o_, stream_.get(), [&](int i) {
        WeightSet& w = s[i % sets];
        BENCH_KERNEL(LaunchQuantize(w.qjobs.data(), count, mode, stream_.get(), &m_));
      });
      Add({std::string("quantize ") + mode.Name() + " bf16 " + shape, us, q_bytes, 0, 0,
           "given amax; in + packed + scales"});
      if (mode.algo == QuantAlgo::kStandard) {
        const double a_us = TimeMedianUs(o_, stream_.get(), [&](int i) {
          WeightSet& w = s[i % sets];
          BENCH_KERNEL(LaunchAmax(w.descs.data(), count, nullptr, count, w.amax.as<float>(),
                                  nullptr, stream_.get(), &m_));
        });
        Add({"amax bf16 " + shape, a_us, elems * 2, 0, 0, "in"});
      }
      const double e2e = TimeMedianUs(o_, stream_.get(), [&](int i) {
        WeightSet& w = s[i % sets];
        BENCH_KERNEL(LaunchAmax(w.descs.data(), count, nullptr, count, w.amax.as<float>(), nullptr,
                                stream_.get(), &m_));
        BENCH_KERNEL(LaunchQuantize(w.qjobs.data(), count, mode, stream_.get(), &m_));
      });
      Add({std::string("amax+quantize ") + mode.Name() + " bf16 " + shape, e2e, q_bytes + elems * 2,
           0, 0, "in read twice"});
    }
  }

  template <size_t N>
  void QdqCase(const QuantMode (&modes)[N]) {
    const int kCount = o_.qdq_count;
    const int64_t kRows = o_.qdq_rows;
    const int64_t kCols = o_.qdq_cols;
    const int sets = 2;  // by default 2 x 8 x 48 MiB: 768 MiB of inputs
    std::vector<WeightSet> s;
    for (int i = 0; i < sets; ++i) s.push_back(MakeSet(kCount, kRows, kCols, 50 + i, true));
    const double elems = static_cast<double>(kCount) * kRows * kCols;
    for (QuantMode mode : modes) {
      const std::string tag = std::string(mode.Name()) + " " + std::to_string(kCount) + " x [" +
                              std::to_string(kRows) + "," + std::to_string(kCols) + "] bf16";
      auto fused_on = [&](QdqAmaxPath path) {
        QdqAmaxOptions opt;
        opt.path = path;
        return TimeMedianUs(o_, stream_.get(), [&](int i) {
          WeightSet& w = s[i % sets];
          BENCH_KERNEL(LaunchQdqComputeAmax(w.qdq.data(), kCount, mode, w.ws.data(), w.ws.size(),
                                            stream_.get(), &m_, opt));
        });
      };
      const double fused = fused_on(QdqAmaxPath::kResident);
      const double fused_two_pass = fused_on(QdqAmaxPath::kTwoPass);
      const double unfused = TimeMedianUs(o_, stream_.get(), [&](int i) {
        WeightSet& w = s[i % sets];
        BENCH_KERNEL(LaunchAmax(w.descs.data(), kCount, nullptr, kCount, w.amax.as<float>(),
                                nullptr, stream_.get(), &m_));
        BENCH_KERNEL(LaunchQuantize(w.qjobs.data(), kCount, mode, stream_.get(), &m_));
        BENCH_KERNEL(LaunchDequantize(w.djobs.data(), kCount, mode, stream_.get(), &m_));
      });
      const double given = TimeMedianUs(o_, stream_.get(), [&](int i) {
        WeightSet& w = s[i % sets];
        BENCH_KERNEL(LaunchQdq(w.qdq.data(), kCount, mode, stream_.get(), &m_));
      });
      const double unfused_given = TimeMedianUs(o_, stream_.get(), [&](int i) {
        WeightSet& w = s[i % sets];
        BENCH_KERNEL(LaunchQuantize(w.qjobs.data(), kCount, mode, stream_.get(), &m_));
        BENCH_KERNEL(LaunchDequantize(w.djobs.data(), kCount, mode, stream_.get(), &m_));
      });
      char note[200];
      std::snprintf(note, sizeof(note),
                    "%.2fx faster than unfused; 4 B/elem counted (read once, written once; the "
                    "part over the SMs' shared memory is read twice, not counted)",
                    unfused / fused);
      Add({"fused QDQ, amax computed, resident " + tag, fused, elems * 4, 0, 0, note});
      std::snprintf(note, sizeof(note), "%.2fx faster than unfused; 6 B/elem (read twice)",
                    unfused / fused_two_pass);
      Add({"fused QDQ, amax computed, two-pass " + tag, fused_two_pass, elems * 6, 0, 0, note});
      Add({"unfused amax+quantize+dequantize " + tag, unfused,
           elems * 2 + (elems * 2 + elems * 9 / 16) + (elems * 9 / 16 + elems * 2), 0, 0,
           "baseline of the rows above"});
      std::snprintf(note, sizeof(note), "%.2fx faster than quantize+dequantize",
                    unfused_given / given);
      Add({"fused QDQ, amax given " + tag, given, elems * 4, 0, 0, note});
      Add({"unfused quantize+dequantize, amax given " + tag, unfused_given,
           (elems * 2 + elems * 9 / 16) + (elems * 9 / 16 + elems * 2), 0, 0, "baseline"});
    }
  }

  void Print() {
    std::printf("\n%-62s %10s %9s %8s %10s %8s  %s\n", "case", "median us", "GB/s", "of copy",
                "same-size", "of same", "note");
    for (const Row& r : rows_) {
      std::printf("%-62s %10.1f %9.1f %7.1f%% %10.1f %7.1f%%  %s\n", r.name.c_str(), r.us, r.gbps,
                  100 * r.fraction, r.same_gbps, 100 * r.same_fraction, r.note.c_str());
    }
    if (o_.json.empty()) return;
    FILE* f = std::fopen(o_.json.c_str(), "w");
    if (f == nullptr) return;
    std::fprintf(f, "{\"device\": \"%s\", \"copy_gbps\": %.3f, \"iters\": %d, \"rows\": [\n",
                 device_.c_str(), copy_gbps_, o_.iters);
    for (size_t i = 0; i < rows_.size(); ++i) {
      const Row& r = rows_[i];
      std::fprintf(f,
                   "  {\"name\": \"%s\", \"median_us\": %.3f, \"bytes\": %.0f, \"gbps\": %.3f, "
                   "\"fraction_of_copy\": %.4f, \"same_size_copy_gbps\": %.3f, "
                   "\"fraction_of_same_size_copy\": %.4f, \"note\": \"%s\"}%s\n",
                   r.name.c_str(), r.us, r.bytes, r.gbps, r.fraction, r.same_gbps, r.same_fraction,
                   r.note.c_str(), i + 1 < rows_.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }

  Options o_;
  Stream stream_;
  const int64_t copy_bytes_ = int64_t{2} << 30;
  DeviceBuffer copy_src_, copy_dst_;  // the baseline's buffers, kept for same-size copies
  std::vector<std::pair<int64_t, double>> same_size_;
  std::string device_;
  std::string m_;
  double copy_gbps_ = 0;
  std::vector<Row> rows_;
};

}  // namespace
}  // namespace wpub::kernels::cuda::bench

int main(int argc, char** argv) {
  wpub::kernels::cuda::bench::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      o.iters = std::atoi(argv[++i]);
    } else if (a == "--warmup" && i + 1 < argc) {
      o.warmup = std::atoi(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--qdq_only") {
      o.qdq_only = true;
    } else if (a == "--all_modes") {
      o.all_modes = true;
    } else if (a == "--qdq_rows" && i + 1 < argc) {
      o.qdq_rows = std::atoll(argv[++i]);
    } else if (a == "--qdq_cols" && i + 1 < argc) {
      o.qdq_cols = std::atoll(argv[++i]);
    } else if (a == "--qdq_count" && i + 1 < argc) {
      o.qdq_count = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--iters N] [--warmup N] [--json FILE] [--quick] [--qdq_only] "
                   "[--all_modes] [--qdq_count N] [--qdq_rows N] [--qdq_cols N]\n",
                   argv[0]);
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  wpub::kernels::cuda::bench::Bench(o).Run();
  return 0;
}
