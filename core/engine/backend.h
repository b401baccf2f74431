// The executor's backend interface: given a publication's resolved inputs, the policy's
// quantization groups and the bucket layout, a backend computes global amax/scales, quantizes
// and packs every bucket and hands each finished bucket to the transport (in index order).
// The CPU backend (cpu_backend.h) runs the kernels' CPU reference; the GPU backend pipelines
// buckets on streams (quantize bucket k+1 while bucket k is on the wire) behind the same call.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/common/tensor.h"
#include "core/engine/inputs.h"
#include "core/engine/types.h"
#include "core/transport/planner.h"
#include "core/transport/transport.h"
#include "kernels/nvfp4.h"

namespace wpub::engine {

// Counts synchronizing device calls (cudaStreamSynchronize, cudaMemcpy to the host, ...). The
// GPU backend routes every such call through Add(); the CPU backend never calls it. Thread-safe.
class SyncCounter {
 public:
  void Add(uint64_t n = 1) { count_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> count_{0};
};

// Maps CUDA IPC parts to device pointers (the GPU path's IPC mapping cache). The engine calls
// Resolve on a publication's producer thread while it adds batches, and EndPublication when the
// next publication opens and when the engine is destroyed -- never while a publication that
// resolved pointers may still execute -- all serialized by the engine. A pointer stays valid
// until the following EndPublication.
class CudaIpcResolver {
 public:
  virtual ~CudaIpcResolver() = default;
  // Errors name `tensor` (stale or foreign handle, range beyond the allocation, ...).
  virtual absl::StatusOr<const uint8_t*> Resolve(const CudaIpcSource& source,
                                                 uint64_t expected_bytes,
                                                 absl::string_view tensor) = 0;
  virtual void EndPublication() = 0;
};

// Inputs sharing one global amax (a gate/up pair, or a single tensor), per slice for stacks.
struct AmaxGroupPlan {
  std::vector<size_t> members;  // indices into ExecutionPlan::inputs
  int64_t slices = 1;
};

// Where an output's bytes come from.
enum class OutputKind : uint8_t {
  kPassthrough,  // the input's bytes, parts gathered
  kPacked,       // NVFP4 codes of the input        uint8 [.., M, K/2]
  kScales,       // its block scales                float8_e4m3fn [.., M, K/16]
  kDecodeScale,  // its weight_scale_2              float32 [] or [E]
};

struct OutputSource {
  OutputKind kind = OutputKind::kPassthrough;
  size_t input = 0;     // index into ExecutionPlan::inputs
  int amax_group = -1;  // quantized outputs only
};

// Everything a backend needs for one publication. Borrowed by Execute; immutable during it.
struct ExecutionPlan {
  uint64_t version = 0;
  kernels::QuantMode mode = kernels::QuantMode::Standard();
  bool allow_non_finite = false;
  const std::vector<InputTensor>* inputs = nullptr;
  std::vector<AmaxGroupPlan> amax_groups;
  std::vector<TensorDesc> outputs;               // publication order
  std::vector<OutputSource> sources;             // parallel to outputs
  std::vector<transport::BucketLayout> buckets;  // from PlanBuckets
};

struct ExecutionHooks {
  // Hands a packed bucket to the transports, in index order, wherever it lives (bucket.h): the
  // CPU backend emits host buckets (checksum filled in), the GPU backend device buckets (its
  // staging buffer, with the events and the host copy the transport group may ask for). The
  // engine measures its time as the transfer phase and counts the bucket's bytes. A non-OK
  // status stops Execute, which returns it.
  std::function<absl::Status(std::shared_ptr<const transport::Bucket>)> emit;
  // Polled between units of work; when it returns true Execute stops with CANCELLED.
  std::function<bool()> cancelled;
  SyncCounter* syncs = nullptr;  // never null
};

struct ExecutionResult {
  uint64_t non_finite = 0;  // non-finite input elements seen (quantized and passed tensors)
  double quantize_seconds = 0;
  double pack_seconds = 0;
};

// Implementations are thread-compatible: the engine runs one publication at a time.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Runs the whole plan. Before the first bucket is emitted it computes every global amax and
  // counts non-finite elements; unless plan.allow_non_finite, a non-finite element rejects the
  // publication with INVALID_ARGUMENT naming the tensor (nothing emitted). Blocking.
  virtual absl::StatusOr<ExecutionResult> Execute(const ExecutionPlan& plan,
                                                  const ExecutionHooks& hooks) = 0;
  // Frees the memory it keeps between publications (the GPU backend's staging buffers and
  // scratch), so that an engine colocated on the same GPU can use it; the next Execute allocates
  // it again. Called by the engine on the thread that ends a publication, as it ends (its
  // transports committed or aborted, or it never reached Commit) and before the next one can
  // begin -- never during Execute -- when EngineOptions::release_backend_memory or the
  // publication's header asks for it. Returns the bytes freed. Default: nothing kept.
  virtual uint64_t ReleaseMemory() { return 0; }
  // The memory it keeps now between publications (device and pinned host buffers), as of the
  // last Execute or ReleaseMemory: what a colocated engine cannot use. Any thread (the status
  // and metrics read it while a publication runs). Default: nothing kept.
  virtual uint64_t held_bytes() const { return 0; }
};

}  // namespace wpub::engine
