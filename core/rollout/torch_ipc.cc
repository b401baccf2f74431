// TorchRefCounters and the pickled rebuild_cuda_tensor arguments (torch_ipc.h).
#include "core/rollout/torch_ipc.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/common/status.h"

namespace wpub::rollout {
namespace {

constexpr size_t kFileBytes = TorchRefCounters::kDataOffset + TorchRefCounters::kSlots * 8;

}  // namespace

absl::StatusOr<std::unique_ptr<TorchRefCounters>> TorchRefCounters::Create() {
  std::random_device rd;
  const std::string name =
      absl::StrFormat("/wpub_%d_%08x%08x", static_cast<int>(getpid()), rd(), rd());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("shm_open(", name, ") for CUDA IPC reference counters: ", strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(kFileBytes)) != 0) {
    const int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::InternalError(absl::StrCat("ftruncate(", name, "): ", strerror(e)));
  }
  void* base = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::InternalError(absl::StrCat("mmap(", name, "): ", strerror(e)));
  }
  // The owner's mapping count: receivers add and remove theirs, and never reach 0 while it is 1.
  new (base) std::atomic<int>(1);
  return std::unique_ptr<TorchRefCounters>(new TorchRefCounters(name, base));
}

TorchRefCounters::~TorchRefCounters() {
  munmap(base_, kFileBytes);
  shm_unlink(name_.c_str());
}

std::atomic<int64_t>* TorchRefCounters::Slot(size_t slot) const {
  return reinterpret_cast<std::atomic<int64_t>*>(static_cast<char*>(base_) + kDataOffset +
                                                 8 * (slot % kSlots));
}

void TorchRefCounters::Set(size_t slot, int64_t value) {
  Slot(slot)->store(value, std::memory_order_release);
}

int64_t TorchRefCounters::Get(size_t slot) const {
  return Slot(slot)->load(std::memory_order_acquire);
}

absl::Status WriteRebuildArgs(const SharedTensor& t, PickleWriter& w, absl::string_view device,
                              size_t* ref_counter_at) {
  const transport::SharedDeviceBytes& s = *t.shared;
  const int64_t esize = DTypeSize(t.dtype);
  int64_t numel = 1;
  for (int64_t d : t.shape) numel *= d;
  if (t.byte_offset % static_cast<uint64_t>(esize) != 0 ||
      t.byte_offset + static_cast<uint64_t>(numel * esize) > s.nbytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", DTypeName(t.dtype), " tensor of ", numel, " elements at byte ", t.byte_offset,
        " does not fit the ", s.nbytes, "-byte shared bucket at an offset its size divides"));
  }
  w.Mark();
  w.Global("torch", "Tensor");
  // torch.Size(shape), as torch pickles it.
  w.Global("torch", "Size").Mark().Mark();
  for (int64_t d : t.shape) w.Int(d);
  w.Tuple().Tuple().Reduce();
  // Contiguous strides, in elements.
  w.Mark();
  {
    std::vector<int64_t> stride(t.shape.size(), 1);
    for (size_t i = t.shape.size(); i-- > 1;) stride[i - 1] = stride[i] * t.shape[i];
    for (int64_t v : stride) w.Int(v);
  }
  w.Tuple();
  w.Int(static_cast<int64_t>(t.byte_offset / static_cast<uint64_t>(esize)));
  w.Global("torch.storage", "TypedStorage");
  w.Global("torch", DTypeName(t.dtype));
  if (device.empty()) {
    w.Int(s.device);
  } else {
    w.Str(device);
  }
  if (t.handle_form == StorageHandleForm::kVersioned) {
    w.Bytes(absl::StrCat(std::string(1, '\x02'), "c", s.mem_handle));
  } else {
    w.Bytes(s.mem_handle);
  }
  w.Int(static_cast<int64_t>(s.nbytes));
  w.Int(static_cast<int64_t>(s.offset_bytes));
  w.Bool(false);  // requires_grad
  w.Bytes(s.ref_counter);
  if (ref_counter_at != nullptr) {
    *ref_counter_at = w.Int32Slot(static_cast<int32_t>(t.ref_counter_offset));
  } else {
    w.Int(static_cast<int64_t>(t.ref_counter_offset));
  }
  w.Bytes(s.event_handle);
  w.Bool(true);  // event_sync_required: the receiver's stream waits on the event
  w.Tuple();
  return absl::OkStatus();
}

}  // namespace wpub::rollout

