// The producer's side of torch's CUDA tensor sharing, for engines that take weights as CUDA IPC
// tensors pickled by the trainer (SGLang's /update_weights_from_tensor, vLLM's IPC weight
// transfer): the pickled `rebuild_cuda_tensor` call a receiver's `pickle.loads` turns into a
// tensor over wpub's device memory, and the shared-memory reference counters through which the
// receiver says it no longer reads that memory. Facts from torch's own code
// (torch/multiprocessing/reductions.py, torch/csrc/StorageSharing.cpp THPStorage_newSharedCuda,
// torch/csrc/CudaIPCTypes.cpp, aten/src/ATen/MapAllocator.cpp; docs/specs/engines.md,
// "Colocated engines"). No CUDA here: handles are bytes (transport::SharedDeviceBytes).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/common/tensor.h"
#include "core/rollout/pickle_writer.h"
#include "core/transport/group_channel.h"

namespace wpub::rollout {

// The int64 counters a receiving torch decrements once per storage it rebuilt, when that storage
// is freed -- after it synchronized its stream, so the bytes were read. A POSIX shared-memory
// object laid out as torch's RefcountedMapAllocator lays one out: an int32 mapping count at byte 0
// (receivers add 1 while they have it open, and unlink the file when the count falls to 0: the
// owner's own 1 keeps it), the counters from byte 64 on (CUDA_IPC_REF_COUNTER_FILE_SIZE of them).
// The owner sets a slot to the number of storages receivers will rebuild from one export, and
// the slot is back at 0 once every one of them was freed. Thread-compatible; unlinked on
// destruction.
class TorchRefCounters {
 public:
  static constexpr size_t kSlots = 10000;    // torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
  static constexpr size_t kDataOffset = 64;  // ATen's map_alloc_alignment
  // A new object named "/wpub_<pid>_<random>". INTERNAL with errno's text when shm fails.
  static absl::StatusOr<std::unique_ptr<TorchRefCounters>> Create();
  ~TorchRefCounters();
  TorchRefCounters(const TorchRefCounters&) = delete;
  TorchRefCounters& operator=(const TorchRefCounters&) = delete;

  const std::string& name() const { return name_; }
  void Set(size_t slot, int64_t value);
  int64_t Get(size_t slot) const;

 private:
  TorchRefCounters(std::string name, void* base) : name_(std::move(name)), base_(base) {}
  std::atomic<int64_t>* Slot(size_t slot) const;
  std::string name_;
  void* base_ = nullptr;
};

// How the receiving torch expects the storage handle (c10 CUDACachingAllocator: a raw 64-byte
// cudaIpcMemHandle_t is read as the legacy form by every release that versions it).
enum class StorageHandleForm : uint8_t {
  kRaw,        // the 64 bytes
  kVersioned,  // [version byte 2]['c'][64 bytes]
};

// One CUDA tensor over `shared` as torch's reduce_tensor describes it: a contiguous tensor of
// `dtype` and `shape` starting `byte_offset` bytes into the shared bucket, whose storage is the
// whole bucket. `device` is the index written into the arguments (receivers that rebuild with
// their own device overwrite it), `ref_counter_offset` the slot the receiver decrements.
struct SharedTensor {
  const transport::SharedDeviceBytes* shared = nullptr;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  uint64_t byte_offset = 0;  // a multiple of the dtype's size
  uint64_t ref_counter_offset = 0;
  StorageHandleForm handle_form = StorageHandleForm::kRaw;
};

// Writes the 15 arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor for `t` as one
// tuple (MARK ... TUPLE): (torch.Tensor, shape, stride, offset in elements, torch.storage.
// TypedStorage, dtype, device, storage handle, storage size bytes, storage offset bytes, False,
// ref counter name, ref counter offset, event handle, event_sync_required=True).
// The dtype is torch's attribute of DTypeName's name. INVALID_ARGUMENT for an offset that is not
// a multiple of the dtype's size or a tensor that does not fit in the bucket.
// `device`: written as the device argument instead of the index (SGLang's UUID); empty: the
// shared bytes' device index.
// `ref_counter_at`: when given, the reference-counter slot is written as PickleWriter::Int32Slot
// and *ref_counter_at says where, for copies of the pickle that name other slots.
absl::Status WriteRebuildArgs(const SharedTensor& t, PickleWriter& w, absl::string_view device = "",
                              size_t* ref_counter_at = nullptr);

}  // namespace wpub::rollout

namespace wpub::rollout {

// The device argument of a shared tensor as SGLang's patched torch reductions take it
// (sglang/srt/utils/patch_torch.py, _device_from_maybe_uuid): torch's str(uuid) form, lowercase
// 8-4-4-4-12 hex without nvidia-smi's "GPU-" prefix, so each receiving rank finds the device
// whatever CUDA_VISIBLE_DEVICES it runs with.
std::string TorchUuid(absl::string_view device_uuid);

// One rank's entry of SGLang's /update_weights_from_tensor with load_format "flattened_bucket"
// (serialized_named_tensors[tp_rank], before base64): the pickle of
//   {"flattened_tensor": <uint8 CUDA tensor over the whole bucket>,
//    "metadata": [FlattenedTensorMetadata(name, torch.Size(shape), dtype, start_idx, end_idx,
//                                         numel) per tensor, in byte offsets]}
// as SGLang's multi-dtype FlattenedTensorBucket (sglang/srt/weight_sync/tensor_bucket.py,
// supports_multi_dtypes) rebuilds it: tensor i is flattened_tensor[start:end].view(dtype)
// .reshape(shape). Every global it names is in SGLang's SafeUnpickler allowlist (torch.*,
// sglang.srt.weight_sync.tensor_bucket.*); the tensor's device is the UUID (TorchUuid) and its
// reference-counter slot `ref_counter_offset`. INVALID_ARGUMENT naming the tensor for one that
// does not fit the bucket.
absl::StatusOr<std::string> SglangFlattenedBucketPickle(const transport::BucketManifest& bucket,
                                                        const transport::SharedDeviceBytes& shared,
                                                        uint64_t ref_counter_offset);

// The entries of `ranks` TP ranks: rank r's is SglangFlattenedBucketPickle's with slot
// `first_ref_counter_offset + r`, byte for byte. The pickle is written once and copied with each
// rank's slot (a bucket of 3,300 tensors: ~2.6 ms to write, the copies microseconds).
absl::StatusOr<std::vector<std::string>> SglangFlattenedBucketPickles(
    const transport::BucketManifest& bucket, const transport::SharedDeviceBytes& shared,
    uint64_t first_ref_counter_offset, int ranks);

}  // namespace wpub::rollout

namespace wpub::rollout {

// vLLM's packed IPC handles of one bucket (update_info.ipc_handles_pickled before base64, the
// IPC weight-transfer backend from v0.22: vllm/distributed/weight_transfer/ipc_engine.py,
// packed_tensor.py): the pickle of {torch UUID of every GPU in shared.node_device_uuids: the 15
// rebuild_cuda_tensor arguments of one uint8 tensor over the whole bucket}. Every worker takes the
// entry of its own GPU, writes its device index over argument 6, rebuilds the tensor and splits it
// by tensor_sizes (the bucket's tensors back to back). Each entry names reference-counter slot
// `ref_counter_offset`.
std::string VllmPackedHandlesPickle(const transport::SharedDeviceBytes& shared,
                                    uint64_t ref_counter_offset);

}  // namespace wpub::rollout
