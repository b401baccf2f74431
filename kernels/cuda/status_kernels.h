// Device-side bookkeeping kernels of the GPU publication path, writing into the publication's
// status block so that the host reads it once: the bucket checksum of core/transport/checksum.h
// (partial sums over words, added atomically mod 2^64) and the count of non-finite elements of
// passed-through floating-point tensors; and the gather copy that lays a bucket's passed-through
// tensors into it. Launch contract: asynchronous on `stream`, no host
// synchronization, capturable in a CUDA graph; returns the launch error (cudaSuccess when
// nothing needed launching).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace wpub::kernels::cuda {

// *sum += S over the n bytes at `data` (a device buffer, 4-byte aligned), the words numbered
// from `first_word` (see ChecksumPartial). ChecksumFinish(*sum, total_bytes) on the host gives
// the bucket's checksum once every part has been added.
cudaError_t LaunchChecksumAdd(const uint8_t* data, uint64_t n, uint64_t first_word,
                              unsigned long long* sum, cudaStream_t stream);

// Element encodings the non-finite counter understands.
enum class FloatKind : int { kBF16 = 0, kF16 = 1, kF32 = 2, kF64 = 3 };

// One region to scan: counts[slot] += elements of `data` (bytes, naturally aligned) whose
// exponent bits are all ones (inf or NaN).
struct CountItem {
  const void* data = nullptr;
  uint64_t bytes = 0;
  FloatKind kind = FloatKind::kBF16;
  uint32_t slot = 0;
};

// Scans every item; items travel in kernel parameters (a few launches for any list), so a
// publication with thousands of passed-through tensors costs a handful of launches.
cudaError_t LaunchCountNonFinite(const CountItem* items, int num_items, unsigned long long* counts,
                                 cudaStream_t stream);

// One device-to-device copy of `bytes` (any alignment; the regions must not overlap).
struct CopyItem {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

// Every item's copy, items in kernel parameters: a bucket's hundreds of passed-through tensors
// in one or a few launches instead of one cudaMemcpyAsync each (each costs the host several
// microseconds). 16-byte vectors where source and destination share their offset in a 16-byte
// line, else the widest word they share.
cudaError_t LaunchGatherCopy(const CopyItem* items, int num_items, cudaStream_t stream);

}  // namespace wpub::kernels::cuda
