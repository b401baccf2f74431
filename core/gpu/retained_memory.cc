// GpuRetainedMemory: the retained copy's arenas in device or pinned memory (retained_memory.h).
#include "core/gpu/retained_memory.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/delta/bucket_patch.h"
#include "core/gpu/host_syncs.h"
#include "core/transport/checksum.h"
#include "kernels/cuda/bucket_diff.h"
#include "kernels/cuda/status_kernels.h"

namespace wpub::gpu {

namespace {

constexpr uint64_t kAlign = 256;

uint64_t Align(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

absl::Status Exhausted(cudaError_t err, uint64_t bytes, const char* what) {
  (void)cudaGetLastError();
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", bytes, " bytes of ", what, ": ", cudaGetErrorString(err)));
}

}  // namespace

// One version's bytes and its checksum sums. Its readers' `done` events are recorded by the
// transports that read a replay's buckets in place (device arenas).
struct GpuRetainedMemory::Arena {
  kernels::cuda::DeviceBuffer device;      // kDevice
  kernels::cuda::PinnedHostBuffer pinned;  // kPinned
  kernels::cuda::DeviceBuffer sums;        // one 64-bit sum per bucket
  kernels::cuda::PinnedHostBuffer sums_host;
  kernels::cuda::Event sealed;
  kernels::cuda::Event readers[transport::kMaxDeviceReaders];
  bool in_pinned = false;  // where the bytes live (an empty version has no buffer at all)

  uint64_t capacity() const { return device.size() + pinned.size(); }
  uint8_t* base() const { return in_pinned ? pinned.as<uint8_t>() : device.as<uint8_t>(); }
};

// The RetainedBytes of one version, in one arena.
class GpuRetainedMemory::Version final : public transport::RetainedBytes {
 public:
  Version(std::shared_ptr<GpuRetainedMemory> memory, std::shared_ptr<Arena> arena,
          const transport::PublicationManifest& manifest)
      : memory_(std::move(memory)), arena_(std::move(arena)) {
    uint64_t offset = 0;
    for (const transport::BucketManifest& b : manifest.buckets) {
      offsets_.push_back(offset);
      sizes_.push_back(b.nbytes);
      offset = Align(offset + b.nbytes);
    }
    host_summed_.assign(sizes_.size(), false);
  }

  absl::Status Stage(const transport::Bucket& bucket) override {
    WPUB_RETURN_IF_ERROR(StageCopy(bucket));
    std::lock_guard lock(mu_);
    ++staged_;
    staged_cv_.notify_all();
    return absl::OkStatus();
  }

