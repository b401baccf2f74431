// One publication through the GPU backend, phase by phase (backend_run.h). The host waits only
// through HostSyncs (gpu_backend.h gives the count).
#include "core/gpu/backend_run.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/checksum.h"
#include "core/engine/planner.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::gpu::detail {
namespace {

using engine::BucketLayout;
using engine::InputTensor;
using engine::OutputKind;
using engine::PartView;
using engine::PlacedTensor;
using kernels::cuda::CopyItem;
using kernels::cuda::CountItem;
using HostClock = std::chrono::steady_clock;

double SecondsSince(HostClock::time_point t0) {
  return std::chrono::duration<double>(HostClock::now() - t0).count();
}

// Where one quantized input's three outputs sit in a bucket.
struct QuantSlot {
  size_t input = 0;
  int group = -1;
  uint64_t packed = 0, scales = 0, decode = 0;
};

}  // namespace

absl::StatusOr<std::span<const engine::WeightPiece>> InputTables::pieces_of(
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

BackendResources::~BackendResources() {
  if (compute != nullptr) cudaStreamSynchronize(compute);
}

PublicationRun::PublicationRun(BackendResources& res, const GpuBackendOptions& options,
                               const engine::ExecutionPlan& plan,
                               const engine::ExecutionHooks& hooks, GpuTiming* timing)
    : res_(res),
      options_(options),
      plan_(plan),
      hooks_(hooks),
      inputs_(*plan.inputs),
      timing_(timing),
      syncs_(hooks.syncs),
      s_(res.compute),
      num_buckets_(plan.buckets.size()),
      amax_first_(options.reject_before_send && !plan.allow_non_finite) {}

absl::StatusOr<engine::ExecutionResult> PublicationRun::Execute(std::vector<uint64_t>* checksums) {
  const HostClock::time_point host_t0 = HostClock::now();
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (res_.dirty) {
    WPUB_RETURN_IF_ERROR(syncs_.StreamSynchronize(s_, "drain the previous failed publication"));
    res_.dirty = false;
  }
  WPUB_RETURN_IF_ERROR(ResolveInputs());
  WPUB_RETURN_IF_ERROR(LayOutStatus());
  // From here on device work is in flight: a failure leaves it to drain at the next Execute.
  res_.dirty = true;
  WPUB_RETURN_IF_ERROR(EnqueueStart());
  timing_->host_setup_seconds = SecondsSince(host_t0);
  built_.reserve(num_buckets_);
  if (amax_first_) WPUB_RETURN_IF_ERROR(CheckBeforeSending());
  for (size_t b = 0; b < num_buckets_; ++b) {
    if (hooks_.cancelled && hooks_.cancelled()) {
      return absl::CancelledError(absl::StrCat("publication ", plan_.version, " was cancelled"));
    }
    if (b == built_.size()) {
      WPUB_ASSIGN_OR_RETURN(uint8_t * buf, BuildBucket(b));
      built_.push_back(buf);
    }
    WPUB_RETURN_IF_ERROR(EmitBucket(b, built_[b]));
  }
  return Finish(checksums);
}

// 1. Every used part to a device pointer; host parts go through pinned staging, misaligned
//    quantized device parts are relocated into the arena.
absl::Status PublicationRun::ResolveInputs() {
  used_.assign(inputs_.size(), 0);
  for (const auto& src : plan_.sources) used_[src.input] = 1;
  InputTables& tab = res_.tables;
  tab.part_begin.resize(inputs_.size() + 1);
  tab.part_ptr.clear();
  for (size_t i = 0; i < inputs_.size(); ++i) {
    tab.part_begin[i] = static_cast<uint32_t>(tab.part_ptr.size());
    for (const PartView& part : inputs_[i].parts) tab.part_ptr.push_back(part.data);
  }
  tab.part_begin[inputs_.size()] = static_cast<uint32_t>(tab.part_ptr.size());
  tab.part_staged.assign(tab.part_ptr.size(), 0);
  struct HostPart {
    size_t input, part;
    uint64_t offset;
  };
  std::vector<HostPart> host_parts;
  host_bytes_ = 0;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (!used_[i]) continue;
    for (size_t p = 0; p < inputs_[i].parts.size(); ++p) {
      const PartView& part = inputs_[i].parts[p];
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
        if (a.type == cudaMemoryTypeDevice && a.device != options_.device) {
          return absl::FailedPreconditionError(
              absl::StrCat("tensor ", inputs_[i].desc.name, " part ", p, " is on CUDA device ",
                           a.device, "; the GPU backend runs on device ", options_.device));
        }
        continue;
      }
      const uint64_t off = AlignUp(host_bytes_, kAlign);
      host_parts.push_back({i, p, off});
      tab.part_staged[tab.part_begin[i] + p] = 1;
      host_bytes_ = off + part.nbytes;
    }
  }
  // Quantized inputs must be 16-byte aligned for the kernels: a misaligned device part (a view
  // at an odd offset) is relocated into the arena with one device copy.
  quantized_.assign(inputs_.size(), 0);
  for (const auto& g : plan_.amax_groups) {
    for (size_t m : g.members) quantized_[m] = 1;
  }
  struct Moved {
    size_t input, part;
    uint64_t offset;
  };
  std::vector<Moved> moved;
  uint64_t arena_bytes = host_bytes_;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (!used_[i] || !quantized_[i]) continue;
    for (size_t p = 0; p < inputs_[i].parts.size(); ++p) {
      if (tab.part_staged[tab.part_begin[i] + p] || Aligned(tab.part(i, p), 16) ||
          inputs_[i].parts[p].nbytes == 0) {
        continue;
      }
      const uint64_t off = AlignUp(arena_bytes, kAlign);
      moved.push_back({i, p, off});
      arena_bytes = off + inputs_[i].parts[p].nbytes;
    }
  }
  if (host_bytes_ > 0) {
    WPUB_RETURN_IF_ERROR(
        res_.host_stage.Ensure(host_bytes_, syncs_, "pinned staging of host inputs"));
  }
  if (arena_bytes > 0) {
    WPUB_RETURN_IF_ERROR(res_.arena.Ensure(arena_bytes, syncs_, "device arena of host inputs"));
  }
  if (host_bytes_ > 0) {
    const auto t0 = HostClock::now();
    for (const HostPart& h : host_parts) {
      const PartView& part = inputs_[h.input].parts[h.part];
      std::memcpy(res_.host_stage.bytes() + h.offset, part.data, part.nbytes);
      tab.part(h.input, h.part) = res_.arena.bytes() + h.offset;
    }
    timing_->host_staging_seconds = SecondsSince(t0);
  }
  relocations_.clear();
  for (const Moved& m : moved) {
    relocations_.push_back(
        {tab.part(m.input, m.part), m.offset, inputs_[m.input].parts[m.part].nbytes});
    tab.part(m.input, m.part) = res_.arena.bytes() + m.offset;
  }
  return absl::OkStatus();
}

