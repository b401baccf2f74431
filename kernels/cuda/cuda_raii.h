// RAII owners for the CUDA runtime objects wpub holds: device buffers, pinned host buffers,
// streams, events and executable graphs. Header-only and free of absl so both kernels/ and
// the daemon can use them.
//
// Contract: every owner is move-only; a default-constructed or moved-from owner holds nothing.
// Creation goes through `static cudaError_t Create(..., T* out)` (no exceptions, no two-phase
// init visible to callers); on failure *out is left empty. Destructors release without
// synchronizing the device beyond what the runtime call itself implies (cudaFree synchronizes
// implicitly; free buffers outside latency-critical paths). Not thread-safe per object: share
// an owner across threads only with external synchronization.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace wpub::kernels::cuda {

// Where a CudaBuffer's memory comes from: device memory of the current device (cudaMalloc), or
// page-locked host memory (cudaMallocHost), the only host memory an asynchronous copy may target
// without the runtime staging it synchronously.
// What a device allocation of `bytes` asks cudaMalloc for: whole 2 MiB pages from 2 MiB up. A
// colocated engine's torch opens wpub's buckets by CUDA IPC, and maps an allocation whose last
// large page is partial ~7-23x slower (one H100: 512 MiB opens in 0.33 ms, 513 MiB in 2.4 ms,
// 2049 MiB in 7.8 ms); below 2 MiB nothing is shared and the runtime suballocates. Every device
// allocation of wpub goes through it (DeviceMemory, gpu::HostSyncs::Malloc).
inline size_t DeviceAllocationBytes(size_t bytes) {
  constexpr size_t kPage = size_t{2} << 20;
  return bytes < kPage ? bytes : (bytes + kPage - 1) / kPage * kPage;
}

struct DeviceMemory {
  static cudaError_t Allocate(void** p, size_t bytes) {
    return cudaMalloc(p, DeviceAllocationBytes(bytes));
  }
  static void Free(void* p) { cudaFree(p); }
};
struct PinnedHostMemory {
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
  static void Free(void* p) { cudaFreeHost(p); }
};

// Owns `bytes` of memory from Memory::Allocate; DeviceBuffer and PinnedHostBuffer below.
template <typename Memory>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  ~CudaBuffer() { Reset(); }
  CudaBuffer(CudaBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  CudaBuffer& operator=(CudaBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  // A zero-byte request succeeds and yields an empty buffer (data() == nullptr). Whatever *out
  // held is released first.
  static cudaError_t Create(size_t bytes, CudaBuffer* out) {
    *out = CudaBuffer();
    if (bytes == 0) return cudaSuccess;
    void* p = nullptr;
    const cudaError_t err = Memory::Allocate(&p, bytes);
    if (err != cudaSuccess) return err;
    out->ptr_ = p;
    out->bytes_ = bytes;
    return cudaSuccess;
  }

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }

  void Reset() {
    if (ptr_ != nullptr) Memory::Free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

using DeviceBuffer = CudaBuffer<DeviceMemory>;
using PinnedHostBuffer = CudaBuffer<PinnedHostMemory>;

// Owns a non-blocking stream (it does not synchronize with the legacy default stream).
class Stream {
 public:
  Stream() = default;
  ~Stream() { Reset(); }
  Stream(Stream&& other) noexcept : s_(std::exchange(other.s_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      Reset();
      s_ = std::exchange(other.s_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  static cudaError_t Create(Stream* out) {
    *out = Stream();
    return cudaStreamCreateWithFlags(&out->s_, cudaStreamNonBlocking);
  }
  // With a scheduling priority (cudaDeviceGetStreamPriorityRange gives the current device's
  // range; lower numbers are greater priorities).
  static cudaError_t CreateWithPriority(int priority, Stream* out) {
    *out = Stream();
    return cudaStreamCreateWithPriority(&out->s_, cudaStreamNonBlocking, priority);
  }

  cudaStream_t get() const { return s_; }
  // Blocks the calling thread until the stream's work is done.
  cudaError_t Synchronize() const { return cudaStreamSynchronize(s_); }

  void Reset() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
    s_ = nullptr;
  }

 private:
  cudaStream_t s_ = nullptr;
};

// Owns an event. `timing` = false creates it with cudaEventDisableTiming, the cheap kind for
// cross-stream ordering.
class Event {
 public:
  Event() = default;
  ~Event() { Reset(); }
  Event(Event&& other) noexcept : e_(std::exchange(other.e_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      Reset();
      e_ = std::exchange(other.e_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  static cudaError_t Create(bool timing, Event* out) {
    *out = Event();
    return cudaEventCreateWithFlags(&out->e_, timing ? cudaEventDefault : cudaEventDisableTiming);
  }

  cudaEvent_t get() const { return e_; }
  cudaError_t Record(cudaStream_t stream) const { return cudaEventRecord(e_, stream); }
  // Blocks the calling thread until the event has completed.
  cudaError_t Synchronize() const { return cudaEventSynchronize(e_); }

  void Reset() {
    if (e_ != nullptr) cudaEventDestroy(e_);
    e_ = nullptr;
  }

 private:
  cudaEvent_t e_ = nullptr;
};

// Owns a captured graph and its executable instance. Typical use: BeginCapture on a stream,
// enqueue launches, EndCapture, then Launch any number of times (each replay reads whatever the
// captured pointers hold at that time).
class Graph {
 public:
  Graph() = default;
  ~Graph() { Reset(); }
  Graph(Graph&& other) noexcept
      : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}
  Graph& operator=(Graph&& other) noexcept {
    if (this != &other) {
      Reset();
      graph_ = std::exchange(other.graph_, nullptr);
      exec_ = std::exchange(other.exec_, nullptr);
    }
    return *this;
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Starts capturing `stream` (thread-local mode: other threads' CUDA calls are unaffected).
  static cudaError_t BeginCapture(cudaStream_t stream) {
    return cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  }

  // Ends the capture on `stream` and instantiates it into *out. If the capture was invalidated
  // (e.g. a synchronizing call was made), the error of cudaStreamEndCapture is returned.
  static cudaError_t EndCapture(cudaStream_t stream, Graph* out) {
    *out = Graph();
    cudaGraph_t g = nullptr;
    cudaError_t err = cudaStreamEndCapture(stream, &g);
    if (err != cudaSuccess) {
      if (g != nullptr) cudaGraphDestroy(g);
      return err;
    }
    out->graph_ = g;
    return cudaGraphInstantiate(&out->exec_, g, 0);
  }

  cudaError_t Launch(cudaStream_t stream) const { return cudaGraphLaunch(exec_, stream); }
  cudaGraph_t graph() const { return graph_; }
  cudaGraphExec_t exec() const { return exec_; }

  void Reset() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace wpub::kernels::cuda
