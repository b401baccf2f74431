// Throughput probe of the CPU reference (a program, not a test): amax, quantize and fused QDQ
// of one bf16 [4096, 6144] weight in three modes, for 1, 4 and all hardware threads; best of 3.
// Usage: kernels_reference_throughput [rows cols]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kernels/reference.h"
#include "kernels/testing/test_data.h"

namespace wpub::kernels {
namespace {

template <class Fn>
double BestSeconds(const Fn& fn) {
  fn();  // warm-up (page faults, thread start)
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    best =
        std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return best;
}

int Run(int64_t rows, int64_t cols) {
  const testing::TestTensor t = testing::MakeRandomTensor(ElemType::kBF16, rows, cols, 1);
  const WeightDesc w = t.desc();
  const int64_t n = rows * cols;
  std::vector<uint8_t> packed(static_cast<size_t>(n / 2)), scales(static_cast<size_t>(n / 16));
  std::vector<uint16_t> y(static_cast<size_t>(n));
  float amax = 0, decode_scale = 0;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("bf16 [%lld, %lld], %d hardware threads\n", static_cast<long long>(rows),
              static_cast<long long>(cols), all);
  std::printf("%-8s %-34s %10s %12s\n", "threads", "operation", "ms", "Melem/s");
  for (int threads : {1, 4, all}) {
    const CpuOptions options{threads};
    auto report = [&](const char* what, double s) {
      std::printf("%-8d %-34s %10.1f %12.1f\n", threads, what, s * 1e3, n / s / 1e6);
    };
    report("amax", BestSeconds([&] { ComputeAmax(w, &amax, nullptr, options); }));
    for (int m : {0, 5, 6}) {
      const QuantMode mode = QuantMode::FromIndex(m);
      const QuantOutput out{packed.data(), scales.data(), nullptr, &decode_scale};
      const QdqTask task{&w, &amax, y.data()};
      const std::string q = std::string("quantize ") + mode.Name();
      const std::string f = std::string("qdq ") + mode.Name();
      report(q.c_str(), BestSeconds([&] { Quantize(w, &amax, mode, out, options); }));
      report(f.c_str(),
             BestSeconds([&] { FakeQuantize(std::span<const QdqTask>(&task, 1), mode, options); }));
    }
  }
  return 0;
}

}  // namespace
}  // namespace wpub::kernels

int main(int argc, char** argv) {
  const int64_t rows = argc > 2 ? std::atoll(argv[1]) : 4096;
  const int64_t cols = argc > 2 ? std::atoll(argv[2]) : 6144;
  if (cols % 16 != 0 || rows < 1) {
    std::fprintf(stderr, "cols must be a positive multiple of 16\n");
    return 2;
  }
  return wpub::kernels::Run(rows, cols);
}