// 2. Quantized inputs checked (their pieces are built per bucket, InputTables), amax slots per
//    bucket (a group's slots are assigned in the bucket that first needs them), passthrough
//    count slots, the status block, the buffers.
absl::Status PublicationRun::LayOutStatus() {
  InputTables& tab = res_.tables;
  tab.piece_begin.assign(inputs_.size(), InputTables::kNotBuilt);
  tab.piece_end.assign(inputs_.size(), 0);
  tab.pieces.clear();
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (quantized_[i]) {
      WPUB_RETURN_IF_ERROR(engine::CheckWeightPieces(inputs_[i], tab.parts(i).size()));
    }
  }
  group_base_.assign(plan_.amax_groups.size(), -1);
  bucket_groups_.assign(num_buckets_, {});
  bucket_slot_begin_.assign(num_buckets_ + 1, 0);
  pass_slot_.assign(plan_.outputs.size(), UINT32_MAX);
  pass_outputs_.clear();
  int64_t next_slot = 0;
  for (size_t b = 0; b < num_buckets_; ++b) {
    bucket_slot_begin_[b] = next_slot;
    for (const PlacedTensor& t : plan_.buckets[b].tensors) {
      const auto& src = plan_.sources[t.output];
      if (src.kind == OutputKind::kPassthrough) {
        kernels::cuda::FloatKind k;
        if (FloatKindOf(plan_.outputs[t.output].dtype, &k)) {
          pass_slot_[t.output] = static_cast<uint32_t>(pass_outputs_.size());
          pass_outputs_.push_back(t.output);
        }
        continue;
      }
      const int g = src.amax_group;
      if (g < 0 || static_cast<size_t>(g) >= plan_.amax_groups.size()) {
        return absl::InternalError(
            absl::StrCat("output ", plan_.outputs[t.output].name, " has no amax group"));
      }
      if (group_base_[g] < 0) {
        group_base_[g] = next_slot;
        next_slot += plan_.amax_groups[g].slices;
        bucket_groups_[b].push_back(g);
      }
    }
  }
  bucket_slot_begin_[num_buckets_] = next_slot;
  num_slots_ = static_cast<uint64_t>(next_slot);
  // Status block: int64 non-finite per amax slot | uint64 per passthrough float output |
  // uint64 checksum sum per bucket.
  nf_bytes_ = 8 * (num_slots_ + pass_outputs_.size());
  status_bytes_ = nf_bytes_ + 8 * num_buckets_;
  max_bucket_ = 0;
  for (const BucketLayout& b : plan_.buckets) max_bucket_ = std::max(max_bucket_, b.nbytes);
  const uint64_t status_alloc = std::max<uint64_t>(status_bytes_, 8);
  WPUB_RETURN_IF_ERROR(res_.status.Ensure(status_alloc, syncs_, "status block"));
  WPUB_RETURN_IF_ERROR(res_.status_host.Ensure(status_alloc, syncs_, "status readback"));
  WPUB_RETURN_IF_ERROR(
      res_.amax.Ensure(std::max<uint64_t>(4 * num_slots_, 4), syncs_, "amax slots"));
  for (GrowBuffer& st : res_.staging) {
    WPUB_RETURN_IF_ERROR(st.Ensure(max_bucket_ + kAlign, syncs_, "bucket staging"));
  }
  nf_slots_ = reinterpret_cast<int64_t*>(res_.status.bytes());
  nf_pass_ = reinterpret_cast<unsigned long long*>(res_.status.bytes() + 8 * num_slots_);
  sum_dev_ = reinterpret_cast<unsigned long long*>(res_.status.bytes() + nf_bytes_);
  amax_dev_ = static_cast<float*>(res_.amax.ptr());
  return absl::OkStatus();
}

