// L2 reuse probe (a program, not a test): how much of a buffer that one kernel has just read does
// the next kernel find in L2? This is what a two-pass fused QDQ with the amax computed (an amax
// launch, then the QDQ launch over the same slice) can gain from the cache, and what bounds it on
// a given GPU. For each size S it times, with CUDA events, one launch of
//   read        a persistent grid (4 CTAs of 256 threads per SM) reading S, every CTA the same
//               contiguous share each time, 8 x 16 B in flight per thread;
//   read+write  the same grid reading S and writing S elsewhere (the QDQ pass's traffic);
// once after evicting L2 (a 512 MiB copy: "cold"), once right after a read of the same buffer by
// the same grid ("reread"), and once right after a read whose loads asked L2 to keep the lines
// longest (an `evict_last` cache policy: "after keep"). A ratio to cold near the one of sizes far
// over L2 (where nothing can be found) means the second pass found nothing in L2.
// Usage: l2_reuse_bench [--iters N] [--sizes MIB,MIB,...]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/kernels/bench_check.h"
#include "kernels/cuda/cuda_raii.h"

namespace {

constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;
constexpr int kVecsInFlight = 8;

// A 16-byte load, with an L2 evict_last cache policy when kKeep.
template <bool kKeep>
__device__ __forceinline__ uint4 Load(const uint4* p, uint64_t policy) {
  if constexpr (kKeep) {
    uint4 v;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
  } else {
    return __ldg(p);
  }
}

// CTA c of the grid reads vectors [c * per, (c + 1) * per) of `in` (and with `out` writes them,
// altered, to the same place in `out`). The XOR keeps the loads alive; `sink` is never written
// for real data. kKeep: the loads ask L2 to keep the lines (used for read-only passes).
template <bool kKeep>
__global__ void __launch_bounds__(kThreads)
    ShareKernel(const uint4* in, uint4* out, uint64_t num_vecs, unsigned* sink) {
  uint64_t policy = 0;
  if constexpr (kKeep) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  }
  const uint64_t per = (num_vecs + gridDim.x - 1) / gridDim.x;
  const uint64_t begin = blockIdx.x * per;
  const uint64_t end = begin + per < num_vecs ? begin + per : num_vecs;
  uint32_t acc = 0;
  for (uint64_t base = begin + threadIdx.x; base < end; base += kVecsInFlight * kThreads) {
    uint4 v[kVecsInFlight];
#pragma unroll
    for (int u = 0; u < kVecsInFlight; ++u) {
      const uint64_t i = base + static_cast<uint64_t>(u) * kThreads;
      v[u] = i < end ? Load<kKeep>(in + i, policy) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kVecsInFlight; ++u) {
      const uint64_t i = base + static_cast<uint64_t>(u) * kThreads;
      if (out != nullptr && i < end) {
        out[i] = make_uint4(v[u].x ^ 1u, v[u].y ^ 1u, v[u].z ^ 1u, v[u].w ^ 1u);
      }
      acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x9E3779B9u && out == nullptr) *sink = acc;
}

struct Options {
  int iters = 9;
  std::vector<int> sizes_mib = {8, 16, 24, 32, 40, 48, 56, 64, 96};
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sizes" && i + 1 < argc) {
      o.sizes_mib.clear();
      for (char* tok = std::strtok(argv[++i], ","); tok != nullptr;
           tok = std::strtok(nullptr, ",")) {
        o.sizes_mib.push_back(std::max(1, std::atoi(tok)));
      }
    } else {
      std::fprintf(stderr, "usage: l2_reuse_bench [--iters N] [--sizes MIB,MIB,...]\n");
      std::exit(2);
    }
  }
  if (o.sizes_mib.empty()) {
    std::fprintf(stderr, "l2_reuse_bench: --sizes names no size\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  using wpub::kernels::cuda::DeviceBuffer;
  using wpub::kernels::cuda::Event;
  const Options opt = Parse(argc, argv);
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
  const int sms = prop.multiProcessorCount;
  const int max_mib = *std::max_element(opt.sizes_mib.begin(), opt.sizes_mib.end());
  const size_t max_bytes = size_t{static_cast<size_t>(max_mib)} << 20;
  constexpr size_t kEvictBytes = size_t{512} << 20;
  DeviceBuffer in, out, evict_src, evict_dst, sink;
  BENCH_CHECK(DeviceBuffer::Create(max_bytes, &in));
  BENCH_CHECK(DeviceBuffer::Create(max_bytes, &out));
  BENCH_CHECK(DeviceBuffer::Create(kEvictBytes, &evict_src));
  BENCH_CHECK(DeviceBuffer::Create(kEvictBytes, &evict_dst));
  BENCH_CHECK(DeviceBuffer::Create(sizeof(unsigned), &sink));
  BENCH_CHECK(cudaMemset(in.data(), 0x5A, max_bytes));
  BENCH_CHECK(cudaMemset(evict_src.data(), 0x3C, kEvictBytes));
  Event start, stop;
  BENCH_CHECK(Event::Create(/*timing=*/true, &start));
  BENCH_CHECK(Event::Create(/*timing=*/true, &stop));
  const dim3 grid(static_cast<unsigned>(sms * kCtasPerSm));
  auto launch = [&](uint64_t vecs, bool write, bool keep) {
    uint4* dst = write ? out.as<uint4>() : nullptr;
    if (keep) {
      ShareKernel<true><<<grid, kThreads>>>(in.as<const uint4>(), dst, vecs, sink.as<unsigned>());
    } else {
      ShareKernel<false><<<grid, kThreads>>>(in.as<const uint4>(), dst, vecs, sink.as<unsigned>());
    }
    BENCH_CHECK(cudaGetLastError());
  };
  enum class Before { kEvicted, kRead, kReadKeep };
  // Median time (us) of the measured launch after evicting L2 and then `before`.
  auto time_one = [&](uint64_t vecs, bool write, Before before) {
    std::vector<float> t;
    for (int r = 0; r < opt.iters; ++r) {
      BENCH_CHECK(cudaMemcpyAsync(evict_dst.data(), evict_src.data(), kEvictBytes,
                                  cudaMemcpyDeviceToDevice));
      if (before != Before::kEvicted) launch(vecs, /*write=*/false, before == Before::kReadKeep);
      BENCH_CHECK(cudaEventRecord(start.get()));
      launch(vecs, write, /*keep=*/false);
      BENCH_CHECK(cudaEventRecord(stop.get()));
      BENCH_CHECK(cudaEventSynchronize(stop.get()));
      float ms = 0.0f;
      BENCH_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
      t.push_back(ms * 1e3f);
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    return t[t.size() / 2];
  };
  std::printf("%s, %d SMs, L2 %d MiB; grid %u x %d threads; median of %d\n", prop.name, sms,
              prop.l2CacheSize >> 20, grid.x, kThreads, opt.iters);
  std::printf("%5s | %23s | %23s | %23s\n", "", "read: cold us", "read+write: cold us",
              "read+write after keep");
  std::printf("%5s | %23s | %23s | %23s\n", "MiB", "reread us (ratio)", "reread us (ratio)",
              "us (ratio to cold)");
  for (int mib : opt.sizes_mib) {
    const uint64_t vecs = (uint64_t{static_cast<uint64_t>(mib)} << 20) / 16;
    const float rc = time_one(vecs, false, Before::kEvicted);
    const float rr = time_one(vecs, false, Before::kRead);
    const float wc = time_one(vecs, true, Before::kEvicted);
    const float wr = time_one(vecs, true, Before::kRead);
    const float wk = time_one(vecs, true, Before::kReadKeep);
    std::printf("%5d | %6.1f %6.1f (%5.2f)     | %6.1f %6.1f (%5.2f)     | %6.1f (%5.2f)\n", mib,
                rc, rr, rr / rc, wc, wr, wr / wc, wk, wk / wc);
  }
  return 0;
}