  // Stage's copy, its event recorded behind it (Patch waits on it).
  absl::Status StageCopy(const transport::Bucket& bucket) {
    const uint32_t i = bucket.manifest.index;
    if (sealed() || i != staged_count() || i >= sizes_.size() ||
        bucket.manifest.nbytes != sizes_[i]) {
      return absl::InternalError(absl::StrCat(
          "retained memory: bucket ", i, " out of order, of the wrong size or after the seal"));
    }
    WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(memory_->options_.device));
    const cudaStream_t s = memory_->stream_.get();
    if (i == 0) {
      // A replay of the version this arena held before may have read it in place.
      for (const kernels::cuda::Event& e : arena_->readers) {
        WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, e.get(), 0));
      }
    }
    const uint64_t n = sizes_[i];
    uint8_t* dst = arena_->base() + offsets_[i];
    auto* sum = arena_->sums.as<unsigned long long>() + i;
    const bool to_device = !arena_->in_pinned;
    if (bucket.location == transport::BucketLocation::kDevice) {
      const transport::DeviceBytes& d = bucket.device;
      const absl::Status copied = [&]() -> absl::Status {
        WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, d.ready, 0));
        if (to_device) {
          WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, d.data, n, cudaMemcpyDeviceToDevice, s));
          WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchChecksumAdd(dst, n, 0, sum, s));
        } else {
          WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchChecksumAdd(d.data, n, 0, sum, s));
          WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, d.data, n, cudaMemcpyDeviceToHost, s));
        }
        return absl::OkStatus();
      }();
      // Behind whatever of the copy was enqueued, failed or not: the producer reuses its buffer
      // only after it.
      if (d.done != nullptr) WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.done, s));
      WPUB_RETURN_IF_ERROR(copied);
    } else {
      if (bucket.bytes.size() != n) {
        return absl::InternalError(absl::StrCat("retained memory: bucket ", i, " holds ",
                                                bucket.bytes.size(), " bytes, not ", n));
      }
      if (to_device) {
        WPUB_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst, bucket.bytes.data(), n, cudaMemcpyHostToDevice, s));
        WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchChecksumAdd(dst, n, 0, sum, s));
      } else {
        // Behind whatever this stream still does with the arena; summed on the host at the seal.
        WPUB_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst, bucket.bytes.data(), n, cudaMemcpyHostToHost, s));
        host_summed_[i] = true;
      }
    }
    // Only this thread appends (Stage); Patch reads entry i once staged_ > i, under mu_.
    kernels::cuda::Event copied;
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &copied));
    WPUB_CUDA_RETURN_IF_ERROR(copied.Record(s));
    std::lock_guard lock(mu_);
    copied_.push_back(std::move(copied));
    return absl::OkStatus();
  }

  void Abandon() override {
    std::lock_guard lock(mu_);
    abandoned_ = true;
    staged_cv_.notify_all();
  }

  absl::StatusOr<transport::RetainedPatch> Patch(const transport::RetainedBytes& base_bytes,
                                                 const transport::BucketManifest& base_bucket,
                                                 const transport::BucketManifest& next,
                                                 uint64_t next_checksum, double max_patch_fraction,
                                                 absl::Duration wait) override {
    if (arena_->in_pinned) {
      return absl::UnimplementedError("a pinned copy is diffed on the host");
    }
    const auto* base = dynamic_cast<const Version*>(&base_bytes);
    const uint32_t i = next.index;
    if (base == nullptr || base->memory_ != memory_ || base->arena_->in_pinned) {
      return absl::InvalidArgumentError("retained memory: the patch's base is not of this memory");
    }
    if (i >= sizes_.size() || next.nbytes != sizes_[i] || base_bucket.index != i ||
        i >= base->sizes_.size() || base->sizes_[i] != sizes_[i] || !base->sealed()) {
      return absl::InvalidArgumentError(
          absl::StrCat("retained memory: bucket ", i,
                       " of the base and of this version differ in size, or "
                       "the base is not sealed"));
    }
    WPUB_ASSIGN_OR_RETURN(cudaEvent_t copied, WaitStaged(i, wait));
    return memory_->Diff(base->arena_->base() + base->offsets_[i], arena_->base() + offsets_[i],
                         sizes_[i], copied, base_bucket.checksum, next_checksum,
                         max_patch_fraction);
  }

  absl::StatusOr<transport::DevicePatch> PatchOnDevice(const transport::BucketManifest& base_bucket,
                                                       const transport::Bucket& next,
                                                       uint64_t next_checksum,
                                                       double max_patch_fraction) override {
    const uint32_t i = base_bucket.index;
    if (arena_->in_pinned) return absl::UnimplementedError("a pinned copy makes no device patches");
    if (!sealed() || i >= sizes_.size() || next.location != transport::BucketLocation::kDevice ||
        next.manifest.index != i || next.manifest.nbytes != sizes_[i] ||
        next.device.device != memory_->options_.device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "retained memory: no device patch for bucket ", i,
          ": the base is not sealed, or the bucket is not a device bucket of its size on the "
          "retained copy's device"));
    }
    return memory_->DiffForBroadcast(arena_->base() + offsets_[i], next, base_bucket.checksum,
                                     next_checksum, max_patch_fraction);
  }

  absl::StatusOr<std::shared_ptr<const transport::Bucket>> StagedHostCopy(
      uint64_t version, const transport::BucketManifest& manifest, absl::Duration wait) override {
    const uint32_t i = manifest.index;
    if (i >= sizes_.size() || manifest.nbytes != sizes_[i]) {
      return absl::InternalError(
          absl::StrCat("retained memory: bucket ", i, " is not a bucket of this version"));
    }
    WPUB_ASSIGN_OR_RETURN(cudaEvent_t copied, WaitStaged(i, wait));
    WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(memory_->options_.device));
    HostSyncs uncounted(nullptr);  // a receiver's read, off the publication's thread
    WPUB_RETURN_IF_ERROR(uncounted.EventSynchronize(copied, "staged bucket copy"));
    auto host = std::make_shared<transport::Bucket>();
    host->version = version;
    host->manifest = manifest;
    const uint8_t* src = arena_->base() + offsets_[i];
    if (arena_->in_pinned) {
      host->bytes.assign(src, src + manifest.nbytes);  // its copy is done; nothing rewrites it
    } else {
      host->bytes.resize(manifest.nbytes);
      WPUB_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(host->bytes.data(), src, manifest.nbytes, cudaMemcpyDeviceToHost));
    }
    return std::shared_ptr<const transport::Bucket>(std::move(host));
  }

  absl::StatusOr<std::vector<uint64_t>> Seal() override {
    if (const uint32_t staged = staged_count(); staged != sizes_.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("retained memory: ", staged, " of ", sizes_.size(), " buckets staged"));
    }
    WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(memory_->options_.device));
    const cudaStream_t s = memory_->stream_.get();
    const uint64_t sums_bytes = sizes_.size() * sizeof(uint64_t);
    if (sums_bytes != 0) {
      WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena_->sums_host.data(), arena_->sums.data(),
                                                sums_bytes, cudaMemcpyDeviceToHost, s));
    }
    WPUB_CUDA_RETURN_IF_ERROR(arena_->sealed.Record(s));
    HostSyncs uncounted(nullptr);  // the transports' waits are not the backend's syncs
    WPUB_RETURN_IF_ERROR(uncounted.EventSynchronize(arena_->sealed.get(), "retained copy seal"));
    std::vector<uint64_t> checksums(sizes_.size());
    const auto* sums = arena_->sums_host.as<const uint64_t>();
    for (size_t i = 0; i < sizes_.size(); ++i) {
      checksums[i] = host_summed_[i] ? transport::Checksum(arena_->base() + offsets_[i], sizes_[i])
                                     : transport::ChecksumFinish(sums[i], sizes_[i]);
    }
    std::lock_guard lock(mu_);
    sealed_ = true;
    return checksums;
  }

  absl::StatusOr<std::shared_ptr<const transport::Bucket>> HostCopy(
      uint64_t version, const transport::BucketManifest& manifest) override {
    const uint32_t i = manifest.index;
    if (!sealed() || i >= sizes_.size() || manifest.nbytes != sizes_[i]) {
      return absl::InternalError(
          absl::StrCat("retained memory: bucket ", i, " is not a bucket of the sealed version"));
    }
    auto host = std::make_shared<transport::Bucket>();
    host->version = version;
    host->manifest = manifest;
    const uint8_t* src = arena_->base() + offsets_[i];
    if (arena_->in_pinned) {
      host->bytes.assign(src, src + manifest.nbytes);  // sealed pinned bytes
    } else {
      host->bytes.resize(manifest.nbytes);
      WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(memory_->options_.device));
      WPUB_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(host->bytes.data(), src, manifest.nbytes, cudaMemcpyDeviceToHost));
    }
    return std::shared_ptr<const transport::Bucket>(std::move(host));
  }

  absl::StatusOr<std::shared_ptr<const transport::Bucket>> Emit(
      uint64_t version, const transport::BucketManifest& manifest) override {
    const uint32_t i = manifest.index;
    if (!sealed() || i >= sizes_.size() || manifest.nbytes != sizes_[i]) {
      return absl::InternalError(
          absl::StrCat("retained memory: bucket ", i, " is not a bucket of the sealed version"));
    }
    if (arena_->in_pinned) {
      return memory_->EmitThroughBounce(arena_, offsets_[i], version, manifest);
    }
    auto bucket = std::make_shared<transport::Bucket>();
    bucket->version = version;
    bucket->manifest = manifest;
    bucket->location = transport::BucketLocation::kDevice;
    bucket->device.data = arena_->base() + offsets_[i];
    bucket->device.device = memory_->options_.device;
    bucket->device.ready = arena_->sealed.get();
    for (size_t r = 0; r < transport::kMaxDeviceReaders; ++r) {
      bucket->device.reader_done[r] = arena_->readers[r].get();
    }
    bucket->device.done = bucket->device.reader_done[0];
    const int device = memory_->options_.device;
    const uint8_t* data = bucket->device.data;
    const std::shared_ptr<Arena> arena = arena_;  // alive while the bucket is
    bucket->device.copy_to_host =
        [device, data, version, manifest,
         arena]() -> absl::StatusOr<std::shared_ptr<const transport::Bucket>> {
      auto host = std::make_shared<transport::Bucket>();
      host->version = version;
      host->manifest = manifest;
      host->bytes.resize(manifest.nbytes);
      WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      // The arena is sealed: nothing writes it until it is staged into again, which needs this
      // version gone. One blocking copy.
      WPUB_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(host->bytes.data(), data, manifest.nbytes, cudaMemcpyDeviceToHost));
      return std::shared_ptr<const transport::Bucket>(std::move(host));
    };
    return std::shared_ptr<const transport::Bucket>(std::move(bucket));
  }

 private:
  bool sealed() const {
    std::lock_guard lock(mu_);
    return sealed_;
  }
  uint32_t staged_count() const {
    std::lock_guard lock(mu_);
    return staged_;
  }
  // Bucket i's copy event once Stage enqueued it (it may still run), waiting up to `wait`.
  absl::StatusOr<cudaEvent_t> WaitStaged(uint32_t i, absl::Duration wait) {
    std::unique_lock lock(mu_);
    if (!staged_cv_.wait_for(lock, absl::ToChronoNanoseconds(wait),
                             [&] { return staged_ > i || abandoned_; }) ||
        staged_ <= i) {
      return absl::DeadlineExceededError(absl::StrCat(
          "retained memory: bucket ", i,
          abandoned_ ? " will not be copied (the staging stopped)" : " was not copied in time"));
    }
    return copied_[i].get();
  }

  const std::shared_ptr<GpuRetainedMemory> memory_;
  const std::shared_ptr<Arena> arena_;
  std::vector<uint64_t> offsets_, sizes_;
  std::vector<bool> host_summed_;  // staged from host bytes into pinned memory (Stage's thread)
  mutable std::mutex mu_;          // Stage / Seal against Patch, HostCopy, Emit
  std::condition_variable staged_cv_;
  std::vector<kernels::cuda::Event> copied_;  // per staged bucket: its copy done (guarded by mu_)
  uint32_t staged_ = 0;                       // guarded by mu_
  bool sealed_ = false;                       // guarded by mu_
  bool abandoned_ = false;                    // guarded by mu_
};

