// GPU backend: resolve inputs (device in place, host through pinned staging), plan amax slots
// and the status block, then per bucket enqueue amax/quantize/pack/checksum on the compute
// stream into a double-buffered staging area and hand the bucket to the sink. The host waits
// only through HostSyncs (see gpu_backend.h for the count).
#include "core/gpu/gpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/checksum.h"
#include "core/engine/planner.h"
#include "core/engine/weight_pieces.h"
#include "core/gpu/backend_parts.h"
#include "core/gpu/host_syncs.h"
#include "core/gpu/sm_partition.h"
#include "core/gpu/status_kernels.h"
#include "core/gpu/streams.h"
#include "kernels/cuda/nvfp4_cuda.h"

namespace wpub::gpu {
namespace {

using detail::Aligned;
using detail::AlignUp;
using detail::FloatKindOf;
using detail::GrowBuffer;
using detail::kAlign;
using detail::KernelError;
using engine::BucketLayout;
using engine::ExecutionPlan;
using engine::InputTensor;
using engine::OutputKind;
using engine::PartView;
using engine::PlacedTensor;

// Per-input tables of one publication, flat (one entry per part and per weight piece, found
// through per-input offsets) and kept by the backend between publications: a publication of
// tens of thousands of tensors then allocates (and page-faults) nothing for them once warm.
// Weight pieces (~420 bytes each, one per expert) are built when a bucket first needs them, so
// that building them overlaps the device work of earlier buckets instead of delaying the first
// launch; every quantized input is checked up front (engine::CheckWeightPieces), so building one
// later cannot fail on bad input.
struct InputTables {
  static constexpr uint32_t kNotBuilt = UINT32_MAX;
  std::vector<uint32_t> part_begin;      // [input] -> its first part entry; inputs + 1 entries
  std::vector<const uint8_t*> part_ptr;  // where the kernels read each part (device memory)
  std::vector<char> part_staged;         // 1: a host part, staged through pinned memory
  std::vector<uint32_t> piece_begin;     // [input] -> its first piece, kNotBuilt until built
  std::vector<uint32_t> piece_end;       // [input] -> one past its last piece
  std::vector<engine::WeightPiece> pieces;

  std::span<const uint8_t* const> parts(size_t input) const {
    return {part_ptr.data() + part_begin[input], part_begin[input + 1] - part_begin[input]};
  }
  // The pieces of a quantized input, built on first use. The span stays valid until the next
  // call (building may grow `pieces`).
  absl::StatusOr<std::span<const engine::WeightPiece>> pieces_of(
      const std::vector<InputTensor>& inputs, size_t input) {
    if (piece_begin[input] == kNotBuilt) {
      const auto first = static_cast<uint32_t>(pieces.size());
      absl::Status st = engine::AppendWeightPieces(inputs[input], parts(input), &pieces);
      if (!st.ok()) return absl::InternalError(absl::StrCat("after its check: ", st.message()));
      piece_begin[input] = first;
      piece_end[input] = static_cast<uint32_t>(pieces.size());
    }
    return std::span<const engine::WeightPiece>(pieces.data() + piece_begin[input],
                                                piece_end[input] - piece_begin[input]);
  }
};

// Where one quantized input's three outputs sit in a bucket.
struct QuantSlot {
  size_t input = 0;
  int group = -1;
  uint64_t packed = 0, scales = 0, decode = 0;
};

}  // namespace

class GpuBackend::Impl {
 public:
  GpuBackendOptions options;
  cudaStream_t compute = nullptr;
  std::unique_ptr<PartitionedStream> partition;  // owns `compute` when compute_sms is set
  cudaEvent_t ready[2] = {nullptr, nullptr};
  cudaEvent_t done[2] = {nullptr, nullptr};
  cudaEvent_t status_ready = nullptr;  // non-finite counts copied (amax-first mode)
  cudaEvent_t finished = nullptr;
  cudaEvent_t t_begin = nullptr, t_amax = nullptr, t_packed = nullptr, t_end = nullptr;
  cudaEvent_t bounce_ready = nullptr;
  GrowBuffer staging[2], scratch, amax, status, arena;
  GrowBuffer status_host{nullptr, 0, true}, host_stage{nullptr, 0, true}, bounce{nullptr, 0, true};
  bool dirty = false;  // device work of a failed Execute may still run
  InputTables tables;  // rebuilt by every Execute, capacity kept

