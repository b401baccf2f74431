// The bucket diff's speed (kernels/cuda/bucket_diff.h; a program, not a test): for buckets of 64,
// 256 and 1024 MiB, the diff of two device buckets with no word, 0.1%, 3% and every word changed,
// against a device-to-device copy of the bucket and a kernel that only reads both buckets (the
// floor of the compare pass): the mean of 20 launches after 3 warm-ups, timed with
// events. Usage: bucket_diff_bench (GPU 0).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "kernels/cuda/bucket_diff.h"
using wpub::kernels::cuda::BucketDiffScratchBytes;
using wpub::kernels::cuda::BucketDiffTotals;
using wpub::kernels::cuda::LaunchBucketDiff;
// Read-only baseline: reads both buffers once (the floor for the compare pass).
__global__ void ReadBoth(const uint4* a, const uint4* b, uint64_t units, unsigned* out) {
  unsigned acc = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < units; i += 4 * stride) {
    uint4 x[4], y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * stride < units) {
        x[u] = __ldg(a + i + u * stride);
        y[u] = __ldg(b + i + u * stride);
      } else {
        x[u] = y[u] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      acc |= (x[u].x ^ y[u].x) | (x[u].y ^ y[u].y) | (x[u].z ^ y[u].z) | (x[u].w ^ y[u].w);
  }
  if (acc == 0x12345678u) out[0] = acc;
}
#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      exit(1);                                       \
    }                                                \
  } while (0)
int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("device %s\n", p.name);
  for (uint64_t mib : {64, 256, 1024}) {
    const uint64_t n = mib << 20, words = n / 8;
    uint8_t *base, *next, *patch, *copy;
    void* scratch;
    BucketDiffTotals* tot;
    CK(cudaMalloc(&base, n));
    CK(cudaMalloc(&next, n));
    CK(cudaMalloc(&copy, n));
    const uint64_t cap = n / 2;
    CK(cudaMalloc(&patch, cap));
    const uint64_t sb = BucketDiffScratchBytes(n, cap);
    CK(cudaMalloc(&scratch, sb));
    CK(cudaMalloc(&tot, sizeof(*tot)));
    std::vector<uint64_t> h(words);
    std::mt19937_64 rng(1);
    for (auto& x : h) x = rng();
    CK(cudaMemcpy(base, h.data(), n, cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const int iters = 20;
    float ms;
    for (int i = 0; i < 3; ++i) CK(cudaMemcpy(copy, base, n, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) CK(cudaMemcpyAsync(copy, base, n, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&ms, a, b));
    const double copy_us = ms * 1000 / iters;
    printf("%4llu MiB copy D2D (2n bytes moved): %8.1f us  %6.0f GB/s\n", (unsigned long long)mib,
           copy_us, 2.0 * n / copy_us / 1e3);
    {
      int sms = p.multiProcessorCount;
      unsigned* o;
      CK(cudaMalloc(&o, 4));
      for (int i = 0; i < 3; ++i)
        ReadBoth<<<sms * 8, 256>>>((const uint4*)base, (const uint4*)copy, n / 16, o);
      CK(cudaEventRecord(a));
      for (int i = 0; i < iters; ++i)
        ReadBoth<<<sms * 8, 256>>>((const uint4*)base, (const uint4*)copy, n / 16, o);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaEventElapsedTime(&ms, a, b));
      printf("%4llu MiB read both (2n bytes read):  %8.1f us  %6.0f GB/s\n",
             (unsigned long long)mib, ms * 1000 / iters, 2.0 * n / (ms * 1000 / iters) / 1e3);
      cudaFree(o);
    }
    for (double rate : {0.0, 0.001, 0.03, 1.0}) {
      std::vector<uint64_t> hn = h;
      for (uint64_t w = 0; w < words; ++w)
        if (rate >= 1.0 || std::uniform_real_distribution<double>(0, 1)(rng) < rate) hn[w] ^= 1;
      CK(cudaMemcpy(next, hn.data(), n, cudaMemcpyHostToDevice));
      for (int i = 0; i < 3; ++i)
        CK(LaunchBucketDiff(base, next, n, 1, 2, patch, cap, scratch, sb, tot, nullptr));
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(a));
      for (int i = 0; i < iters; ++i)
        CK(LaunchBucketDiff(base, next, n, 1, 2, patch, cap, scratch, sb, tot, nullptr));
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaEventElapsedTime(&ms, a, b));
      BucketDiffTotals t;
      CK(cudaMemcpy(&t, tot, sizeof(t), cudaMemcpyDeviceToHost));
      const double us = ms * 1000 / iters;
      printf(
          "%4llu MiB rate %.3f: diff %8.1f us  read %6.0f GB/s (2n/t)  %.2fx copy time  runs %llu "
          "changed %llu bytes %llu written %llu\n",
          (unsigned long long)mib, rate, us, 2.0 * n / us / 1e3, us / copy_us, t.runs,
          t.changed_words, t.patch_bytes, t.written);
    }
    cudaFree(base);
    cudaFree(next);
    cudaFree(copy);
    cudaFree(patch);
    cudaFree(scratch);
    cudaFree(tot);
  }
}