absl::Status PublicationRun::EnqueueStart() {
  WPUB_CUDA_RETURN_IF_ERROR(res_.t_begin.Record(s_));
  if (host_bytes_ > 0) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.arena.ptr(), res_.host_stage.ptr(), host_bytes_,
                                              cudaMemcpyHostToDevice, s_));
  }
  for (const Relocation& r : relocations_) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.arena.bytes() + r.offset, r.from, r.nbytes,
                                              cudaMemcpyDeviceToDevice, s_));
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(res_.status.ptr(), 0, status_bytes_, s_));
  return absl::OkStatus();
}

// Kernels that may run beside the previous bucket's transfer take the occupancy cap. The
// amax-first pass and the first bucket run before any transfer (the first one waits for them),
// so they take the whole GPU.
kernels::cuda::LaunchLimits PublicationRun::LimitsOf(size_t b) const {
  kernels::cuda::LaunchLimits limits;
  if (b > 0) limits.max_ctas_per_sm = options_.overlap_ctas_per_sm;
  return limits;
}

absl::Status PublicationRun::EnqueueChecks(size_t b) {
  InputTables& tab = res_.tables;
  std::vector<kernels::WeightDesc> ws;
  std::vector<int64_t> offs;
  for (int g : bucket_groups_[b]) {
    for (size_t m : plan_.amax_groups[g].members) {
      WPUB_ASSIGN_OR_RETURN(const std::span<const engine::WeightPiece> pieces,
                            tab.pieces_of(inputs_, m));
      for (const engine::WeightPiece& p : pieces) {
        ws.push_back(p.weight);
        offs.push_back(group_base_[g] - bucket_slot_begin_[b] + p.slice_offset);
      }
    }
  }
  const int64_t n_slots = bucket_slot_begin_[b + 1] - bucket_slot_begin_[b];
  if (!ws.empty()) {
    std::string msg;
    const kernels::KernelStatus st = kernels::cuda::LaunchAmax(
        ws.data(), static_cast<int>(ws.size()), offs.data(), n_slots,
        amax_dev_ + bucket_slot_begin_[b], nf_slots_ + bucket_slot_begin_[b], s_, &msg,
        amax_first_ ? kernels::cuda::LaunchLimits{} : LimitsOf(b));
    if (st != kernels::KernelStatus::kOk) {
      return KernelError(st, absl::StrCat("amax of bucket ", b), msg);
    }
  }
  std::vector<CountItem> items;
  for (const PlacedTensor& t : plan_.buckets[b].tensors) {
    if (pass_slot_[t.output] == UINT32_MAX) continue;
    const size_t input = plan_.sources[t.output].input;
    const auto& in = inputs_[input];
    CountItem item;
    FloatKindOf(in.desc.dtype, &item.kind);
    item.slot = pass_slot_[t.output];
    for (size_t p = 0; p < in.parts.size(); ++p) {
      item.data = tab.part(input, p);
      item.bytes = in.parts[p].nbytes;
      if (item.bytes) items.push_back(item);
    }
  }
  if (!items.empty()) {
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchCountNonFinite(
        items.data(), static_cast<int>(items.size()), nf_pass_, s_));
  }
  return absl::OkStatus();
}

