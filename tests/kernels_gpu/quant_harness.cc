// Side-by-side GPU/CPU harness of the GPU kernel tests (see header).
#include "tests/kernels_gpu/quant_harness.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "tests/kernels_gpu/gpu_test_util.h"

namespace wpub::kernels::cuda::testing {

namespace {

int64_t PartBytes(const WeightDesc& w, int p) {
  return w.num_slices * w.parts[p].rows * w.parts[p].cols * static_cast<int64_t>(ElemSize(w.type));
}

}  // namespace

bool DeviceWeight::Init(const WeightDesc& host) {
  desc_ = host;
  parts_.clear();
  for (int p = 0; p < host.num_parts; ++p) {
    DeviceBuffer buf;
    if (DeviceBuffer::Create(PartBytes(host, p), &buf) != cudaSuccess) return false;
    desc_.parts[p].data = buf.data();
    parts_.push_back(std::move(buf));
  }
  return Refill(host);
}

bool DeviceWeight::Refill(const WeightDesc& host) {
  for (int p = 0; p < host.num_parts; ++p) {
    if (cudaMemcpy(parts_[p].data(), host.parts[p].data, PartBytes(host, p),
                   cudaMemcpyHostToDevice) != cudaSuccess) {
      return false;
    }
  }
  // Pageable copies may still be in DMA when cudaMemcpy returns, and the tests launch on
  // non-blocking streams that do not wait for them.
  return cudaDeviceSynchronize() == cudaSuccess;
}

QuantSizes QuantSizes::Of(const WeightDesc& w) {
  QuantSizes s;
  const int64_t rows = w.rows();
  const int64_t kv = w.cols() / kBlockSize;
  s.slices = w.num_slices;
  s.packed = w.num_slices * rows * kv * 8;
  s.scales = w.num_slices * rows * kv;
  s.swizzled = w.num_slices * SwizzledScaleSize(rows, kv);
  return s;
}

bool DeviceQuantized::Init(const WeightDesc& w, bool with_swizzled) {
  const QuantSizes s = QuantSizes::Of(w);
  packed = Poisoned(s.packed);
  scales = Poisoned(s.scales);
  swizzled = with_swizzled ? Poisoned(s.swizzled) : DeviceBuffer();
  decode_scale = Poisoned(s.slices * sizeof(float));
  return !packed.empty() && !scales.empty() && !decode_scale.empty() &&
         (!with_swizzled || !swizzled.empty());
}

QuantOutput DeviceQuantized::Output() const {
  QuantOutput o;
  o.packed = packed.as<uint8_t>();
  o.scales = scales.as<uint8_t>();
  o.swizzled = swizzled.empty() ? nullptr : swizzled.as<uint8_t>();
  o.decode_scale = decode_scale.as<float>();
  return o;
}

HostQuantized DeviceQuantized::Download() const {
  HostQuantized h;
  h.packed = testing::Download<uint8_t>(packed.data(), packed.size());
  h.scales = testing::Download<uint8_t>(scales.data(), scales.size());
  if (!swizzled.empty()) h.swizzled = testing::Download<uint8_t>(swizzled.data(), swizzled.size());
  h.decode_scale = testing::Download<float>(decode_scale.data(), decode_scale.size() / 4);
  return h;
}

KernelStatus CpuQuantize(const WeightDesc& w, const float* amax, QuantMode mode, bool with_swizzled,
                         HostQuantized* out, std::string* error) {
  const QuantSizes s = QuantSizes::Of(w);
  out->packed.assign(s.packed, 0);
  out->scales.assign(s.scales, 0);
  out->swizzled.assign(with_swizzled ? s.swizzled : 0, 0);
  out->decode_scale.assign(s.slices, 0.0f);
  QuantOutput o;
  o.packed = out->packed.data();
  o.scales = out->scales.data();
  o.swizzled = with_swizzled ? out->swizzled.data() : nullptr;
  o.decode_scale = out->decode_scale.data();
  return Quantize(w, amax, mode, o, AllCores(), error);
}

std::vector<uint32_t> FloatBitsOf(const std::vector<float>& v) {
  std::vector<uint32_t> bits(v.size());
  if (!v.empty()) std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  return bits;
}

std::string CompareQuantized(const HostQuantized& got, const HostQuantized& want) {
  std::string m = FirstMismatch(got.packed, want.packed);
  if (!m.empty()) return "packed codes: " + m;
  m = FirstMismatch(got.scales, want.scales);
  if (!m.empty()) return "block scales: " + m;
  m = FirstMismatch(got.swizzled, want.swizzled);
  if (!m.empty()) return "swizzled scales: " + m;
  m = FirstMismatch(FloatBitsOf(got.decode_scale), FloatBitsOf(want.decode_scale));
  if (!m.empty()) return "decode scale: " + m;
  return "";
}

CpuOptions AllCores() {
  CpuOptions o;
  o.num_threads = 0;
  return o;
}

}  // namespace wpub::kernels::cuda::testing