  ~Impl() {
    if (compute != nullptr) cudaStreamSynchronize(compute);
    HostSyncs uncounted(nullptr);
    for (GrowBuffer* b : {&staging[0], &staging[1], &scratch, &amax, &status, &arena, &status_host,
                          &host_stage, &bounce}) {
      (void)b->Release(uncounted);
    }
    for (cudaEvent_t e : {ready[0], ready[1], done[0], done[1], status_ready, finished, t_begin,
                          t_amax, t_packed, t_end, bounce_ready}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (compute != nullptr && !partition) cudaStreamDestroy(compute);
  }

  absl::StatusOr<engine::ExecutionResult> Execute(const ExecutionPlan& plan,
                                                  const engine::ExecutionHooks& hooks,
                                                  std::vector<uint64_t>* checksums,
                                                  GpuTiming* timing);
};

absl::StatusOr<std::unique_ptr<GpuBackend>> GpuBackend::Create(const GpuBackendOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || options.device < 0 || options.device >= count) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("GPU backend: CUDA device ", options.device,
                                                      " is not present (", count, " visible)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  if (options.compute_sms > 0) {
    int priority = 0;
    WPUB_CUDA_RETURN_IF_ERROR(StreamPriority(StreamRole::kCompute, &priority));
    WPUB_ASSIGN_OR_RETURN(impl->partition,
                          PartitionedStream::Create(options.device, options.compute_sms, priority));
    impl->compute = impl->partition->stream();
  } else {
    WPUB_CUDA_RETURN_IF_ERROR(CreateStream(StreamRole::kCompute, &impl->compute));
  }
  for (cudaEvent_t* e : {&impl->ready[0], &impl->ready[1], &impl->done[0], &impl->done[1],
                         &impl->status_ready, &impl->finished, &impl->bounce_ready}) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  for (cudaEvent_t* e : {&impl->t_begin, &impl->t_amax, &impl->t_packed, &impl->t_end}) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventCreate(e));
  }
  return std::unique_ptr<GpuBackend>(new GpuBackend(std::move(impl)));
}

GpuBackend::GpuBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuBackend::~GpuBackend() = default;
cudaStream_t GpuBackend::compute_stream() const { return impl_->compute; }

absl::StatusOr<engine::ExecutionResult> GpuBackend::Execute(const ExecutionPlan& plan,
                                                            const engine::ExecutionHooks& hooks) {
  last_checksums_.clear();
  last_timing_ = GpuTiming();
  std::vector<uint64_t> sums;
  GpuTiming timing;
  absl::StatusOr<engine::ExecutionResult> r = impl_->Execute(plan, hooks, &sums, &timing);
  if (r.ok()) {
    last_checksums_ = std::move(sums);
    last_timing_ = timing;
  }
  return r;
}

