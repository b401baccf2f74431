// CUDA IPC mapping cache: resolves a trainer's (cudaIpcMemHandle_t, device UUID, offset,
// length) into a device pointer the kernels read in place. Each allocation is opened once
// (cudaIpcOpenMemHandle) and cached by its handle bytes; the allocation's extent is read
// (cuMemGetAddressRange) so every part is bounds-checked. Mappings are closed at the end of a
// publication (EndPublication) unless kept for reuse, and on eviction when the cache is full.
//
// Errors never crash the daemon: a handle of another device, of a freed allocation or
// of another process's dead context is FAILED_PRECONDITION naming the tensor and the CUDA
// error; a range beyond the allocation is OUT_OF_RANGE naming both extents; a malformed UUID
// or an all-zero handle is INVALID_ARGUMENT. Validation that needs no GPU is exposed as free
// functions (tested on machines without one).
//
// Thread-compatible: owned and used by the publication thread. Mapped pointers stay valid
// until EndPublication (when not kept), eviction or destruction.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine/backend.h"
#include "core/engine/types.h"

namespace wpub::gpu {

using DeviceUuid = std::array<uint8_t, 16>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi), the same without "GPU-", or 32
// hex digits. INVALID_ARGUMENT naming `tensor` otherwise.
absl::StatusOr<DeviceUuid> ParseDeviceUuid(absl::string_view text, absl::string_view tensor);
std::string FormatDeviceUuid(const DeviceUuid& uuid);  // "GPU-xxxxxxxx-..."

// Checks a source without touching a GPU: non-zero handle, parseable UUID, length equal to
// `expected_bytes`, offset + length without overflow.
absl::Status ValidateIpcSource(const engine::CudaIpcSource& source, uint64_t expected_bytes,
                               absl::string_view tensor);

struct IpcCacheOptions {
  int device = 0;              // the CUDA device wpubd runs on
  size_t max_mappings = 4096;  // open allocations; least recently used ones are closed beyond
  // Keep mappings across publications (trainers usually publish from the same allocations
  // every step; reopening costs ~100 us each). Stale ones are detected by the trainer's
  // handle changing, since a freed allocation yields a new handle when reallocated.
  bool keep_across_publications = true;
};

// The engine's CudaIpcResolver on the GPU path (EngineComponents::cuda_ipc).
class IpcCache : public engine::CudaIpcResolver {
 public:
  // FAILED_PRECONDITION when there is no CUDA device `options.device` (the message says so).
  static absl::StatusOr<std::unique_ptr<IpcCache>> Create(const IpcCacheOptions& options);
  ~IpcCache() override;  // closes every mapping
  IpcCache(const IpcCache&) = delete;
  IpcCache& operator=(const IpcCache&) = delete;

  // The device pointer of source.offset within the mapped allocation. See the error contract
  // above. `expected_bytes` is the part's byte size.
  absl::StatusOr<const uint8_t*> Resolve(const engine::CudaIpcSource& source,
                                         uint64_t expected_bytes,
                                         absl::string_view tensor) override;

  // Closes mappings opened for this publication unless options.keep_across_publications.
  void EndPublication() override;
  // Closes every mapping (e.g. when the trainer restarted).
  void Clear();

  size_t size() const { return entries_.size(); }
  uint64_t opens() const { return opens_; }
  const DeviceUuid& device_uuid() const { return uuid_; }

 private:
  struct Entry {
    void* base = nullptr;
    uint64_t size = 0;
    std::list<std::string>::iterator lru;
  };
  IpcCache(const IpcCacheOptions& options, DeviceUuid uuid);
  void Close(const std::string& key);

  const IpcCacheOptions options_;
  const DeviceUuid uuid_;
  std::unordered_map<std::string, Entry> entries_;  // key: the 64 handle bytes
  std::list<std::string> lru_;                      // most recent first
  uint64_t opens_ = 0;
};

}  // namespace wpub::gpu
