// Device fill of the GPU-path benchmark's synthetic bf16 weights (asynchronous on `stream`).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace wpub::bench {

cudaError_t FillBf16(void* data, uint64_t elements, uint64_t seed, cudaStream_t stream);

}  // namespace wpub::bench
