// BENCH_CHECK(expr): the kernel benchmark programs' CUDA runtime check. A failing call prints
// where and why to stderr and exits with status 1 (a benchmark has nothing to recover).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define BENCH_CHECK(expr)                                                                        \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)
