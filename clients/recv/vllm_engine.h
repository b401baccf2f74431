// A C++ engine that speaks vLLM's weight-transfer protocol (the dev-mode HTTP routes of `vllm
// serve --weight-transfer-config '{"backend":"nccl"}'`, v0.22 and later; docs/specs/engines.md,
// "vLLM"): what wpub-recv --engine_listen --engine_protocol=vllm serves, and what the CPU tests
// of the vLLM driver publish to. It keeps the engine's side of the protocol -- the routes, their
// bodies, their order and the weights an engine holds after each of them -- and leaves the bytes
// to a VllmDataPath: NCCL on the GPU build (clients/recv/nccl/vllm_nccl_path.h), an in-process
// channel in tests.
//
// Lifecycle, as a vLLM engine keeps it:
//   POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
//        world_size[, packed, packed_buffer_size_bytes, packed_num_buffers]}}  -> DataPath::Join
//   POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused
//   POST /start_weight_update [{...}]        an update begins (one at a time)
//   POST /update_weights {"update_info": {names, dtype_names, shapes[, packed...]}}
//        -> the tensors' bytes, in vLLM's packed chunks (VllmChunks) or one broadcast per tensor
//   POST /finish_weight_update [{"weight_version": "V"}]   what the update received is applied
// A finish after an update that received nothing keeps the previous weights; one after a partial
// update applies what arrived (the engine then holds a mix, reported by state().mixed), which is
// why a publisher must never resume such an engine. With VllmEngineOptions::packing_in_init
// false the engine behaves as v0.22-v0.27: init refuses the packing fields (HTTP 400 "Invalid
// init_info") and each update carries them (packed false or absent: one broadcast per tensor).
// Failures answer vLLM's error shape, HTTP 4xx/5xx {"error": {"message", "type", "code"}};
// successes 200 {"message": ...}. Also: GET /health, GET /weight_info {"weight_version"}.
//
// Threading: the HTTP server runs on its own threads; requests are handled one at a time (one
// lock over the lifecycle and the data path), as vLLM's engine core runs them. Public methods
// are thread-safe. Destruction aborts the data path and stops the server.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "clients/recv/vllm_wire.h"
#include "core/engine/types.h"

namespace wpub::recv {

// Where an engine's bytes come from.
class VllmDataPath {
 public:
  virtual ~VllmDataPath() = default;
  // /init_weight_transfer_engine: joins the publisher's group (the rendezvous and the warm-up
  // all-reduce), leaving any previous one. Returns when this engine's ranks are ready.
  virtual absl::Status Join(const VllmInitInfo& init) = 0;
  // One /update_weights: receives update.chunks in order into *bytes (update.nbytes long).
  virtual absl::Status Receive(const VllmUpdate& update, std::vector<uint8_t>* bytes) = 0;
  // Ends a Join or Receive blocked on another thread (destruction, a new init). Any thread.
  virtual void Abort() = 0;
};

struct VllmEngineOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port (port() says which)
  // true: v0.28+ (packing fields in init_info). false: v0.22-v0.27 (packing per update).
  bool packing_in_init = true;
  // The --weight-transfer-config backend the engine reports (GET /server_info?config_format=json,
  // vllm_config.weight_transfer_config.backend). "sparse_nccl" also decodes update_info as that
  // backend's SparseNCCLWeightTransferUpdateInfo: a body without `num_updates_list`, or with a
  // key the dataclass lacks (`packed`...), is the worker's "Invalid update_info for
  // SparseNCCLWeightTransferEngine: ..." (HTTP 500). "" plays an engine started without
  // --weight-transfer-config: a null config, every weight route "Weight transfer not configured"
  // (HTTP 500). The bytes of this engine are
  // always NCCL's.
  std::string weight_transfer_backend = "nccl";
};

// What the engine holds and where its lifecycle stands (state()).
struct VllmEngineState {
  bool joined = false;
  bool paused = false;
  std::string pause_mode;          // of the last /pause
  bool pause_clear_cache = false;  // ... and its clear_cache
  bool updating = false;           // between start and finish
  uint64_t updates = 0;            // /update_weights received in the current (or last) update
  // The last finish's weight_version ("" when it gave none), and whether what the engine holds
  // mixes versions: a finish applied a partial update (one without a weight_version after
  // receiving something) or a later complete one has not replaced it.
  std::string weight_version;
  bool mixed = false;
  std::map<std::string, std::pair<TensorDesc, std::vector<uint8_t>>> weights;
  std::vector<std::string> calls;  // every request, "POST /path[?mode=m]", in order
};

class VllmEngine {
 public:
  struct Callbacks {
    // After every update's bytes arrived (index: within the update).
    std::function<void(uint64_t index, const VllmUpdate&)> on_update;
    // After a finish applied a complete update (one with a weight_version).
    std::function<void(const VllmEngineState&)> on_version;
  };
  // Binds and serves. UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<VllmEngine>> Start(const VllmEngineOptions& options,
                                                           std::unique_ptr<VllmDataPath> data,
                                                           Callbacks callbacks = {});
  ~VllmEngine();
  VllmEngine(const VllmEngine&) = delete;
  VllmEngine& operator=(const VllmEngine&) = delete;

  int port() const;
  std::string url() const;
  VllmEngineState state() const;
  // Fault injection: the `index`th /update_weights of the next update (0 = its first) fails as a
  // loader error after its bytes arrived, half of its tensors loaded (HTTP 500; the worker then
  // leaves the update). Once.
  void FailUpdateAt(int64_t index);

 private:
  class Impl;
  explicit VllmEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wpub::recv
