// Stream priorities of the publication path. A bucket's broadcast and the next bucket's work
// become ready at the same moment (both wait for the broadcast before: the staging buffer it
// frees, or the receive stream it occupied); on streams of equal priority the compute kernel
// (quantize/pack on the publisher, the bucket checksum on a receiver) can take every SM first
// and hold back the NCCL kernel, idling the link for as long as it runs (measured on H200: about
// 1.1 ms per 1 GiB bucket, a third of the broadcast). Communication streams are therefore
// created at the device's greatest priority and compute streams at its least: the NCCL kernel's
// blocks are scheduled as soon as any SM frees up, and the compute kernel fills the rest.
#pragma once

#include <cuda_runtime_api.h>

namespace wpub::gpu {

enum class StreamRole { kCommunication, kCompute };

// The current device's stream priority for `role`.
inline cudaError_t StreamPriority(StreamRole role, int* priority) {
  int least = 0, greatest = 0;
  const cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  *priority = role == StreamRole::kCommunication ? greatest : least;
  return e;
}

// A non-blocking stream on the current device with the priority of `role`.
inline cudaError_t CreateStream(StreamRole role, cudaStream_t* stream) {
  int priority = 0;
  if (const cudaError_t e = StreamPriority(role, &priority); e != cudaSuccess) return e;
  return cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking, priority);
}

}  // namespace wpub::gpu
