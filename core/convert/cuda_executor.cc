// The CUDA conversion path. Quantized units are grouped into batches of up to staging_bytes of
// input; two slots (pinned input, device input, device output, pinned output, stream, event)
// alternate, so while the GPU copies and quantizes batch n the host writes the results of batch
// n-1 and reads batch n+1 from the mapped shards. Kept tensors never visit the GPU: they are
// written from the mapping by the host between batches. Amax, global scales and quantization
// run on the device through the kernels/cuda launchers (bit-identical to the CPU reference).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/parallel_for.h"
#include "core/common/status.h"
#include "core/convert/plan.h"
#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::convert {
namespace {

namespace kc = kernels::cuda;

#define WPUB_CONVERT_CUDA(expr)                                                                  \
  do {                                                                                           \
    const cudaError_t wpub_cuda_err_ = (expr);                                                   \
    if (wpub_cuda_err_ != cudaSuccess) {                                                         \
      return absl::InternalError(absl::StrCat(#expr, " failed at " __FILE__ ":", __LINE__, ": ", \
                                              cudaGetErrorString(wpub_cuda_err_)));              \
    }                                                                                            \
  } while (0)

constexpr uint64_t kAlign = 256;
constexpr uint64_t kCopyChunkBytes = uint64_t{64} << 20;
constexpr uint64_t kReadPieceBytes = uint64_t{8} << 20;

uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where one member's pieces sit inside a slot's buffers.
struct MemberLayout {
  uint64_t in = 0;
  uint64_t packed = 0;
  uint64_t scales = 0;
  uint64_t scale2 = 0;
};

struct Batch {
  std::vector<size_t> units;                  // indices into plan.units
  std::vector<std::vector<MemberLayout>> at;  // per unit, per member
  std::vector<uint64_t> amax_slot;            // per unit: first amax slot
  uint64_t in_bytes = 0;
  uint64_t out_bytes = 0;
  uint64_t num_slots = 0;
};

struct Slot {
  kc::PinnedHostBuffer host_in, host_out, host_nonfinite;
  kc::DeviceBuffer dev_in, dev_out, dev_amax, dev_nonfinite;
  kc::Stream stream;
  kc::Event done;
  Batch batch;
  bool busy = false;
};

class CudaExecutor final : public Executor {
 public:
  explicit CudaExecutor(const ConvertOptions& options)
      : options_(options),
        io_threads_(options.cpu_threads > 0
                        ? options.cpu_threads
                        : static_cast<int>(
                              std::min(8u, std::max(1u, std::thread::hardware_concurrency())))) {}

