// Side-by-side harness of the GPU kernel tests: device mirrors of host weights (parts kept as
// separate allocations, so multi-part inputs are read in place), quantize / dequantize / QDQ
// on both the CUDA launchers and the CPU reference, and byte-for-byte comparisons.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/nvfp4.h"
#include "kernels/reference.h"

namespace wpub::kernels::cuda::testing {

// Device copy of a host WeightDesc: one device allocation per part, same shapes.
class DeviceWeight {
 public:
  // Uploads every part of `host` (blocking). Returns false when an allocation or copy fails.
  bool Init(const WeightDesc& host);
  // Re-uploads new contents for the same shapes (blocking), e.g. before a graph replay.
  bool Refill(const WeightDesc& host);
  const WeightDesc& desc() const { return desc_; }

 private:
  std::vector<DeviceBuffer> parts_;
  WeightDesc desc_;
};

// Output sizes of one quantized weight.
struct QuantSizes {
  int64_t packed = 0;
  int64_t scales = 0;
  int64_t swizzled = 0;
  int64_t slices = 0;
  static QuantSizes Of(const WeightDesc& w);
};

// Host results of quantizing one weight.
struct HostQuantized {
  std::vector<uint8_t> packed;
  std::vector<uint8_t> scales;
  std::vector<uint8_t> swizzled;
  std::vector<float> decode_scale;
};

// Device outputs of one weight, poisoned before use so unwritten bytes show.
struct DeviceQuantized {
  DeviceBuffer packed;
  DeviceBuffer scales;
  DeviceBuffer swizzled;  // empty when not requested
  DeviceBuffer decode_scale;
  bool Init(const WeightDesc& w, bool with_swizzled);
  QuantOutput Output() const;
  HostQuantized Download() const;
};

// CPU reference quantization of `w` with the given per-slice amax (nullptr: computed).
KernelStatus CpuQuantize(const WeightDesc& w, const float* amax, QuantMode mode, bool with_swizzled,
                         HostQuantized* out, std::string* error);

// "" when equal, else the first mismatch, prefixed by the output's name.
std::string CompareQuantized(const HostQuantized& got, const HostQuantized& want);

// Raw bits of float values (NaN == NaN when bits equal).
std::vector<uint32_t> FloatBitsOf(const std::vector<float>& v);

// CPU options that use every core (the reference is bit-identical for any thread count).
CpuOptions AllCores();

}  // namespace wpub::kernels::cuda::testing
