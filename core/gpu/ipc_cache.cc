// IpcCache: validation, open-once mapping with bounds from cuMemGetAddressRange, LRU eviction.
#include "core/gpu/ipc_cache.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/gpu/backend_parts.h"

namespace wpub::gpu {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = absl::ascii_tolower(c);
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// cuMemGetAddressRange, looked up at run time (nothing links libcuda).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

std::string CudaName(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

}  // namespace

absl::StatusOr<DeviceUuid> ParseDeviceUuid(absl::string_view text, absl::string_view tensor) {
  absl::string_view t = text;
  if (absl::StartsWith(t, "GPU-")) t.remove_prefix(4);
  const std::string hex = absl::StrReplaceAll(t, {{"-", ""}});
  DeviceUuid uuid{};
  bool ok = hex.size() == 32;
  for (size_t i = 0; ok && i < 16; ++i) {
    const int hi = HexValue(hex[2 * i]), lo = HexValue(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    if (ok) uuid[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor, ": CUDA IPC device_uuid '", text,
                     "' is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or 32 "
                     "hex digits)"));
  }
  return uuid;
}

std::string FormatDeviceUuid(const DeviceUuid& u) {
  static const char* kHex = "0123456789abcdef";
  std::string s = "GPU-";
  for (size_t i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += kHex[u[i] >> 4];
    s += kHex[u[i] & 15];
  }
  return s;
}

absl::Status ValidateIpcSource(const engine::CudaIpcSource& source, uint64_t expected_bytes,
                               absl::string_view tensor) {
  if (std::all_of(source.handle.begin(), source.handle.end(), [](uint8_t b) { return b == 0; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor, ": CUDA IPC handle is all zeros (not a handle)"));
  }
  if (absl::Status s = ParseDeviceUuid(source.device_uuid, tensor).status(); !s.ok()) return s;
  if (source.length != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, ": CUDA IPC length ",
                                                   source.length, " != the part's ", expected_bytes,
                                                   " bytes"));
  }
  if (source.offset > UINT64_MAX - source.length) {
    return absl::OutOfRangeError(absl::StrCat("tensor ", tensor, ": CUDA IPC offset ",
                                              source.offset, " + length ", source.length,
                                              " overflows"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IpcCache>> IpcCache::Create(const IpcCacheOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC needs CUDA device ", options.device, ", but ",
                     err != cudaSuccess ? absl::StrCat("no device is usable: ", CudaName(err))
                                        : absl::StrCat("only ", count, " devices are present")));
  }
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGetDeviceProperties: ", CudaName(e)));
  }
  DeviceUuid uuid{};
  std::memcpy(uuid.data(), prop.uuid.bytes, 16);
  return std::unique_ptr<IpcCache>(new IpcCache(options, uuid));
}

IpcCache::IpcCache(const IpcCacheOptions& options, DeviceUuid uuid)
    : options_(options), uuid_(uuid) {}

IpcCache::~IpcCache() { Clear(); }

absl::StatusOr<const uint8_t*> IpcCache::Resolve(const engine::CudaIpcSource& source,
                                                 uint64_t expected_bytes,
                                                 absl::string_view tensor) {
  if (absl::Status s = ValidateIpcSource(source, expected_bytes, tensor); !s.ok()) return s;
  const DeviceUuid want = *ParseDeviceUuid(source.device_uuid, tensor);
  if (want != uuid_) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", tensor, ": CUDA IPC handle belongs to device ",
                     FormatDeviceUuid(want), " but this daemon runs on ", FormatDeviceUuid(uuid_),
                     " (trainer and wpubd must share the GPU)"));
  }
  const std::string key(reinterpret_cast<const char*>(source.handle.data()), source.handle.size());
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (entries_.size() >= options_.max_mappings && !lru_.empty()) Close(lru_.back());
    if (const cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaSetDevice: ", CudaName(e)));
    }
    cudaIpcMemHandle_t handle;
    static_assert(sizeof(handle) == 64, "cudaIpcMemHandle_t is 64 bytes");
    std::memcpy(&handle, source.handle.data(), sizeof(handle));
    void* base = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky, but leave no error for the next launch check
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", tensor,
          ": stale or foreign CUDA IPC handle (the allocation was freed, its "
          "process exited, or it was opened by this process already): cudaIpcOpenMemHandle: ",
          CudaName(e)));
    }
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    static const GetAddressRangeFn get_range =
        detail::DriverFunction<GetAddressRangeFn>("cuMemGetAddressRange");
    if (get_range == nullptr ||
        get_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
      cudaIpcCloseMemHandle(base);
      return absl::InternalError(
          absl::StrCat("tensor ", tensor, ": cannot read the extent of the IPC allocation"));
    }
    ++opens_;
    lru_.push_front(key);
    Entry entry;
    entry.base = base;
    entry.size = range_size - (reinterpret_cast<CUdeviceptr>(base) - range_base);
    entry.lru = lru_.begin();
    it = entries_.emplace(key, entry).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  const Entry& e = it->second;
  if (source.offset + source.length > e.size) {
    return absl::OutOfRangeError(absl::StrCat("tensor ", tensor, ": CUDA IPC range [",
                                              source.offset, ", ", source.offset + source.length,
                                              ") exceeds the allocation's ", e.size, " bytes"));
  }
  return static_cast<const uint8_t*>(e.base) + source.offset;
}

void IpcCache::Close(const std::string& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  cudaIpcCloseMemHandle(it->second.base);
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

void IpcCache::EndPublication() {
  if (!options_.keep_across_publications) Clear();
}

void IpcCache::Clear() {
  while (!lru_.empty()) Close(lru_.back());
}

}  // namespace wpub::gpu