absl::StatusOr<std::shared_ptr<GpuRetainedMemory>> GpuRetainedMemory::Create(
    RetainedMemoryOptions options) {
  if (options.where != transport::RetainWhere::kDevice &&
      options.where != transport::RetainWhere::kPinned) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU retained memory: where must be device or "
                     "pinned, not ",
                     transport::RetainWhereName(options.where)));
  }
  if (const cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("retained copy: CUDA device ", options.device,
                                                      " is not usable: ", cudaGetErrorString(e)));
  }
  std::shared_ptr<GpuRetainedMemory> m(new GpuRetainedMemory(options));
  WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Stream::Create(&m->stream_));
  for (int k = 0; k < 2; ++k) {
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &m->bounce_ready_[k]));
    for (kernels::cuda::Event& e : m->bounce_done_[k]) {
      WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &e));
    }
  }
  return m;
}

GpuRetainedMemory::~GpuRetainedMemory() {
  if (stream_.get() != nullptr) {
    (void)cudaSetDevice(options_.device);
    (void)stream_.Synchronize();
  }
}

absl::StatusOr<std::shared_ptr<transport::RetainedBytes>> GpuRetainedMemory::Reserve(
    const transport::PublicationManifest& manifest) {
  uint64_t total = 0;
  for (const transport::BucketManifest& b : manifest.buckets) total = Align(total + b.nbytes);
  const size_t n = manifest.buckets.size();
  std::lock_guard lock(mu_);
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  // A free arena (held by nothing but this list), the largest first. Holders are the
  // RetainedBytes of a version (the retained copy, a replay or a patch being made); use_count
  // reads 1 only once the last of them let go, and every read of the arena they made is
  // stream-ordered before the next staging (the readers' events) or finished on the host
  // (HostCopy, copy_to_host) before they let go.
  // A patch or replay still holding an older version keeps its arena: with two held, Reserve
  // refuses and that version is not retained.
  std::shared_ptr<Arena> arena;
  for (const std::shared_ptr<Arena>& a : arenas_) {
    if (a.use_count() == 1 && (arena == nullptr || a->capacity() > arena->capacity())) arena = a;
  }
  if (arena == nullptr) {
    if (arenas_.size() >= 2) {
      return absl::ResourceExhaustedError(
          "both retained buffers are held (the retained version and a replay still reading an "
          "older one)");
    }
    arena = std::make_shared<Arena>();
    arena->in_pinned = options_.where == transport::RetainWhere::kPinned;
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &arena->sealed));
    for (kernels::cuda::Event& e : arena->readers) {
      WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &e));
    }
    arenas_.push_back(arena);
  }
  if (arena->capacity() < total) {
    // Every earlier read or write of it completed before it was freed (cudaFree synchronizes).
    arena->device.Reset();
    arena->pinned.Reset();
    if (options_.where == transport::RetainWhere::kDevice) {
      if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(total, &arena->device);
          e != cudaSuccess) {
        return Exhausted(e, total, "device memory for the retained copy");
      }
    } else {
      if (const cudaError_t e = kernels::cuda::PinnedHostBuffer::Create(total, &arena->pinned);
          e != cudaSuccess) {
        return Exhausted(e, total, "pinned host memory for the retained copy");
      }
    }
  }
  const uint64_t sums_bytes = std::max<uint64_t>(n, 1) * sizeof(uint64_t);
  if (arena->sums.size() < sums_bytes) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(sums_bytes, &arena->sums);
        e != cudaSuccess) {
      return Exhausted(e, sums_bytes, "device memory for the retained copy's checksums");
    }
    if (const cudaError_t e =
            kernels::cuda::PinnedHostBuffer::Create(sums_bytes, &arena->sums_host);
        e != cudaSuccess) {
      return Exhausted(e, sums_bytes, "pinned memory for the retained copy's checksums");
    }
  }
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(arena->sums.data(), 0, sums_bytes, stream_.get()));
  return std::shared_ptr<transport::RetainedBytes>(
      std::make_shared<Version>(shared_from_this(), std::move(arena), manifest));
}

