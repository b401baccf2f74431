// Device fill of the GPU-path benchmark's synthetic bf16 weights (asynchronous on `stream`).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace wpub::bench {

cudaError_t FillBf16(void* data, uint64_t elements, uint64_t seed, cudaStream_t stream);

// An RL-like step's weights (the delta benchmark's update model): the bf16 copy (round to
// nearest even) of an fp32 master weight after `step` AdamW steps (beta1 0.9, beta2 0.999,
// eps 1e-8, no weight decay, bias-corrected) at learning rate `lr` on gradients of i.i.d.
// N(0, 1)-distributed entries, the master initialised N(0, init_std). Element i's initial value
// and gradients are functions of (seed, i, step) -- each normal the sum of four uniforms scaled
// to unit variance -- so any step is computed from scratch without optimizer state (60 bytes of
// fp32 state per weight for a 30B model would not fit a GPU); the work grows with `step`.
cudaError_t FillAdamBf16(void* data, uint64_t elements, uint64_t seed, int step, float lr,
                         float init_std, cudaStream_t stream);

}  // namespace wpub::bench