absl::Status PublicationRun::CheckNonFinite(const uint8_t* host_status, uint64_t* total) const {
  const auto* slots = reinterpret_cast<const int64_t*>(host_status);
  const auto* pass = reinterpret_cast<const uint64_t*>(host_status + 8 * num_slots_);
  *total = 0;
  std::string first;
  for (size_t g = 0; g < plan_.amax_groups.size(); ++g) {
    if (group_base_[g] < 0) continue;
    uint64_t n = 0;
    for (int64_t k = 0; k < plan_.amax_groups[g].slices; ++k) {
      n += static_cast<uint64_t>(slots[group_base_[g] + k]);
    }
    if (n && first.empty()) {
      first = inputs_[plan_.amax_groups[g].members[0]].desc.name;
      if (plan_.amax_groups[g].members.size() > 1) {
        first +=
            absl::StrCat(" (or its pair ", inputs_[plan_.amax_groups[g].members[1]].desc.name, ")");
      }
    }
    *total += n;
  }
  for (size_t k = 0; k < pass_outputs_.size(); ++k) {
    if (pass[k] && first.empty()) first = plan_.outputs[pass_outputs_[k]].name;
    *total += pass[k];
  }
  if (*total == 0 || plan_.allow_non_finite) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("tensor ", first, " has non-finite elements (NaN/Inf; ", *total,
                   " in the publication); the publication is rejected (allow_non_finite is off)"));
}