uint64_t GpuRetainedMemory::held_bytes() const {
  uint64_t held = 0;
  {
    std::lock_guard lock(mu_);
    held = bounce_[0].size() + bounce_[1].size();
    for (const std::shared_ptr<Arena>& a : arenas_) held += a->capacity();
  }
  {
    std::lock_guard lock(diff_mu_);
    held += diff_patch_.size() + diff_scratch_.size();
  }
  std::lock_guard lock(bcast_mu_);
  return held + bcast_patch_[0].size() + bcast_patch_[1].size() + bcast_scratch_.size() +
         bcast_aligned_.size();
}

absl::StatusOr<transport::DevicePatch> GpuRetainedMemory::DiffForBroadcast(
    const uint8_t* base, const transport::Bucket& next, uint64_t base_checksum,
    uint64_t next_checksum, double max_patch_fraction) {
  const uint64_t n = next.manifest.nbytes;
  // DiffBucket sends the bucket whole when the patch's size > fraction * n: the capacity is
  // that limit, so a diff that does not fit is one DiffBucket would send whole too.
  const uint64_t capacity = static_cast<uint64_t>(
      std::floor(std::clamp(max_patch_fraction, 0.0, 1.0) * static_cast<double>(n)));
  const uint64_t scratch = kernels::cuda::BucketDiffScratchBytes(n, capacity);
  constexpr uint64_t kTotals = sizeof(kernels::cuda::BucketDiffTotals);
  std::lock_guard lock(bcast_mu_);
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (bcast_stream_.get() == nullptr) {
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Stream::Create(&bcast_stream_));
    for (int k = 0; k < 2; ++k) {
      WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &bcast_ready_[k]));
      WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Event::Create(/*timing=*/false, &bcast_done_[k]));
    }
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(kTotals, &bcast_totals_device_);
        e != cudaSuccess) {
      return Exhausted(e, kTotals, "device memory for a patch's totals");
    }
    if (const cudaError_t e = kernels::cuda::PinnedHostBuffer::Create(kTotals, &bcast_totals_);
        e != cudaSuccess) {
      return Exhausted(e, kTotals, "pinned memory for a patch's totals");
    }
  }
  const int k = static_cast<int>(bcast_next_++ % 2);
  const transport::DeviceBytes& d = next.device;
  // Grown to the largest bucket's needs and kept (held_bytes): the first patched publication,
  // or a larger bucket. Freeing a smaller buffer waits for the device (cudaFree: its last
  // reader is done), a wait counted in the publication as the size's is.
  const uint64_t want = std::max<uint64_t>(capacity, 8);
  const bool aligned = reinterpret_cast<uintptr_t>(d.data) % 16 == 0;
  if (d.count_host_wait && ((bcast_patch_[k].size() < want && bcast_patch_[k].size() > 0) ||
                            (bcast_scratch_.size() < scratch && bcast_scratch_.size() > 0) ||
                            (!aligned && bcast_aligned_.size() < n && bcast_aligned_.size() > 0))) {
    d.count_host_wait();
  }
  if (bcast_patch_[k].size() < want) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(want, &bcast_patch_[k]);
        e != cudaSuccess) {
      return Exhausted(e, want, "device memory for a broadcast patch");
    }
  }
  if (bcast_scratch_.size() < scratch) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(scratch, &bcast_scratch_);
        e != cudaSuccess) {
      return Exhausted(e, scratch, "device memory for a bucket diff");
    }
  }
  // The diff reads whole words: a bucket the producer packed at an offset that is not a multiple
  // of 16 bytes is first copied to an aligned buffer (a device copy of n bytes; kept, counted).
  if (!aligned && bcast_aligned_.size() < n) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(n, &bcast_aligned_);
        e != cudaSuccess) {
      return Exhausted(e, n, "device memory for an aligned copy of a bucket to diff");
    }
  }
  const cudaStream_t s = bcast_stream_.get();
  const absl::Status diffed = [&]() -> absl::Status {
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, d.ready, 0));
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, bcast_done_[k].get(), 0));
    const uint8_t* bucket = d.data;
    if (!aligned) {
      WPUB_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(bcast_aligned_.data(), d.data, n, cudaMemcpyDeviceToDevice, s));
      bucket = bcast_aligned_.as<uint8_t>();
    }
    if (const cudaError_t e = kernels::cuda::LaunchBucketDiffIndexed(
            base, bucket, n, base_checksum, next_checksum, bcast_patch_[k].as<uint8_t>(), capacity,
            bcast_scratch_.data(), bcast_scratch_.size(),
            bcast_totals_device_.as<kernels::cuda::BucketDiffTotals>(), s);
        e != cudaSuccess) {
      const auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 256; };
      return absl::InternalError(
          absl::StrCat("the device patch of bucket ", next.manifest.index, " (", n,
                       " bytes, capacity ", capacity, ", scratch ", bcast_scratch_.size(),
                       "; base, bucket and patch at ", at(base), ", ", at(bucket), ", ",
                       at(bcast_patch_[k].data()), " mod 256): ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }();
  // Behind whatever of the diff was enqueued: the producer reuses its buffer only after it.
  if (d.done != nullptr) WPUB_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.done, s));
  WPUB_RETURN_IF_ERROR(diffed);
  WPUB_CUDA_RETURN_IF_ERROR(bcast_ready_[k].Record(s));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bcast_totals_.data(), bcast_totals_device_.data(),
                                            kTotals, cudaMemcpyDeviceToHost, s));
  HostSyncs wait(nullptr);  // counted in the producer's publication below
  if (d.count_host_wait) d.count_host_wait();
  WPUB_RETURN_IF_ERROR(wait.StreamSynchronize(s, "device patch size"));
  const auto* totals = bcast_totals_.as<const kernels::cuda::BucketDiffTotals>();
  transport::DevicePatch out;
  out.changed_words = totals->changed_words;
  out.runs = static_cast<uint32_t>(std::min<unsigned long long>(totals->runs, UINT32_MAX));
  if (totals->written != 1) {
    out.why = absl::StrCat("a patch would be ", totals->patch_bytes, " bytes, over ",
                           max_patch_fraction, " of the bucket's ", n);
    return out;
  }
  auto patch = std::make_shared<transport::Bucket>();
  patch->version = next.version;
  patch->manifest.index = next.manifest.index;
  patch->manifest.nbytes = totals->patch_bytes;
  patch->location = transport::BucketLocation::kDevice;
  patch->device.data = bcast_patch_[k].as<uint8_t>();
  patch->device.device = options_.device;
  patch->device.ready = bcast_ready_[k].get();
  patch->device.done = bcast_done_[k].get();
  patch->device.reader_done[0] = bcast_done_[k].get();
  out.made = true;
  out.patch = std::move(patch);
  return out;
}