absl::StatusOr<engine::ExecutionResult> GpuBackend::Impl::Execute(
    const ExecutionPlan& plan, const engine::ExecutionHooks& hooks,
    std::vector<uint64_t>* checksums, GpuTiming* timing) {
  HostSyncs syncs(hooks.syncs);
  using HostClock = std::chrono::steady_clock;
  const auto seconds_since = [](HostClock::time_point t0) {
    return std::chrono::duration<double>(HostClock::now() - t0).count();
  };
  const HostClock::time_point host_t0 = HostClock::now();
  const cudaStream_t s = compute;
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  if (dirty) {
    WPUB_RETURN_IF_ERROR(syncs.StreamSynchronize(s, "drain the previous failed publication"));
    dirty = false;
  }
  const std::vector<InputTensor>& inputs = *plan.inputs;
  const size_t num_buckets = plan.buckets.size();

  // 1. Resolve every used part to a device pointer; host parts go through pinned staging.
  std::vector<char> used(inputs.size(), 0);
  for (const auto& src : plan.sources) used[src.input] = 1;
  InputTables& tab = tables;
  tab.part_begin.resize(inputs.size() + 1);
  tab.part_ptr.clear();
  for (size_t i = 0; i < inputs.size(); ++i) {
    tab.part_begin[i] = static_cast<uint32_t>(tab.part_ptr.size());
    for (const PartView& part : inputs[i].parts) tab.part_ptr.push_back(part.data);
  }
  tab.part_begin[inputs.size()] = static_cast<uint32_t>(tab.part_ptr.size());
  tab.part_staged.assign(tab.part_ptr.size(), 0);
  auto part_ptr = [&](size_t i, size_t p) -> const uint8_t*& {
    return tab.part_ptr[tab.part_begin[i] + p];
  };
  struct HostPart {
    size_t input, part;
    uint64_t offset;
  };
  std::vector<HostPart> host_parts;
  uint64_t host_bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!used[i]) continue;
    for (size_t p = 0; p < inputs[i].parts.size(); ++p) {
      const PartView& part = inputs[i].parts[p];
      if (part.nbytes == 0) continue;
      // Ingestion knows where its parts live (CUDA IPC mappings are on this device, checked by
      // the IPC cache); only parts of unknown origin cost a pointer query.
      if (part.memory == engine::PartMemory::kDevice) continue;
      cudaPointerAttributes a{};
      if (part.memory == engine::PartMemory::kUnknown &&
          cudaPointerGetAttributes(&a, part.data) != cudaSuccess) {
        (void)cudaGetLastError();
      }
      if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
        if (a.type == cudaMemoryTypeDevice && a.device != options.device) {
          return absl::FailedPreconditionError(
              absl::StrCat("tensor ", inputs[i].desc.name, " part ", p, " is on CUDA device ",
                           a.device, "; the GPU backend runs on device ", options.device));
        }
        continue;
      }
      const uint64_t off = AlignUp(host_bytes, kAlign);
      host_parts.push_back({i, p, off});
      tab.part_staged[tab.part_begin[i] + p] = 1;
      host_bytes = off + part.nbytes;
    }
  }
  // Quantized inputs must be 16-byte aligned for the kernels: a misaligned device part (a
  // view at an odd offset) is relocated into the arena with one device copy.
  std::vector<char> quantized(inputs.size(), 0);
  for (const auto& g : plan.amax_groups) {
    for (size_t m : g.members) quantized[m] = 1;
  }
  struct Relocation {
    size_t input, part;
    uint64_t offset;
  };
  std::vector<Relocation> relocations;
  uint64_t arena_bytes = host_bytes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!used[i] || !quantized[i]) continue;
    for (size_t p = 0; p < inputs[i].parts.size(); ++p) {
      if (tab.part_staged[tab.part_begin[i] + p] || Aligned(part_ptr(i, p), 16) ||
          inputs[i].parts[p].nbytes == 0) {
        continue;
      }
      const uint64_t off = AlignUp(arena_bytes, kAlign);
      relocations.push_back({i, p, off});
      arena_bytes = off + inputs[i].parts[p].nbytes;
    }
  }
  if (host_bytes > 0) {
    WPUB_RETURN_IF_ERROR(host_stage.Ensure(host_bytes, syncs, "pinned staging of host inputs"));
  }
  if (arena_bytes > 0) {
    WPUB_RETURN_IF_ERROR(arena.Ensure(arena_bytes, syncs, "device arena of host inputs"));
  }
  if (host_bytes > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const HostPart& h : host_parts) {
      const PartView& part = inputs[h.input].parts[h.part];
      std::memcpy(host_stage.bytes() + h.offset, part.data, part.nbytes);
      part_ptr(h.input, h.part) = arena.bytes() + h.offset;
    }
    timing->host_staging_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::vector<std::pair<const uint8_t*, const Relocation*>> relocate_from;
  for (const Relocation& r : relocations) {
    relocate_from.push_back({part_ptr(r.input, r.part), &r});
    part_ptr(r.input, r.part) = arena.bytes() + r.offset;
  }

  // 2. Quantized inputs checked (their pieces are built per bucket, InputTables), amax slots per
  //    bucket (a group's slots are assigned in the bucket that first needs them), passthrough
  //    count slots, status block layout.
  tab.piece_begin.assign(inputs.size(), InputTables::kNotBuilt);
  tab.piece_end.assign(inputs.size(), 0);
  tab.pieces.clear();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (quantized[i]) {
      WPUB_RETURN_IF_ERROR(engine::CheckWeightPieces(inputs[i], tab.parts(i).size()));
    }
  }
  std::vector<int64_t> group_base(plan.amax_groups.size(), -1);
  std::vector<std::vector<int>> bucket_groups(num_buckets);
  std::vector<int64_t> bucket_slot_begin(num_buckets + 1, 0);
  std::vector<uint32_t> pass_slot(plan.outputs.size(), UINT32_MAX);
  std::vector<size_t> pass_outputs;  // pass slot -> output index
  int64_t next_slot = 0;
  for (size_t b = 0; b < num_buckets; ++b) {
    bucket_slot_begin[b] = next_slot;
    for (const PlacedTensor& t : plan.buckets[b].tensors) {
      const auto& src = plan.sources[t.output];
      if (src.kind == OutputKind::kPassthrough) {
        FloatKind k;
        if (FloatKindOf(plan.outputs[t.output].dtype, &k)) {
          pass_slot[t.output] = static_cast<uint32_t>(pass_outputs.size());
          pass_outputs.push_back(t.output);
        }
        continue;
      }
      const int g = src.amax_group;
      if (g < 0 || static_cast<size_t>(g) >= plan.amax_groups.size()) {
        return absl::InternalError(
            absl::StrCat("output ", plan.outputs[t.output].name, " has no amax group"));
      }
      if (group_base[g] < 0) {
        group_base[g] = next_slot;
        next_slot += plan.amax_groups[g].slices;
        bucket_groups[b].push_back(g);
      }
    }
  }
  bucket_slot_begin[num_buckets] = next_slot;
  const uint64_t num_slots = static_cast<uint64_t>(next_slot);
  // Status block: int64 non-finite per amax slot | uint64 per passthrough float output |
  // uint64 checksum sum per bucket.
  const uint64_t nf_bytes = 8 * (num_slots + pass_outputs.size());
  const uint64_t status_bytes = nf_bytes + 8 * num_buckets;
  uint64_t max_bucket = 0;
  for (const BucketLayout& b : plan.buckets) max_bucket = std::max(max_bucket, b.nbytes);
  WPUB_RETURN_IF_ERROR(status.Ensure(std::max<uint64_t>(status_bytes, 8), syncs, "status block"));
  WPUB_RETURN_IF_ERROR(
      status_host.Ensure(std::max<uint64_t>(status_bytes, 8), syncs, "status readback"));
  WPUB_RETURN_IF_ERROR(amax.Ensure(std::max<uint64_t>(4 * num_slots, 4), syncs, "amax slots"));
  for (GrowBuffer& st : staging) {
    WPUB_RETURN_IF_ERROR(st.Ensure(max_bucket + kAlign, syncs, "bucket staging"));
  }
  if (options.sink == nullptr || hooks.host_buckets_needed) {
    WPUB_RETURN_IF_ERROR(bounce.Ensure(max_bucket + 8, syncs, "host bucket bounce buffer"));
  }
  auto* nf_slots = reinterpret_cast<int64_t*>(status.bytes());
  auto* nf_pass = reinterpret_cast<unsigned long long*>(status.bytes() + 8 * num_slots);
  auto* sum_dev = reinterpret_cast<unsigned long long*>(status.bytes() + nf_bytes);
  auto* amax_dev = static_cast<float*>(amax.ptr);

  // From here on device work is in flight: a failure leaves it to drain at the next Execute.
  dirty = true;
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(t_begin, s));
  if (host_bytes > 0) {
    WPUB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(arena.ptr, host_stage.ptr, host_bytes, cudaMemcpyHostToDevice, s));
  }
  for (const auto& [from, r] : relocate_from) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena.bytes() + r->offset, from,
                                              inputs[r->input].parts[r->part].nbytes,
                                              cudaMemcpyDeviceToDevice, s));
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(status.ptr, 0, status_bytes, s));

  const bool amax_first = options.reject_before_send && !plan.allow_non_finite;
  // Kernels that run beside a broadcast take the occupancy cap. The amax-first pass and the
  // first bucket run before any broadcast (the first bucket's broadcast waits for them), so they
  // take the whole GPU.
  kernels::cuda::LaunchLimits capped;
  if (options.sink != nullptr) capped.max_ctas_per_sm = options.overlap_ctas_per_sm;
  const auto limits_of = [&](size_t b) { return b == 0 ? kernels::cuda::LaunchLimits{} : capped; };
  // Amax of the groups first needed by bucket b, and non-finite counts of its passed floats.
  auto enqueue_checks = [&](size_t b) -> absl::Status {
    std::vector<kernels::WeightDesc> ws;
    std::vector<int64_t> offs;
    for (int g : bucket_groups[b]) {
      for (size_t m : plan.amax_groups[g].members) {
        WPUB_ASSIGN_OR_RETURN(const std::span<const engine::WeightPiece> pieces,
                              tab.pieces_of(inputs, m));
        for (const engine::WeightPiece& p : pieces) {
          ws.push_back(p.weight);
          offs.push_back(group_base[g] - bucket_slot_begin[b] + p.slice_offset);
        }
      }
    }
    const int64_t n_slots = bucket_slot_begin[b + 1] - bucket_slot_begin[b];
    if (!ws.empty()) {
      std::string msg;
      const kernels::KernelStatus st = kernels::cuda::LaunchAmax(
          ws.data(), static_cast<int>(ws.size()), offs.data(), n_slots,
          amax_dev + bucket_slot_begin[b], nf_slots + bucket_slot_begin[b], s, &msg,
          amax_first ? kernels::cuda::LaunchLimits{} : limits_of(b));
      if (st != kernels::KernelStatus::kOk) {
        return KernelError(st, absl::StrCat("amax of bucket ", b), msg);
      }
    }
    std::vector<CountItem> items;
    for (const PlacedTensor& t : plan.buckets[b].tensors) {
      if (pass_slot[t.output] == UINT32_MAX) continue;
      const auto& in = inputs[plan.sources[t.output].input];
      CountItem item;
      FloatKindOf(in.desc.dtype, &item.kind);
      item.slot = pass_slot[t.output];
      for (size_t p = 0; p < in.parts.size(); ++p) {
        item.data = part_ptr(plan.sources[t.output].input, p);
        item.bytes = in.parts[p].nbytes;
        if (item.bytes) items.push_back(item);
      }
    }
    if (!items.empty()) {
      WPUB_CUDA_RETURN_IF_ERROR(
          LaunchCountNonFinite(items.data(), static_cast<int>(items.size()), nf_pass, s));
    }
    return absl::OkStatus();
  };

  // Names the tensors behind non-zero counts; OK when none (or when allowed).
  auto check_non_finite = [&](const uint8_t* host_status, uint64_t* total) -> absl::Status {
    const auto* slots = reinterpret_cast<const int64_t*>(host_status);
    const auto* pass = reinterpret_cast<const uint64_t*>(host_status + 8 * num_slots);
    *total = 0;
    std::string first;
    for (size_t g = 0; g < plan.amax_groups.size(); ++g) {
      if (group_base[g] < 0) continue;
      uint64_t n = 0;
      for (int64_t k = 0; k < plan.amax_groups[g].slices; ++k) {
        n += static_cast<uint64_t>(slots[group_base[g] + k]);
      }
      if (n && first.empty()) {
        first = inputs[plan.amax_groups[g].members[0]].desc.name;
        if (plan.amax_groups[g].members.size() > 1) {
          first +=
              absl::StrCat(" (or its pair ", inputs[plan.amax_groups[g].members[1]].desc.name, ")");
        }
      }
      *total += n;
    }
    for (size_t k = 0; k < pass_outputs.size(); ++k) {
      if (pass[k] && first.empty()) first = plan.outputs[pass_outputs[k]].name;
      *total += pass[k];
    }
    if (*total == 0 || plan.allow_non_finite) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", first, " has non-finite elements (NaN/Inf; ", *total,
        " in the publication); the publication is rejected (allow_non_finite is off)"));
  };

  engine::ExecutionResult result;
  timing->host_setup_seconds = seconds_since(host_t0);

  // 3. Buckets. build_bucket enqueues bucket b's device work (amax when pipelined, gather
  //    copies, quantize, checksum) into staging[b % 2] and records ready[b % 2]; send_bucket
  //    hands it to the sink (and/or copies it to the host). Nothing is sent before the
  //    non-finite check in amax-first mode.
  auto build_bucket = [&](size_t b) -> absl::StatusOr<uint8_t*> {
    const HostClock::time_point t_bucket = HostClock::now();
    const BucketLayout& layout = plan.buckets[b];
    const int k = static_cast<int>(b % 2);
    // The pipelined amax reads only the inputs: it goes in before the wait below.
    if (!amax_first) WPUB_RETURN_IF_ERROR(enqueue_checks(b));
    // Reuse of this staging buffer waits (on the device) for its previous broadcast: bucket b-2's,
    // or for b < 2 the last one of an earlier publication that failed with a broadcast still
    // reading it (a wait on a completed or never-recorded event is free).
    if (options.sink != nullptr) {
      WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, done[k], 0));
    }
    // Shift the bucket inside its staging buffer so that the first 1-byte tensor (the packed
    // codes, which the quantize kernels write with 16-byte stores) starts 16-byte aligned
    // whenever that keeps the 4-byte outputs aligned; other cases go through scratch below.
    uint64_t first_byte_off = layout.nbytes;
    for (const PlacedTensor& t : layout.tensors) {
      if (DTypeSize(plan.outputs[t.output].dtype) == 1) {
        first_byte_off = std::min(first_byte_off, t.offset);
      }
    }
    uint64_t shift = (16 - first_byte_off % 16) % 16;
    if (shift % 4 != 0) shift = 0;
    uint8_t* buf = staging[k].bytes() + shift;

    std::vector<QuantSlot> slots;
    std::unordered_map<size_t, size_t> slot_of;  // input -> index into slots
    std::vector<CopyItem> copies;  // passed-through parts: one gather-copy launch per bucket
    for (const PlacedTensor& t : layout.tensors) {
      const auto& src = plan.sources[t.output];
      if (src.kind == OutputKind::kPassthrough) {
        const InputTensor& in = inputs[src.input];
        const std::span<const uint8_t* const> parts = tab.parts(src.input);
        if (in.parts.size() == 1 || in.concat_dim == 0) {
          uint64_t off = 0;
          for (size_t p = 0; p < in.parts.size(); ++p) {
            if (in.parts[p].nbytes) {
              copies.push_back(CopyItem{buf + t.offset + off, parts[p], in.parts[p].nbytes});
            }
            off += in.parts[p].nbytes;
          }
        } else {
          const uint64_t outer = static_cast<uint64_t>(in.desc.shape[0]);
          if (outer == 0) continue;
          const uint64_t row = t.nbytes / outer;
          uint64_t col = 0;
          for (size_t p = 0; p < in.parts.size(); ++p) {
            const uint64_t w = in.parts[p].nbytes / outer;
            if (w) {
              WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(buf + t.offset + col, row, parts[p], w, w,
                                                          outer, cudaMemcpyDeviceToDevice, s));
            }
            col += w;
          }
        }
        continue;
      }
      auto [pos, added] = slot_of.emplace(src.input, slots.size());
      if (added) slots.push_back(QuantSlot{src.input, src.amax_group});
      QuantSlot* it = &slots[pos->second];
      if (src.kind == OutputKind::kPacked) it->packed = t.offset;
      if (src.kind == OutputKind::kScales) it->scales = t.offset;
      if (src.kind == OutputKind::kDecodeScale) it->decode = t.offset;
    }

    WPUB_CUDA_RETURN_IF_ERROR(LaunchGatherCopy(copies.data(), static_cast<int>(copies.size()), s));

    // Quantize jobs; a job whose packed output is misaligned for the kernels' 16-byte stores
    // writes into aligned scratch, copied into the bucket on the same stream.
    std::vector<kernels::cuda::QuantizeJob> jobs;
    std::vector<CopyItem> copy_out;
    uint64_t scratch_need = 0;
    struct Pending {
      size_t job;
      uint64_t packed_scratch;
    };
    std::vector<Pending> pending;
    for (const QuantSlot& q : slots) {
      const Shape& shp = inputs[q.input].desc.shape;
      const int64_t rows = shp[shp.size() - 2], cols = shp.back();
      const uint64_t packed_stride = static_cast<uint64_t>(rows * cols / 2);
      const uint64_t scale_stride = static_cast<uint64_t>(rows * cols / 16);
      WPUB_ASSIGN_OR_RETURN(const std::span<const engine::WeightPiece> pieces,
                            tab.pieces_of(inputs, q.input));
      for (const engine::WeightPiece& p : pieces) {
        const uint64_t so = static_cast<uint64_t>(p.slice_offset);
        kernels::cuda::QuantizeJob job;
        job.weight = p.weight;
        job.amax = amax_dev + group_base[q.group] + p.slice_offset;
        job.out.packed = buf + q.packed + so * packed_stride;
        job.out.scales = buf + q.scales + so * scale_stride;
        job.out.decode_scale = reinterpret_cast<float*>(buf + q.decode) + so;
        if (!Aligned(job.out.decode_scale, 4)) {
          return absl::InternalError(absl::StrCat(
              "tensor ", inputs[q.input].desc.name,
              ": weight_scale_2 lands at a misaligned bucket offset (planner invariant)"));
        }
        if (!Aligned(job.out.packed, 16)) {
          pending.push_back({jobs.size(), scratch_need});
          scratch_need += AlignUp(static_cast<uint64_t>(p.slices) * packed_stride, kAlign);
        }
        jobs.push_back(job);
      }
    }
    if (scratch_need > 0) {
      WPUB_RETURN_IF_ERROR(scratch.Ensure(scratch_need, syncs, "alignment scratch"));
      for (const Pending& pend : pending) {
        kernels::cuda::QuantizeJob& job = jobs[pend.job];
        const uint64_t n = static_cast<uint64_t>(job.weight.num_slices * job.weight.rows() *
                                                 job.weight.cols() / 2);
        copy_out.push_back({job.out.packed, scratch.bytes() + pend.packed_scratch, n});
        job.out.packed = scratch.bytes() + pend.packed_scratch;
      }
    }
    if (!jobs.empty()) {
      std::string msg;
      const kernels::KernelStatus st = kernels::cuda::LaunchQuantize(
          jobs.data(), static_cast<int>(jobs.size()), plan.mode, s, &msg, limits_of(b));
      if (st != kernels::KernelStatus::kOk) {
        return KernelError(st, absl::StrCat("quantize of bucket ", b), msg);
      }
    }
    WPUB_CUDA_RETURN_IF_ERROR(
        LaunchGatherCopy(copy_out.data(), static_cast<int>(copy_out.size()), s));
    // The bucket is packed: its broadcast may start. The checksum reads it beside the broadcast
    // (both only read; the buffer's next writer waits for `done`, recorded after the broadcast,
    // and runs behind this checksum on the same stream); the sum stays on the device until the
    // final read.
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready[k], s));
    if (!Aligned(buf, 4)) return absl::InternalError("bucket staging lost its 4-byte alignment");
    WPUB_CUDA_RETURN_IF_ERROR(LaunchChecksumAdd(buf, layout.nbytes, 0, sum_dev + b, s));
    if (b + 1 == num_buckets) WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(t_packed, s));
    timing->host_buckets_seconds += seconds_since(t_bucket);
    return buf;
  };

  // The first bucket's manifest, made while the host waits for the non-finite counts.
  std::optional<engine::BucketManifest> first_manifest;
  auto send_bucket = [&](size_t b, uint8_t* buf) -> absl::Status {
    const HostClock::time_point t_bucket = HostClock::now();
    const BucketLayout& layout = plan.buckets[b];
    const int k = static_cast<int>(b % 2);
    const engine::BucketManifest manifest = b == 0 && first_manifest.has_value()
                                                ? *std::move(first_manifest)
                                                : engine::MakeBucketManifest(layout, plan.outputs);
    timing->host_buckets_seconds += seconds_since(t_bucket);
    if (options.sink != nullptr) {
      const HostClock::time_point t_sink = HostClock::now();
      absl::Status sent = options.sink->SendDevice(manifest, buf, layout.nbytes, ready[k], done[k]);
      timing->host_sink_seconds += seconds_since(t_sink);
      WPUB_RETURN_IF_ERROR(sent);
      if (hooks.sent_direct) WPUB_RETURN_IF_ERROR(hooks.sent_direct(manifest));
      // Host-only transports (pull receivers) take part: they need the bytes on the host too.
      if (!hooks.host_buckets_needed) return absl::OkStatus();
    }
    // Host buckets: one device-to-host copy (bucket bytes + its checksum sum) per bucket.
    WPUB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(bounce.ptr, buf, layout.nbytes, cudaMemcpyDeviceToHost, s));
    WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bounce.bytes() + AlignUp(layout.nbytes, 8),
                                              sum_dev + b, 8, cudaMemcpyDeviceToHost, s));
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(bounce_ready, s));
    WPUB_RETURN_IF_ERROR(syncs.EventSynchronize(bounce_ready, "host bucket copy"));
    auto bucket = std::make_shared<engine::Bucket>();
    bucket->version = plan.version;
    bucket->manifest = manifest;
    bucket->bytes.assign(bounce.bytes(), bounce.bytes() + layout.nbytes);
    uint64_t sum = 0;
    std::memcpy(&sum, bounce.bytes() + AlignUp(layout.nbytes, 8), 8);
    bucket->manifest.checksum = engine::ChecksumFinish(sum, layout.nbytes);
    bucket->sent_direct = options.sink != nullptr;
    return hooks.emit(std::move(bucket));
  };

  std::vector<uint8_t*> built;  // staging address of each bucket whose device work is enqueued
  built.reserve(num_buckets);
  if (amax_first) {
    const HostClock::time_point t_checks = HostClock::now();
    for (size_t b = 0; b < num_buckets; ++b) WPUB_RETURN_IF_ERROR(enqueue_checks(b));
    timing->host_checks_seconds = seconds_since(t_checks);
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(t_amax, s));
    WPUB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(status_host.ptr, status.ptr, nf_bytes, cudaMemcpyDeviceToHost, s));
    WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(status_ready, s));
    // The first bucket's device work goes in behind the status read, and its manifest is made:
    // the device packs it while the host waits for and checks the counts, so its broadcast can
    // start right after the check. Nothing leaves the device before it passes. The second
    // bucket's kernels go in after the first broadcast (they would otherwise hold the SMs its
    // kernel needs to start).
    if (num_buckets > 0) {
      WPUB_ASSIGN_OR_RETURN(uint8_t * buf, build_bucket(0));
      built.push_back(buf);
      const HostClock::time_point t_manifest = HostClock::now();
      first_manifest = engine::MakeBucketManifest(plan.buckets[0], plan.outputs);
      timing->host_buckets_seconds += seconds_since(t_manifest);
    }
    WPUB_RETURN_IF_ERROR(syncs.EventSynchronize(status_ready, "non-finite check before sending"));
    uint64_t total = 0;
    if (absl::Status nf = check_non_finite(status_host.bytes(), &total); !nf.ok()) {
      // A rejection returns with nothing in flight: the packed bucket reads the inputs in place
      // (CUDA IPC mappings the engine may close as soon as this returns).
      WPUB_RETURN_IF_ERROR(
          syncs.StreamSynchronize(s, "drain the packed buckets of a rejected publication"));
      dirty = false;
      return nf;
    }
  }
  for (size_t b = 0; b < num_buckets; ++b) {
    if (hooks.cancelled && hooks.cancelled()) {
      return absl::CancelledError(absl::StrCat("publication ", plan.version, " was cancelled"));
    }
    if (b == built.size()) {
      WPUB_ASSIGN_OR_RETURN(uint8_t * buf, build_bucket(b));
      built.push_back(buf);
    }
    WPUB_RETURN_IF_ERROR(send_bucket(b, built[b]));
  }
  if (num_buckets == 0) WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(t_packed, s));

  // 4. One read of the status block and the completion of every transfer: one host wait.
  WPUB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(status_host.ptr, status.ptr, status_bytes, cudaMemcpyDeviceToHost, s));
  if (options.sink != nullptr && num_buckets > 0) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, done[(num_buckets - 1) % 2], 0));
    if (num_buckets > 1) {
      WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, done[num_buckets % 2], 0));
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(t_end, s));
  WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(finished, s));
  WPUB_RETURN_IF_ERROR(syncs.EventSynchronize(finished, "publication completion and status"));
  dirty = false;

  uint64_t total_nf = 0;
  absl::Status nf = check_non_finite(status_host.bytes(), &total_nf);
  result.non_finite = total_nf;
  if (!nf.ok()) return nf;
  const auto* sum_host = reinterpret_cast<const uint64_t*>(status_host.bytes() + nf_bytes);
  checksums->resize(num_buckets);
  for (size_t b = 0; b < num_buckets; ++b) {
    (*checksums)[b] = engine::ChecksumFinish(sum_host[b], plan.buckets[b].nbytes);
  }
  float ms = 0;
  if (amax_first && cudaEventElapsedTime(&ms, t_begin, t_amax) == cudaSuccess) {
    timing->amax_seconds = ms / 1e3;
  }
  if (cudaEventElapsedTime(&ms, amax_first ? t_amax : t_begin, t_packed) == cudaSuccess) {
    timing->compute_seconds = ms / 1e3;
  }
  if (cudaEventElapsedTime(&ms, t_begin, t_end) == cudaSuccess) timing->total_seconds = ms / 1e3;
  result.quantize_seconds = timing->amax_seconds + timing->compute_seconds;
  result.pack_seconds = timing->host_staging_seconds;
  return result;
}

}  // namespace wpub::gpu