  absl::Status Run(const safetensors::Checkpoint& ckpt, const ConvertPlan& plan,
                   const std::vector<safetensors::Writer*>& writers,
                   const std::function<void(size_t)>& on_unit_done, int64_t* nonfinite) override {
    // Capacity: the configured staging size, or the largest unit when one is bigger.
    uint64_t in_cap = options_.staging_bytes;
    for (const Unit& u : plan.units) {
      if (u.quantize) in_cap = std::max({in_cap, Layout(u).first, Layout(u).second});
    }
    const uint64_t max_slots_per_batch = 1 << 16;
    for (Slot& s : slots_) {
      WPUB_CONVERT_CUDA(kc::PinnedHostBuffer::Create(in_cap, &s.host_in));
      WPUB_CONVERT_CUDA(kc::PinnedHostBuffer::Create(in_cap, &s.host_out));
      WPUB_CONVERT_CUDA(kc::DeviceBuffer::Create(in_cap, &s.dev_in));
      WPUB_CONVERT_CUDA(kc::DeviceBuffer::Create(in_cap, &s.dev_out));
      WPUB_CONVERT_CUDA(kc::DeviceBuffer::Create(max_slots_per_batch * 4, &s.dev_amax));
      WPUB_CONVERT_CUDA(kc::DeviceBuffer::Create(max_slots_per_batch * 8, &s.dev_nonfinite));
      WPUB_CONVERT_CUDA(kc::PinnedHostBuffer::Create(max_slots_per_batch * 8, &s.host_nonfinite));
      WPUB_CONVERT_CUDA(kc::Stream::Create(&s.stream));
      WPUB_CONVERT_CUDA(kc::Event::Create(/*timing=*/false, &s.done));
    }

    Batch batch;
    int next_slot = 0;
    auto flush = [&]() -> absl::Status {
      if (batch.units.empty()) return absl::OkStatus();
      Slot& slot = slots_[next_slot];
      next_slot ^= 1;
      WPUB_RETURN_IF_ERROR(Complete(slot, ckpt, plan, writers, on_unit_done, nonfinite));
      WPUB_RETURN_IF_ERROR(Submit(slot, std::move(batch), ckpt, plan));
      batch = Batch();
      return absl::OkStatus();
    };
    for (size_t i = 0; i < plan.units.size(); ++i) {
      const Unit& unit = plan.units[i];
      if (!unit.quantize) {
        WPUB_RETURN_IF_ERROR(Copy(ckpt, unit, writers));
        on_unit_done(i);
        continue;
      }
      const auto [in_bytes, out_bytes] = Layout(unit);
      const uint64_t slices = static_cast<uint64_t>(unit.slice_end - unit.slice_begin);
      if (!batch.units.empty() &&
          (batch.in_bytes + in_bytes > in_cap || batch.out_bytes + out_bytes > in_cap ||
           batch.num_slots + slices > max_slots_per_batch)) {
        WPUB_RETURN_IF_ERROR(flush());
      }
      std::vector<MemberLayout> at;
      for (size_t m = 0; m < unit.members.size(); ++m) {
        const QuantSizes q = QuantizedSizes(unit.members[m], unit.slice_end - unit.slice_begin);
        MemberLayout l;
        l.in = batch.in_bytes;
        batch.in_bytes += AlignUp(unit.member_input_bytes(m));
        l.packed = batch.out_bytes;
        l.scales = l.packed + AlignUp(q.packed);
        l.scale2 = l.scales + AlignUp(q.scales);
        batch.out_bytes = l.scale2 + AlignUp(q.scale2);
        at.push_back(l);
      }
      batch.units.push_back(i);
      batch.at.push_back(std::move(at));
      batch.amax_slot.push_back(batch.num_slots);
      batch.num_slots += slices;
    }
    WPUB_RETURN_IF_ERROR(flush());
    for (int k = 0; k < 2; ++k) {
      Slot& slot = slots_[next_slot];
      next_slot ^= 1;
      WPUB_RETURN_IF_ERROR(Complete(slot, ckpt, plan, writers, on_unit_done, nonfinite));
    }
    return absl::OkStatus();
  }

 private:
  // (input bytes, output bytes) a unit takes in a slot, alignment included.
  static std::pair<uint64_t, uint64_t> Layout(const Unit& unit) {
    uint64_t in = 0, out = 0;
    for (size_t m = 0; m < unit.members.size(); ++m) {
      const QuantSizes q = QuantizedSizes(unit.members[m], unit.slice_end - unit.slice_begin);
      in += AlignUp(unit.member_input_bytes(m));
      out += AlignUp(q.packed) + AlignUp(q.scales) + AlignUp(q.scale2);
    }
    return {in, out};
  }

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