absl::StatusOr<transport::RetainedPatch> GpuRetainedMemory::Diff(
    const uint8_t* base, const uint8_t* next, uint64_t n, cudaEvent_t next_copied,
    uint64_t base_checksum, uint64_t next_checksum, double max_patch_fraction) {
  // DiffBucket sends the bucket whole when the patch's size > fraction * n: for an integer
  // size, exactly when it is over floor(fraction * n). The device writes xor runs (format 1),
  // turned into units (format 2) here; its capacity holds the xor runs of every patch within
  // that limit (delta::XorRunsCapacity), so a diff that does not fit is one DiffBucket would
  // send whole too.
  const double limit = std::clamp(max_patch_fraction, 0.0, 1.0) * static_cast<double>(n);
  const uint64_t capacity = delta::XorRunsCapacity(n, static_cast<uint64_t>(std::floor(limit)));
  const uint64_t scratch = kernels::cuda::BucketDiffScratchBytes(n, capacity);
  std::unique_lock lock(diff_mu_);  // the device buffers; released before the host's transcode
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  constexpr uint64_t kTotals = sizeof(kernels::cuda::BucketDiffTotals);
  if (diff_stream_.get() == nullptr) {
    WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::Stream::Create(&diff_stream_));
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(kTotals, &diff_totals_device_);
        e != cudaSuccess) {
      return Exhausted(e, kTotals, "device memory for a patch's totals");
    }
    if (const cudaError_t e = kernels::cuda::PinnedHostBuffer::Create(kTotals, &diff_totals_);
        e != cudaSuccess) {
      return Exhausted(e, kTotals, "pinned memory for a patch's totals");
    }
  }
  // Grown to the largest bucket's needs, kept for the next ones (held_bytes counts them).
  if (diff_patch_.size() < std::max<uint64_t>(capacity, 1)) {
    if (const cudaError_t e =
            kernels::cuda::DeviceBuffer::Create(std::max<uint64_t>(capacity, 1), &diff_patch_);
        e != cudaSuccess) {
      return Exhausted(e, capacity, "device memory for a bucket patch");
    }
  }
  if (diff_scratch_.size() < scratch) {
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(scratch, &diff_scratch_);
        e != cudaSuccess) {
      return Exhausted(e, scratch, "device memory for a bucket diff");
    }
  }
  const cudaStream_t s = diff_stream_.get();
  WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, next_copied, 0));
  WPUB_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchBucketDiff(
      base, next, n, base_checksum, next_checksum, diff_patch_.as<uint8_t>(), capacity,
      diff_scratch_.data(), diff_scratch_.size(),
      diff_totals_device_.as<kernels::cuda::BucketDiffTotals>(), s, /*xor_runs=*/true));
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(diff_totals_.data(), diff_totals_device_.data(),
                                            kTotals, cudaMemcpyDeviceToHost, s));
  const auto* totals = diff_totals_.as<const kernels::cuda::BucketDiffTotals>();
  HostSyncs uncounted(nullptr);  // a receiver's read, off the publication's thread
  WPUB_RETURN_IF_ERROR(uncounted.StreamSynchronize(s, "bucket diff"));
  transport::RetainedPatch out;
  out.changed_words = totals->changed_words;
  out.runs = static_cast<uint32_t>(std::min<unsigned long long>(totals->runs, UINT32_MAX));
  if (totals->written != 1) {
    out.why = absl::StrCat("a patch would be over ", max_patch_fraction, " of the bucket's ", n,
                           " bytes (", totals->changed_words, " words changed)");
    return out;
  }
  std::vector<uint8_t> xor_runs(totals->patch_bytes);
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(xor_runs.data(), diff_patch_.data(), xor_runs.size(),
                                            cudaMemcpyDeviceToHost, s));
  WPUB_RETURN_IF_ERROR(uncounted.StreamSynchronize(s, "bucket patch read-back"));
  lock.unlock();
  absl::StatusOr<delta::BucketPatchPlan> units =
      delta::UnitsFromXorRuns(xor_runs, max_patch_fraction, options_.host_threads);
  if (!units.ok()) {
    return absl::InternalError(
        absl::StrCat("the device's bucket diff is malformed: ", units.status().message()));
  }
  out.changed_units = units->changed_units;
  if (units->full) {
    out.why = std::move(units->why);
    return out;
  }
  out.made = true;
  out.bytes = std::move(units->patch);
  return out;
}