// Amax first: every amax and count, then the status read. The first bucket's device work goes
// in behind the read and its manifest is made: the device packs it while the host waits for
// and checks the counts, so its transfer can start right after the check. Nothing leaves the
// device before it passes. The second bucket's kernels go in after the first transfer (they
// would otherwise hold the SMs its kernel needs to start).
absl::Status PublicationRun::CheckBeforeSending() {
  const HostClock::time_point t_checks = HostClock::now();
  for (size_t b = 0; b < num_buckets_; ++b) WPUB_RETURN_IF_ERROR(EnqueueChecks(b));
  timing_->host_checks_seconds = SecondsSince(t_checks);
  WPUB_CUDA_RETURN_IF_ERROR(res_.t_amax.Record(s_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.status_host.ptr(), res_.status.ptr(), nf_bytes_,
                                            cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(res_.status_ready.Record(s_));
  if (num_buckets_ > 0) {
    WPUB_ASSIGN_OR_RETURN(uint8_t * buf, BuildBucket(0));
    built_.push_back(buf);
    const HostClock::time_point t_manifest = HostClock::now();
    first_manifest_ = engine::MakeBucketManifest(plan_.buckets[0], plan_.outputs);
    timing_->host_buckets_seconds += SecondsSince(t_manifest);
  }
  WPUB_RETURN_IF_ERROR(
      syncs_.EventSynchronize(res_.status_ready.get(), "non-finite check before sending"));
  uint64_t total = 0;
  if (absl::Status nf = CheckNonFinite(res_.status_host.bytes(), &total); !nf.ok()) {
    // A rejection returns with nothing in flight: the packed bucket reads the inputs in place
    // (CUDA IPC mappings the engine may close as soon as this returns).
    WPUB_RETURN_IF_ERROR(
        syncs_.StreamSynchronize(s_, "drain the packed buckets of a rejected publication"));
    res_.dirty = false;
    return nf;
  }
  return absl::OkStatus();
}

// Bucket b's device work (amax when pipelined, gather copies, quantize, checksum) into
// staging[b % 2]; ready[b % 2] recorded once it is packed.
absl::StatusOr<uint8_t*> PublicationRun::BuildBucket(size_t b) {
  const HostClock::time_point t_bucket = HostClock::now();
  const BucketLayout& layout = plan_.buckets[b];
  const int k = static_cast<int>(b % 2);
  // The pipelined amax reads only the inputs: it goes in before the wait below.
  if (!amax_first_) WPUB_RETURN_IF_ERROR(EnqueueChecks(b));
  // Reuse of this staging buffer waits (on the device) for its previous reader: bucket b-2's
  // transfer, or for b < 2 the last one of an earlier publication that failed with a broadcast
  // still reading it (a wait on a completed or never-recorded event is free).
  WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s_, res_.done[k].get(), 0));
  // Shift the bucket inside its staging buffer so that the first 1-byte tensor (the packed
  // codes, which the quantize kernels write with 16-byte stores) starts 16-byte aligned
  // whenever that keeps the 4-byte outputs aligned; other cases go through scratch.
  uint64_t first_byte_off = layout.nbytes;
  for (const PlacedTensor& t : layout.tensors) {
    if (DTypeSize(plan_.outputs[t.output].dtype) == 1) {
      first_byte_off = std::min(first_byte_off, t.offset);
    }
  }
  uint64_t shift = (16 - first_byte_off % 16) % 16;
  if (shift % 4 != 0) shift = 0;
  uint8_t* buf = res_.staging[k].bytes() + shift;
  WPUB_RETURN_IF_ERROR(GatherPassthrough(b, buf));
  WPUB_RETURN_IF_ERROR(EnqueueQuantize(b, buf));
  // The bucket is packed: its transfer may start. The checksum reads it beside the transfer
  // (both only read; the buffer's next writer waits for `done`, recorded after the transfer,
  // and runs behind this checksum on the same stream); the sum stays on the device until the
  // final read.
  WPUB_CUDA_RETURN_IF_ERROR(res_.ready[k].Record(s_));
  if (!Aligned(buf, 4)) return absl::InternalError("bucket staging lost its 4-byte alignment");
  WPUB_CUDA_RETURN_IF_ERROR(
      kernels::cuda::LaunchChecksumAdd(buf, layout.nbytes, 0, sum_dev_ + b, s_));
  if (b + 1 == num_buckets_) WPUB_CUDA_RETURN_IF_ERROR(res_.t_packed.Record(s_));
  timing_->host_buckets_seconds += SecondsSince(t_bucket);
  return buf;
}

