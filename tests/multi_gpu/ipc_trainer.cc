// A stand-in for the trainer's process in the multi-GPU tests: it owns the synthetic MoE's
// weights in one cudaMalloc allocation on its GPU and exports them as a CUDA IPC handle, as
// the trainer's Python client does with torch tensors. Protocol on stdin/stdout, one line each:
//   -> "ready <handle hex (128 digits)> <device uuid> <bytes>"
//   <- "fill <seed>"   (writes the model's values for `seed`)   -> "filled <seed>"
//   <- "load <file>"   (copies the file's bytes to the start)   -> "loaded <bytes>"
//   <- "quit"
// Usage: multi_gpu_ipc_trainer <device> <layers> <experts> <hidden> <inter>
//        multi_gpu_ipc_trainer <device> bytes <n>   (a raw allocation, filled with "load")
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "core/gpu/ipc_cache.h"
#include "tests/multi_gpu/moe_fixture.h"

int main(int argc, char** argv) {
  const bool raw = argc == 4 && std::string(argv[2]) == "bytes";
  if (argc != 6 && !raw) {
    std::fprintf(stderr, "usage: %s device layers experts hidden inter\n", argv[0]);
    return 2;
  }
  const int device = std::atoi(argv[1]);
  wpub::testing::MoeShape shape;
  wpub::testing::ModelLayout layout;
  if (raw) {
    layout.total_bytes = std::strtoull(argv[3], nullptr, 10);
  } else {
    shape.layers = std::atoi(argv[2]);
    shape.experts = std::atoi(argv[3]);
    shape.hidden = std::atoll(argv[4]);
    shape.inter = std::atoll(argv[5]);
    layout = wpub::testing::LayoutModel(shape);
  }
  if (cudaSetDevice(device) != cudaSuccess) return 3;
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, layout.total_bytes) != cudaSuccess) return 4;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, ptr) != cudaSuccess) return 5;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  wpub::gpu::DeviceUuid uuid;
  std::copy(prop.uuid.bytes, prop.uuid.bytes + 16, reinterpret_cast<char*>(uuid.data()));
  std::string hex;
  static const char* kHex = "0123456789abcdef";
  const auto* h = reinterpret_cast<const unsigned char*>(&handle);
  for (size_t i = 0; i < sizeof(handle); ++i) {
    hex += kHex[h[i] >> 4];
    hex += kHex[h[i] & 15];
  }
  std::cout << "ready " << hex << " " << wpub::gpu::FormatDeviceUuid(uuid) << " "
            << layout.total_bytes << std::endl;
  std::vector<uint8_t> host(layout.total_bytes);
  std::string cmd;
  while (std::cin >> cmd) {
    if (cmd == "quit") break;
    if (cmd == "load") {
      std::string path;
      std::cin >> path;
      std::ifstream in(path, std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      if (bytes.size() > layout.total_bytes ||
          cudaMemcpy(ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
        return 7;
      }
      std::cout << "loaded " << bytes.size() << std::endl;
      continue;
    }
    if (cmd == "fill") {
      uint64_t seed = 0;
      std::cin >> seed;
      wpub::testing::FillHost(layout, seed, host.data());
      if (cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
        return 6;
      }
      cudaDeviceSynchronize();
      std::cout << "filled " << seed << std::endl;
    }
  }
  cudaFree(ptr);
  return 0;
}