absl::StatusOr<std::shared_ptr<const transport::Bucket>> GpuRetainedMemory::EmitThroughBounce(
    const std::shared_ptr<Arena>& arena, uint64_t offset, uint64_t version,
    const transport::BucketManifest& manifest) {
  std::lock_guard lock(mu_);
  WPUB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const int k = static_cast<int>(manifest.index % 2);
  const uint64_t n = manifest.nbytes;
  const cudaStream_t s = stream_.get();
  if (bounce_[k].size() < n) {
    // cudaFree waits for the device: no reader still uses the smaller buffer.
    if (const cudaError_t e = kernels::cuda::DeviceBuffer::Create(n, &bounce_[k]);
        e != cudaSuccess) {
      return Exhausted(e, n, "device memory for the retained copy's bounce buffer");
    }
  }
  // Bucket index - 2 was read from this buffer: its readers must be done.
  for (const kernels::cuda::Event& e : bounce_done_[k]) {
    WPUB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, e.get(), 0));
  }
  const uint8_t* src = arena->base() + offset;
  WPUB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bounce_[k].data(), src, n, cudaMemcpyHostToDevice, s));
  WPUB_CUDA_RETURN_IF_ERROR(bounce_ready_[k].Record(s));
  auto bucket = std::make_shared<transport::Bucket>();
  bucket->version = version;
  bucket->manifest = manifest;
  bucket->location = transport::BucketLocation::kDevice;
  bucket->device.data = bounce_[k].as<const uint8_t>();
  bucket->device.device = options_.device;
  bucket->device.ready = bounce_ready_[k].get();
  for (size_t r = 0; r < transport::kMaxDeviceReaders; ++r) {
    bucket->device.reader_done[r] = bounce_done_[k][r].get();
  }
  bucket->device.done = bucket->device.reader_done[0];
  const std::shared_ptr<Arena> keep = arena;  // the pinned bytes stay while the bucket does
  bucket->device.copy_to_host =
      [src, version, manifest, keep]() -> absl::StatusOr<std::shared_ptr<const transport::Bucket>> {
    auto host = std::make_shared<transport::Bucket>();
    host->version = version;
    host->manifest = manifest;
    host->bytes.assign(src, src + manifest.nbytes);  // sealed pinned bytes: no device wait
    return std::shared_ptr<const transport::Bucket>(std::move(host));
  };
  return std::shared_ptr<const transport::Bucket>(std::move(bucket));
}

}  // namespace wpub::gpu
