// The CPU conversion path: the NVFP4 reference kernels (kernels/reference.h) read the mapped
// input in place; kept tensors are written straight from the mapping.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/convert/plan.h"
#include "kernels/reference.h"

namespace wpub::convert {
namespace {

// Kept tensors are written in pieces so progress moves and no single write is huge.
constexpr uint64_t kCopyChunkBytes = uint64_t{64} << 20;

class CpuExecutor final : public Executor {
 public:
  explicit CpuExecutor(const ConvertOptions& options)
      : mode_(options.mode), cpu_{options.cpu_threads} {}

  absl::Status Run(const safetensors::Checkpoint& ckpt, const ConvertPlan& plan,
                   const std::vector<safetensors::Writer*>& writers,
                   const std::function<void(size_t)>& on_unit_done, int64_t* nonfinite) override {
    for (size_t i = 0; i < plan.units.size(); ++i) {
      const Unit& unit = plan.units[i];
      if (i + 1 < plan.units.size()) {
        // Let the kernel read the next unit while this one is quantized.
        const Unit& next = plan.units[i + 1];
        for (const UnitMember& m : next.members) ckpt.readers()[m.shard]->Prefetch(*m.info);
      }
      if (unit.quantize) {
        WPUB_RETURN_IF_ERROR(Quantize(ckpt, unit, writers, nonfinite));
      } else {
        WPUB_RETURN_IF_ERROR(Copy(ckpt, unit, writers));
      }
      on_unit_done(i);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Copy(const safetensors::Checkpoint& ckpt, const Unit& unit,
                    const std::vector<safetensors::Writer*>& writers) {
    const UnitMember& m = unit.members[0];
    absl::Span<const uint8_t> data = ckpt.readers()[m.shard]->Data(*m.info);
    for (uint64_t off = 0; off < data.size(); off += kCopyChunkBytes) {
      const uint64_t n = std::min<uint64_t>(kCopyChunkBytes, data.size() - off);
      WPUB_RETURN_IF_ERROR(writers[m.shard]->Write(m.out_index, off, data.subspan(off, n)));
    }
    return absl::OkStatus();
  }

  absl::Status Quantize(const safetensors::Checkpoint& ckpt, const Unit& unit,
                        const std::vector<safetensors::Writer*>& writers, int64_t* nonfinite) {
    const int64_t slices = unit.slice_end - unit.slice_begin;
    std::vector<kernels::WeightDesc> weights;
    for (size_t m = 0; m < unit.members.size(); ++m) {
      const UnitMember& u = unit.members[m];
      weights.push_back(
          kernels::WeightDesc::Stack(unit.input(ckpt, m), slices, u.rows, u.cols, u.type));
    }
    std::vector<float> amax(slices);
    std::vector<int64_t> bad(slices);
    std::string error;
    kernels::KernelStatus ks =
        weights.size() == 2
            ? kernels::ComputePairAmax(weights[0], weights[1], amax.data(), bad.data(), cpu_,
                                       &error)
            : kernels::ComputeAmax(weights[0], amax.data(), bad.data(), cpu_, &error);
    if (ks != kernels::KernelStatus::kOk) return KernelError(unit, error);
    for (int64_t b : bad) *nonfinite += b;

    std::vector<std::vector<uint8_t>> packed(weights.size()), scales(weights.size());
    std::vector<std::vector<float>> scale2(weights.size());
    std::vector<kernels::QuantizeTask> tasks(weights.size());
    for (size_t m = 0; m < weights.size(); ++m) {
      const QuantSizes size = QuantizedSizes(unit.members[m], slices);
      packed[m].resize(size.packed);
      scales[m].resize(size.scales);
      scale2[m].resize(slices);
      tasks[m].weight = &weights[m];
      tasks[m].amax = amax.data();
      tasks[m].out.packed = packed[m].data();
      tasks[m].out.scales = scales[m].data();
      tasks[m].out.decode_scale = scale2[m].data();
    }
    ks = kernels::Quantize(tasks, mode_, cpu_, &error);
    if (ks != kernels::KernelStatus::kOk) return KernelError(unit, error);
    for (size_t m = 0; m < weights.size(); ++m) {
      WPUB_RETURN_IF_ERROR(
          WriteQuantized(unit, m, packed[m].data(), scales[m].data(), scale2[m].data(), writers));
    }
    return absl::OkStatus();
  }

  static absl::Status KernelError(const Unit& unit, const std::string& error) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", unit.members[0].info->name, "': ", error));
  }

  kernels::QuantMode mode_;
  kernels::CpuOptions cpu_;
};

}  // namespace

std::unique_ptr<Executor> CreateCpuExecutor(const ConvertOptions& options) {
  return std::make_unique<CpuExecutor>(options);
}

}  // namespace wpub::convert