  // Reads the batch into the slot's pinned buffer and enqueues copy, amax, quantize and the copy
  // back; returns without waiting for the device.
  absl::Status Submit(Slot& slot, Batch batch, const safetensors::Checkpoint& ckpt,
                      const ConvertPlan& plan) {
    std::vector<kernels::WeightDesc> weights;
    std::vector<int64_t> slot_offsets;
    std::vector<kc::QuantizeJob> jobs;
    struct Transfer {
      uint8_t* dst;
      const uint8_t* src;
      uint64_t n;
    };
    std::vector<Transfer> copies;
    uint8_t* host_in = slot.host_in.as<uint8_t>();
    uint8_t* dev_in = slot.dev_in.as<uint8_t>();
    uint8_t* dev_out = slot.dev_out.as<uint8_t>();
    float* amax = slot.dev_amax.as<float>();
    for (size_t b = 0; b < batch.units.size(); ++b) {
      const Unit& unit = plan.units[batch.units[b]];
      const int64_t slices = unit.slice_end - unit.slice_begin;
      for (size_t m = 0; m < unit.members.size(); ++m) {
        const UnitMember& u = unit.members[m];
        const MemberLayout& l = batch.at[b][m];
        copies.push_back({host_in + l.in, unit.input(ckpt, m), unit.member_input_bytes(m)});
        weights.push_back(
            kernels::WeightDesc::Stack(dev_in + l.in, slices, u.rows, u.cols, u.type));
        slot_offsets.push_back(static_cast<int64_t>(batch.amax_slot[b]));
        kc::QuantizeJob job;
        job.weight = weights.back();
        job.out.packed = dev_out + l.packed;
        job.out.scales = dev_out + l.scales;
        job.out.decode_scale = reinterpret_cast<float*>(dev_out + l.scale2);
        job.amax = amax + batch.amax_slot[b];
        jobs.push_back(job);
      }
    }
    // The host read of the input into pinned memory: page faults on the mapping pull it from the
    // page cache or disk, in pieces spread over the I/O threads.
    struct Piece {
      uint8_t* dst;
      const uint8_t* src;
      uint64_t n;
    };
    std::vector<Piece> pieces;
    for (const Transfer& c : copies) {
      for (uint64_t off = 0; off < c.n; off += kReadPieceBytes) {
        pieces.push_back({c.dst + off, c.src + off, std::min(kReadPieceBytes, c.n - off)});
      }
    }
    WPUB_RETURN_IF_ERROR(ParallelForStatus(pieces.size(), io_threads_, [&](size_t i) {
      std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].n);
      return absl::OkStatus();
    }));
    cudaStream_t stream = slot.stream.get();
    WPUB_CONVERT_CUDA(
        cudaMemcpyAsync(dev_in, host_in, batch.in_bytes, cudaMemcpyHostToDevice, stream));
    std::string message;
    kernels::KernelStatus ks =
        kc::LaunchAmax(weights.data(), static_cast<int>(weights.size()), slot_offsets.data(),
                       static_cast<int64_t>(batch.num_slots), amax,
                       slot.dev_nonfinite.as<int64_t>(), stream, &message);
    if (ks != kernels::KernelStatus::kOk) {
      return absl::InternalError(absl::StrCat("amax launch failed: ", message));
    }
    ks = kc::LaunchQuantize(jobs.data(), static_cast<int>(jobs.size()), options_.mode, stream,
                            &message);
    if (ks != kernels::KernelStatus::kOk) {
      return absl::InternalError(absl::StrCat("quantize launch failed: ", message));
    }
    WPUB_CONVERT_CUDA(cudaMemcpyAsync(slot.host_out.data(), dev_out, batch.out_bytes,
                                      cudaMemcpyDeviceToHost, stream));
    WPUB_CONVERT_CUDA(cudaMemcpyAsync(slot.host_nonfinite.data(), slot.dev_nonfinite.data(),
                                      batch.num_slots * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                      stream));
    WPUB_CONVERT_CUDA(slot.done.Record(stream));
    // Start the kernel's read-ahead of what follows this batch.
    const size_t last = batch.units.back();
    for (size_t k = last + 1; k < plan.units.size() && k < last + 64; ++k) {
      for (const UnitMember& m : plan.units[k].members) ckpt.readers()[m.shard]->Prefetch(*m.info);
    }
    slot.batch = std::move(batch);
    slot.busy = true;
    return absl::OkStatus();
  }

  // Waits for the slot's batch (if any) and writes its results.
  absl::Status Complete(Slot& slot, const safetensors::Checkpoint& ckpt, const ConvertPlan& plan,
                        const std::vector<safetensors::Writer*>& writers,
                        const std::function<void(size_t)>& on_unit_done, int64_t* nonfinite) {
    (void)ckpt;
    if (!slot.busy) return absl::OkStatus();
    slot.busy = false;
    WPUB_CONVERT_CUDA(slot.done.Synchronize());
    const uint8_t* out = slot.host_out.as<uint8_t>();
    const int64_t* bad = slot.host_nonfinite.as<int64_t>();
    for (uint64_t s = 0; s < slot.batch.num_slots; ++s) *nonfinite += bad[s];
    std::vector<std::pair<size_t, size_t>> items;  // (batch unit, member)
    for (size_t b = 0; b < slot.batch.units.size(); ++b) {
      for (size_t m = 0; m < plan.units[slot.batch.units[b]].members.size(); ++m) {
        items.emplace_back(b, m);
      }
    }
    WPUB_RETURN_IF_ERROR(ParallelForStatus(items.size(), io_threads_, [&](size_t i) {
      const auto [b, m] = items[i];
      const MemberLayout& l = slot.batch.at[b][m];
      return WriteQuantized(plan.units[slot.batch.units[b]], m, out + l.packed, out + l.scales,
                            reinterpret_cast<const float*>(out + l.scale2), writers);
    }));
    for (size_t b = 0; b < slot.batch.units.size(); ++b) on_unit_done(slot.batch.units[b]);
    return absl::OkStatus();
  }

  ConvertOptions options_;
  int io_threads_;
  Slot slots_[2];
};

}  // namespace

absl::StatusOr<std::unique_ptr<Executor>> CreateCudaExecutor(const ConvertOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda: no usable CUDA device (",
                     err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0", ")"));
  }
  return std::unique_ptr<Executor>(new CudaExecutor(options));
}

}  // namespace wpub::convert