absl::Status PublicationRun::GatherPassthrough(size_t b, uint8_t* buf) {
  std::vector<CopyItem> copies;  // one gather-copy launch per bucket
  for (const PlacedTensor& t : plan_.buckets[b].tensors) {
    const auto& src = plan_.sources[t.output];
    if (src.kind != OutputKind::kPassthrough) continue;
    const InputTensor& in = inputs_[src.input];
    const std::span<const uint8_t* const> parts = res_.tables.parts(src.input);
    if (in.parts.size() == 1 || in.concat_dim == 0) {
      uint64_t off = 0;
      for (size_t p = 0; p < in.parts.size(); ++p) {
        if (in.parts[p].nbytes) {
          copies.push_back(CopyItem{buf + t.offset + off, parts[p], in.parts[p].nbytes});
        }
        off += in.parts[p].nbytes;
      }
      continue;
    }
    const uint64_t outer = static_cast<uint64_t>(in.desc.shape[0]);
    if (outer == 0) continue;
    const uint64_t row = t.nbytes / outer;
    uint64_t col = 0;
    for (size_t p = 0; p < in.parts.size(); ++p) {
      const uint64_t w = in.parts[p].nbytes / outer;
      if (w) {
        WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(buf + t.offset + col, row, parts[p], w, w,
                                                    outer, cudaMemcpyDeviceToDevice, s_));
      }
      col += w;
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(
      kernels::cuda::LaunchGatherCopy(copies.data(), static_cast<int>(copies.size()), s_));
  return absl::OkStatus();
}

// Quantize jobs of bucket b; a job whose packed output is misaligned for the kernels' 16-byte
// stores writes into aligned scratch, copied into the bucket on the same stream.
absl::Status PublicationRun::EnqueueQuantize(size_t b, uint8_t* buf) {
  std::vector<QuantSlot> slots;
  std::unordered_map<size_t, size_t> slot_of;  // input -> index into slots
  for (const PlacedTensor& t : plan_.buckets[b].tensors) {
    const auto& src = plan_.sources[t.output];
    if (src.kind == OutputKind::kPassthrough) continue;
    auto [pos, added] = slot_of.emplace(src.input, slots.size());
    if (added) slots.push_back(QuantSlot{src.input, src.amax_group});
    QuantSlot* it = &slots[pos->second];
    if (src.kind == OutputKind::kPacked) it->packed = t.offset;
    if (src.kind == OutputKind::kScales) it->scales = t.offset;
    if (src.kind == OutputKind::kDecodeScale) it->decode = t.offset;
  }
  std::vector<kernels::cuda::QuantizeJob> jobs;
  struct Pending {
    size_t job;
    uint64_t packed_scratch;
  };
  std::vector<Pending> pending;
  uint64_t scratch_need = 0;
  for (const QuantSlot& q : slots) {
    const Shape& shp = inputs_[q.input].desc.shape;
    const int64_t rows = shp[shp.size() - 2], cols = shp.back();
    const uint64_t packed_stride = static_cast<uint64_t>(rows * cols / 2);
    const uint64_t scale_stride = static_cast<uint64_t>(rows * cols / 16);
    WPUB_ASSIGN_OR_RETURN(const std::span<const engine::WeightPiece> pieces,
                          res_.tables.pieces_of(inputs_, q.input));
    for (const engine::WeightPiece& p : pieces) {
      const uint64_t so = static_cast<uint64_t>(p.slice_offset);
      kernels::cuda::QuantizeJob job;
      job.weight = p.weight;
      job.amax = amax_dev_ + group_base_[q.group] + p.slice_offset;
      job.out.packed = buf + q.packed + so * packed_stride;
      job.out.scales = buf + q.scales + so * scale_stride;
      job.out.decode_scale = reinterpret_cast<float*>(buf + q.decode) + so;
      if (!Aligned(job.out.decode_scale, 4)) {
        return absl::InternalError(absl::StrCat(
            "tensor ", inputs_[q.input].desc.name,
            ": weight_scale_2 lands at a misaligned bucket offset (planner invariant)"));
      }
      if (!Aligned(job.out.packed, 16)) {
        pending.push_back({jobs.size(), scratch_need});
        scratch_need += AlignUp(static_cast<uint64_t>(p.slices) * packed_stride, kAlign);
      }
      jobs.push_back(job);
    }
  }
  std::vector<CopyItem> copy_out;
  if (scratch_need > 0) {
    WPUB_RETURN_IF_ERROR(res_.scratch.Ensure(scratch_need, syncs_, "alignment scratch"));
    for (const Pending& pend : pending) {
      kernels::cuda::QuantizeJob& job = jobs[pend.job];
      const uint64_t n =
          static_cast<uint64_t>(job.weight.num_slices * job.weight.rows() * job.weight.cols() / 2);
      copy_out.push_back({job.out.packed, res_.scratch.bytes() + pend.packed_scratch, n});
      job.out.packed = res_.scratch.bytes() + pend.packed_scratch;
    }
  }
  if (!jobs.empty()) {
    std::string msg;
    const kernels::KernelStatus st = kernels::cuda::LaunchQuantize(
        jobs.data(), static_cast<int>(jobs.size()), plan_.mode, s_, &msg, LimitsOf(b));
    if (st != kernels::KernelStatus::kOk) {
      return KernelError(st, absl::StrCat("quantize of bucket ", b), msg);
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(
      kernels::cuda::LaunchGatherCopy(copy_out.data(), static_cast<int>(copy_out.size()), s_));
  return absl::OkStatus();
}

// Bucket b, packed in `buf`, through the one road: a device bucket to the hooks' emit (the
// transport group hands it on, and asks for the host copy only for host-only transports).
absl::Status PublicationRun::EmitBucket(size_t b, uint8_t* buf) {
  const HostClock::time_point t_bucket = HostClock::now();
  const int k = static_cast<int>(b % 2);
  auto bucket = std::make_shared<engine::Bucket>();
  bucket->version = plan_.version;
  bucket->manifest = b == 0 && first_manifest_.has_value()
                         ? *std::move(first_manifest_)
                         : engine::MakeBucketManifest(plan_.buckets[b], plan_.outputs);
  bucket->location = engine::BucketLocation::kDevice;
  bucket->device.data = buf;
  bucket->device.device = options_.device;
  bucket->device.ready = res_.ready[k].get();
  bucket->device.done = res_.done[k].get();
  const engine::BucketManifest* manifest = &bucket->manifest;
  bucket->device.copy_to_host = [this, b, buf, manifest] { return CopyToHost(b, buf, *manifest); };
  timing_->host_buckets_seconds += SecondsSince(t_bucket);
  const HostClock::time_point t_emit = HostClock::now();
  absl::Status sent = hooks_.emit(std::move(bucket));
  timing_->host_emit_seconds += SecondsSince(t_emit);
  return sent;
}

// One device-to-host copy (bucket bytes + its checksum sum) and one counted wait.
absl::StatusOr<std::shared_ptr<const engine::Bucket>> PublicationRun::CopyToHost(
    size_t b, const uint8_t* buf, const engine::BucketManifest& manifest) {
  const uint64_t n = plan_.buckets[b].nbytes;
  WPUB_RETURN_IF_ERROR(res_.bounce.Ensure(max_bucket_ + 8, syncs_, "host bucket bounce buffer"));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.bounce.ptr(), buf, n, cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.bounce.bytes() + AlignUp(n, 8), sum_dev_ + b, 8,
                                            cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(res_.bounce_ready.Record(s_));
  WPUB_RETURN_IF_ERROR(syncs_.EventSynchronize(res_.bounce_ready.get(), "host bucket copy"));
  auto host = std::make_shared<engine::Bucket>();
  host->version = plan_.version;
  host->manifest = manifest;
  host->bytes.assign(res_.bounce.bytes(), res_.bounce.bytes() + n);
  uint64_t sum = 0;
  std::memcpy(&sum, res_.bounce.bytes() + AlignUp(n, 8), 8);
  host->manifest.checksum = engine::ChecksumFinish(sum, n);
  return std::shared_ptr<const engine::Bucket>(std::move(host));
}

// One read of the status block and the completion of every transfer: one host wait.
absl::StatusOr<engine::ExecutionResult> PublicationRun::Finish(std::vector<uint64_t>* checksums) {
  if (num_buckets_ == 0) WPUB_CUDA_RETURN_IF_ERROR(res_.t_packed.Record(s_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.status_host.ptr(), res_.status.ptr(),
                                            status_bytes_, cudaMemcpyDeviceToHost, s_));
  if (num_buckets_ > 0) {
    // The readers of the last two buckets (free when nobody read device bytes).
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s_, res_.done[(num_buckets_ - 1) % 2].get(), 0));
    if (num_buckets_ > 1) {
      WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s_, res_.done[num_buckets_ % 2].get(), 0));
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(res_.t_end.Record(s_));
  WPUB_CUDA_RETURN_IF_ERROR(res_.finished.Record(s_));
  WPUB_RETURN_IF_ERROR(
      syncs_.EventSynchronize(res_.finished.get(), "publication completion and status"));
  res_.dirty = false;

  engine::ExecutionResult result;
  uint64_t total_nf = 0;
  absl::Status nf = CheckNonFinite(res_.status_host.bytes(), &total_nf);
  result.non_finite = total_nf;
  if (!nf.ok()) return nf;
  const auto* sum_host = reinterpret_cast<const uint64_t*>(res_.status_host.bytes() + nf_bytes_);
  checksums->resize(num_buckets_);
  for (size_t b = 0; b < num_buckets_; ++b) {
    (*checksums)[b] = engine::ChecksumFinish(sum_host[b], plan_.buckets[b].nbytes);
  }
  float ms = 0;
  if (amax_first_ &&
      cudaEventElapsedTime(&ms, res_.t_begin.get(), res_.t_amax.get()) == cudaSuccess) {
    timing_->amax_seconds = ms / 1e3;
  }
  if (cudaEventElapsedTime(&ms, amax_first_ ? res_.t_amax.get() : res_.t_begin.get(),
                           res_.t_packed.get()) == cudaSuccess) {
    timing_->compute_seconds = ms / 1e3;
  }
  if (cudaEventElapsedTime(&ms, res_.t_begin.get(), res_.t_end.get()) == cudaSuccess) {
    timing_->total_seconds = ms / 1e3;
  }
  result.quantize_seconds = timing_->amax_seconds + timing_->compute_seconds;
  result.pack_seconds = timing_->host_staging_seconds;
  return result;
}

}  // namespace wpub::gpu::detail