namespace wpub::rollout {

std::string TorchUuid(absl::string_view device_uuid) {
  absl::ConsumePrefix(&device_uuid, "GPU-");
  return absl::AsciiStrToLower(device_uuid);
}

absl::StatusOr<std::string> SglangFlattenedBucketPickle(const transport::BucketManifest& bucket,
                                                        const transport::SharedDeviceBytes& shared,
                                                        uint64_t ref_counter_offset) {
  WPUB_ASSIGN_OR_RETURN(std::vector<std::string> one,
                        SglangFlattenedBucketPickles(bucket, shared, ref_counter_offset, 1));
  return std::move(one[0]);
}

absl::StatusOr<std::vector<std::string>> SglangFlattenedBucketPickles(
    const transport::BucketManifest& bucket, const transport::SharedDeviceBytes& shared,
    uint64_t first_ref_counter_offset, int ranks) {
  if (ranks < 1 || first_ref_counter_offset + static_cast<uint64_t>(ranks) >
                       static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("bucket ", bucket.index, ": ", ranks,
                                                   " ranks from reference-counter slot ",
                                                   first_ref_counter_offset));
  }
  size_t slot_at = 0;
  PickleWriter w;
  w.Mark();
  w.Str("flattened_tensor");
  // The bucket as one uint8 tensor; its device as SGLang's patched rebuild takes it.
  SharedTensor t;
  t.shared = &shared;
  t.dtype = DType::kUInt8;
  t.shape = {static_cast<int64_t>(shared.nbytes)};
  t.ref_counter_offset = first_ref_counter_offset;
  w.Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor");
  WPUB_RETURN_IF_ERROR(WriteRebuildArgs(t, w, TorchUuid(shared.device_uuid), &slot_at));
  w.Reduce();
  w.Str("metadata");
  w.Mark();
  for (const transport::ManifestTensor& m : bucket.tensors) {
    if (m.offset + m.nbytes > shared.nbytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket ", bucket.index, " tensor ", m.name, ": bytes [", m.offset, ", ",
                       m.offset + m.nbytes, ") beyond the ", shared.nbytes, "-byte bucket"));
    }
    w.Global("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata");
    w.EmptyTuple().NewObj();
    w.Mark();
    w.Key("name").Str(m.name);
    w.Key("shape").Global("torch", "Size").Mark().Mark();
    for (int64_t d : m.shape) w.Int(d);
    w.Tuple().Tuple().Reduce();
    w.Key("dtype").Global("torch", DTypeName(m.dtype));
    w.Key("start_idx").Int(static_cast<int64_t>(m.offset));
    w.Key("end_idx").Int(static_cast<int64_t>(m.offset + m.nbytes));
    w.Key("numel").Int(static_cast<int64_t>(m.nbytes));
    w.Dict();
    w.Build();
  }
  w.List();
  w.Dict();
  std::vector<std::string> pickles(static_cast<size_t>(ranks));
  pickles[0] = w.Finish();
  for (int r = 1; r < ranks; ++r) {
    pickles[r] = pickles[0];
    PickleWriter::PatchInt32(pickles[r], slot_at,
                             static_cast<int32_t>(first_ref_counter_offset + r));
  }
  return pickles;
}

}  // namespace wpub::rollout

namespace wpub::rollout {

std::string VllmPackedHandlesPickle(const transport::SharedDeviceBytes& shared,
                                    uint64_t ref_counter_offset) {
  PickleWriter w;
  w.Mark();
  SharedTensor t;
  t.shared = &shared;
  t.dtype = DType::kUInt8;
  t.shape = {static_cast<int64_t>(shared.nbytes)};
  t.ref_counter_offset = ref_counter_offset;
  for (const std::string& uuid : shared.node_device_uuids) {
    w.Str(TorchUuid(uuid));
    // Cannot fail: a uint8 tensor over the whole bucket fits it.
    (void)WriteRebuildArgs(t, w);
  }
  w.Dict();
  return w.Finish();
}

}  // namespace wpub::rollout
