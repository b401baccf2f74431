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
#include "core/transport/checksum.h"
#include "core/transport/planner.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::gpu::detail {
namespace {

using engine::InputTensor;
using engine::OutputKind;
using engine::PartView;
using kernels::cuda::CountItem;
using transport::BucketLayout;
using transport::PlacedTensor;
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

absl::Status BackendResources::WaitReaders(cudaStream_t stream, int k) const {
  for (const kernels::cuda::Event& e : done[k]) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, e.get(), 0));
  }
  return absl::OkStatus();
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
    first_manifest_ = transport::MakeBucketManifest(plan_.buckets[0], plan_.outputs);
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

// One read of the status block and the completion of every transfer: one host wait.
absl::StatusOr<engine::ExecutionResult> PublicationRun::Finish(std::vector<uint64_t>* checksums) {
  if (num_buckets_ == 0) WPUB_CUDA_RETURN_IF_ERROR(res_.t_packed.Record(s_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.status_host.ptr(), res_.status.ptr(),
                                            status_bytes_, cudaMemcpyDeviceToHost, s_));
  if (num_buckets_ > 0) {
    // The readers of the last two buckets (free when nobody read device bytes).
    WPUB_RETURN_IF_ERROR(res_.WaitReaders(s_, static_cast<int>((num_buckets_ - 1) % 2)));
    if (num_buckets_ > 1) {
      WPUB_RETURN_IF_ERROR(res_.WaitReaders(s_, static_cast<int>(num_buckets_ % 2)));
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
    (*checksums)[b] = transport::ChecksumFinish(sum_host[b], plan_.buckets[b].nbytes);
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
