// The bucket phases of a GPU-backend publication (backend_run.h): build a bucket into its
// staging buffer, emit it as a device bucket, and its host copy on request.
#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/gpu/backend_run.h"
#include "core/transport/checksum.h"
#include "core/transport/planner.h"
#include "kernels/cuda/nvfp4_cuda.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::gpu::detail {
namespace {

using engine::InputTensor;
using engine::OutputKind;
using kernels::cuda::CopyItem;
using transport::BucketLayout;
using transport::PlacedTensor;

// Where one quantized input's three outputs sit in a bucket.
struct QuantSlot {
  size_t input = 0;
  int group = -1;
  uint64_t packed = 0, scales = 0, decode = 0;
};

}  // namespace

// Bucket b's device work (amax when pipelined, gather copies, quantize, checksum) into
// staging[b % 2]; ready[b % 2] recorded once it is packed.
absl::StatusOr<uint8_t*> PublicationRun::BuildBucket(size_t b) {
  const HostClock::time_point t_bucket = HostClock::now();
  const BucketLayout& layout = plan_.buckets[b];
  const int k = static_cast<int>(b % 2);
  // The pipelined amax reads only the inputs: it goes in before the wait below.
  if (!amax_first_) WPUB_RETURN_IF_ERROR(EnqueueChecks(b));
  // Reuse of this staging buffer waits (on the device) for its previous readers: bucket b-2's
  // transfers, or for b < 2 the last ones of an earlier publication that failed with a broadcast
  // still reading it (a wait on a completed or never-recorded event is free).
  WPUB_RETURN_IF_ERROR(res_.WaitReaders(s_, k));
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
  // (both only read; the buffer's next writer waits for every reader's `done`, recorded after
  // its transfer,
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
  auto bucket = std::make_shared<transport::Bucket>();
  bucket->version = plan_.version;
  bucket->manifest = b == 0 && first_manifest_.has_value()
                         ? *std::move(first_manifest_)
                         : transport::MakeBucketManifest(plan_.buckets[b], plan_.outputs);
  bucket->location = transport::BucketLocation::kDevice;
  bucket->device.data = buf;
  bucket->device.device = options_.device;
  bucket->device.ready = res_.ready[k].get();
  for (size_t r = 0; r < transport::kMaxDeviceReaders; ++r) {
    bucket->device.reader_done[r] = res_.done[k][r].get();
  }
  bucket->device.done = bucket->device.reader_done[0];
  const transport::BucketManifest* manifest = &bucket->manifest;
  bucket->device.copy_to_host = [this, b, buf, manifest] { return CopyToHost(b, buf, *manifest); };
  bucket->device.checksum_to_host = [this, b] { return ChecksumToHost(b); };
  bucket->device.count_host_wait = [this] { syncs_.CountExternal(); };
  timing_->host_buckets_seconds += SecondsSince(t_bucket);
  const HostClock::time_point t_emit = HostClock::now();
  absl::Status sent = hooks_.emit(std::move(bucket));
  timing_->host_emit_seconds += SecondsSince(t_emit);
  return sent;
}

// The sum's 8 bytes into its place in the status mirror (Finish reads the whole mirror again
// later) and one counted wait.
absl::StatusOr<uint64_t> PublicationRun::ChecksumToHost(size_t b) {
  uint8_t* at = res_.status_host.bytes() + nf_bytes_ + 8 * b;
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(at, sum_dev_ + b, 8, cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(res_.bounce_ready.Record(s_));
  WPUB_RETURN_IF_ERROR(syncs_.EventSynchronize(res_.bounce_ready.get(), "bucket checksum"));
  uint64_t sum = 0;
  std::memcpy(&sum, at, 8);
  return transport::ChecksumFinish(sum, plan_.buckets[b].nbytes);
}

// One device-to-host copy (bucket bytes + its checksum sum) and one counted wait.
absl::StatusOr<std::shared_ptr<const transport::Bucket>> PublicationRun::CopyToHost(
    size_t b, const uint8_t* buf, const transport::BucketManifest& manifest) {
  const uint64_t n = plan_.buckets[b].nbytes;
  WPUB_RETURN_IF_ERROR(res_.bounce.Ensure(max_bucket_ + 8, syncs_, "host bucket bounce buffer"));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.bounce.ptr(), buf, n, cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(res_.bounce.bytes() + AlignUp(n, 8), sum_dev_ + b, 8,
                                            cudaMemcpyDeviceToHost, s_));
  WPUB_CUDA_RETURN_IF_ERROR(res_.bounce_ready.Record(s_));
  WPUB_RETURN_IF_ERROR(syncs_.EventSynchronize(res_.bounce_ready.get(), "host bucket copy"));
  auto host = std::make_shared<transport::Bucket>();
  host->version = plan_.version;
  host->manifest = manifest;
  host->bytes.assign(res_.bounce.bytes(), res_.bounce.bytes() + n);
  uint64_t sum = 0;
  std::memcpy(&sum, res_.bounce.bytes() + AlignUp(n, 8), 8);
  host->manifest.checksum = transport::ChecksumFinish(sum, n);
  return std::shared_ptr<const transport::Bucket>(std::move(host));
}

}  // namespace wpub::gpu::detail
