// VllmEngine (vllm_engine.h): vLLM's weight-transfer routes (cpp-httplib) and the lifecycle an
// engine keeps between them, over a VllmDataPath. The request bodies are vllm_wire.cc's.
#include "clients/recv/vllm_engine.h"

#include <httplib.h>

#include <mutex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "clients/recv/engine_listener.h"
#include "core/common/json_bounds.h"
#include "core/common/status.h"
#include "core/common/tensor.h"
#include "core/transport/checksum.h"
#include "nlohmann/json.hpp"

namespace wpub::recv {
namespace {

using json = nlohmann::json;

// vLLM's error answer, {"error": {"message", "type", "param", "code"}} (serve/engine/protocol.py
// ErrorResponse at vllm-project/vllm f1bf7bd07a112d72d905d355a8206b8d1e82cb5d). Only the API
// process's own checks answer 400 -- a body that is not JSON, a missing init_info/update_info
// (serve/dev/rlhf/api_router.py at 0100a2129224e729af1b3b8ed42a900cdfe9a452), a query or field
// that fails validation (handlers/validation.py at 4da14a5cf11a5a5ed50bd267b7460d9957f84c35):
// INVALID_ARGUMENT here. Everything a worker raises -- "Invalid init_info ...", a call out of
// phase, a failed receive -- reaches the caller as a plain Exception and is answered 500
// (v1/engine/core_client.py at 00080ee13c7a451fce071ccb8d0e94d395acf5a7;
// exception_handling/register.py at 8a8be3dcc35e02e60c940f7aff3aef8cc7524259): WorkerError.
void ReplyError(httplib::Response& res, const absl::Status& s) {
  const bool api = absl::IsInvalidArgument(s);
  res.status = api ? 400 : 500;
  res.set_content(json{{"error",
                        {{"message", std::string(s.message())},
                         {"type", api ? "Bad Request" : "InternalServerError"},
                         {"param", nullptr},
                         {"code", res.status}}}}
                      .dump(),
                  "application/json");
}

// What a worker's exception becomes on its way to the HTTP caller: the executor's RuntimeError
// (v1/executor/multiproc_executor.py at c5c40ab252786c8d25f9336824c6b805973974cd) wrapped by the
// engine core's utility call (v1/engine/core.py at 00080ee13c7a451fce071ccb8d0e94d395acf5a7).
absl::Status WorkerError(const absl::Status& s) {
  if (s.ok()) return s;
  return absl::InternalError(
      absl::StrCat("Call to collective_rpc method failed: Worker failed with error '", s.message(),
                   "', please check the stack trace above for the root cause"));
}

// What vLLM's sparse backend makes of update_info: its dataclass takes exactly names,
// dtype_names, shapes and num_updates_list (SparseNCCLWeightTransferUpdateInfo), and
// parse_update_info turns the TypeError of any other key set into a ValueError
// (distributed/weight_transfer/sparse_nccl_engine.py and base.py at
// fc1c548093029f6487bbdc9c612995dfe7621a75). This engine receives no sparse patches (wpub sends
// none), so a body that parses is refused too, as a receive this engine does not model.
absl::Status SparseUpdateRefusal(std::string_view body) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  static const json kNone;
  const json& info = j.is_object() && j.contains("update_info") ? j.at("update_info") : kNone;
  std::string problem;
  if (!info.is_object()) {
    problem = "update_info is not a mapping";
  } else {
    for (const auto& [key, value] : info.items()) {
      if (key != "names" && key != "dtype_names" && key != "shapes" && key != "num_updates_list") {
        problem =
            absl::StrCat("__init__() got an unexpected keyword argument '", key.substr(0, 64), "'");
        break;
      }
    }
    if (problem.empty() && !info.contains("num_updates_list")) {
      problem = "__init__() missing 1 required positional argument: 'num_updates_list'";
    }
  }
  if (problem.empty()) {
    return absl::UnimplementedError("this engine does not model vLLM's sparse receive");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Invalid update_info for SparseNCCLWeightTransferEngine: ", problem));
}

// The API process's own check of a route's JSON body: INVALID_ARGUMENT (400) for a body that
// is not a JSON object or lacks `key` (api_router.py's "Invalid JSON format" and "Missing
// '<key>' in request body").
absl::Status CheckRouteBody(std::string_view body, const char* key) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError("Invalid JSON format");
  if (!j.contains(key)) {
    return absl::InvalidArgumentError(absl::StrCat("Missing '", key, "' in request body"));
  }
  return absl::OkStatus();
}

void Reply(httplib::Response& res, const absl::StatusOr<std::string>& message) {
  if (!message.ok()) return ReplyError(res, message.status());
  res.status = 200;
  res.set_content(json{{"message", *message}}.dump(), "application/json");
}

}  // namespace

class VllmEngine::Impl {
 public:
  Impl(VllmEngineOptions options, std::unique_ptr<VllmDataPath> data, Callbacks callbacks)
      : options_(std::move(options)), data_(std::move(data)), callbacks_(std::move(callbacks)) {}

  // A handler blocked in the data path ends first; then the server stops (joining handlers).
  ~Impl() {
    data_->Abort();
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Start() {
    AddRoutes();
    WPUB_ASSIGN_OR_RETURN(
        port_, ServeEngineHttp(server_, options_.host, options_.port, "vLLM engine", &thread_));
    return absl::OkStatus();
  }

  int port() const { return port_; }

  VllmEngineState state() const {
    std::lock_guard lock(mu_);
    return state_;
  }

  void FailUpdateAt(int64_t index) {
    std::lock_guard lock(mu_);
    fail_update_at_ = index;
  }

 private:
  using Request = httplib::Request;
  using Response = httplib::Response;
  using Handler = absl::StatusOr<std::string> (Impl::*)(const Request&);

  void Route(const char* path, Handler h) {
    AnswerOtherMethods(server_, path);
    server_.Post(path, [this, path, h](const Request& q, Response& r) {
      std::lock_guard lock(mu_);
      std::string call = absl::StrCat("POST ", path);
      if (q.has_param("mode")) absl::StrAppend(&call, "?mode=", q.get_param_value("mode"));
      state_.calls.push_back(std::move(call));
      Reply(r, (this->*h)(q));
    });
  }

  void AddRoutes() {
    server_.Get("/health", [](const Request&, Response& r) { r.status = 200; });
    server_.Get("/is_paused", [this](const Request&, Response& r) {
      std::lock_guard lock(mu_);
      r.set_content(json{{"is_paused", state_.paused}}.dump(), "application/json");
    });
    server_.Get("/weight_info", [this](const Request&, Response& r) {
      std::lock_guard lock(mu_);
      // vLLM keeps the version of the last finish that named one (AsyncLLM.finish_weight_update
      // sets it only when given: v1/engine/async_llm.py at
      // 00080ee13c7a451fce071ccb8d0e94d395acf5a7), also after a partial update was applied;
      // "mixed" is this engine's own account, for tests.
      json j = {{"mixed", state_.mixed}};
      j["weight_version"] =
          state_.weight_version.empty() ? json("default") : json(state_.weight_version);
      r.set_content(j.dump(), "application/json");
    });
    // The release, as vLLM's /version answers it.
    server_.Get("/version", [](const Request&, Response& r) {
      r.set_content(json{{"version", "wpub-recv"}}.dump(), "application/json");
    });
    // The dev-mode server info (serve/dev/server_info/api_router.py at vllm-project/vllm
    // c67fe497a25d5af10a6ca0be9d18bcdd42cac4f1): the config as a string by default, as JSON with
    // config_format=json (fallback=str for what JSON cannot hold), beside the environment.
    server_.Get("/server_info", [this](const Request& q, Response& r) {
      const std::string format =
          q.has_param("config_format") ? q.get_param_value("config_format") : std::string("text");
      const std::string& backend = options_.weight_transfer_backend;
      json config;
      // "" plays an engine started without --weight-transfer-config (the config's null).
      const json transfer = backend.empty() ? json(nullptr) : json{{"backend", backend}};
      if (format == "json") {
        config = {{"weight_transfer_config", transfer}};
      } else if (format == "text") {
        config = absl::StrCat("weight_transfer_config=",
                              backend.empty()
                                  ? std::string("None")
                                  : absl::StrCat("WeightTransferConfig(backend='", backend, "')"));
      } else {
        // FastAPI's validation of the Literal query parameter (answered 400 by vLLM's handler).
        ReplyError(r, absl::InvalidArgumentError(absl::StrCat(
                          "config_format: Input should be 'text' or 'json', got '", format, "'")));
        return;
      }
      r.set_content(
          json{{"vllm_config", config}, {"vllm_env", json::object()}, {"system_env", "wpub-recv"}}
              .dump(),
          "application/json");
    });
    Route("/init_weight_transfer_engine", &Impl::Init);
    Route("/pause", &Impl::Pause);
    Route("/resume", &Impl::Resume);
    Route("/start_weight_update", &Impl::StartUpdate);
    Route("/update_weights", &Impl::Update);
    Route("/finish_weight_update", &Impl::Finish);
  }

  // An engine started without --weight-transfer-config has no transfer engine on its workers:
  // every weight route's worker call raises (Worker._check_weight_transfer_engine,
  // v1/worker/gpu_worker.py at vllm-project/vllm c67fe497a25d5af10a6ca0be9d18bcdd42cac4f1), 500.
  absl::Status Configured() const {
    if (!options_.weight_transfer_backend.empty()) return absl::OkStatus();
    return WorkerError(absl::FailedPreconditionError(
        "Weight transfer not configured. Please set weight_transfer_config to enable weight "
        "transfer."));
  }

  absl::StatusOr<std::string> Init(const Request& q) {
    WPUB_RETURN_IF_ERROR(CheckRouteBody(q.body, "init_info"));
    WPUB_RETURN_IF_ERROR(Configured());
    absl::StatusOr<VllmInitInfo> decoded = DecodeVllmInit(q.body, options_.packing_in_init);
    if (!decoded.ok()) return WorkerError(decoded.status());  // the worker parses init_info
    const VllmInitInfo init = *std::move(decoded);
    state_.joined = false;
    state_.updating = false;
    staged_.clear();
    WPUB_RETURN_IF_ERROR(WorkerError(data_->Join(init)));
    init_ = init;
    state_.joined = true;
    return absl::StrCat("joined as rank ", init.rank_offset, " of ", init.world_size);
  }

  // POST /pause?mode=abort|wait|keep&clear_cache=<bool> (defaults "abort" and true): FastAPI
  // validates both query parameters (PauseMode, a Literal, and a bool) and answers a bad one 400
  // "1 validation error: ..." naming `query.<name>` (rl/online/api_router.py at 39929f18;
  // serve/rlhf/api_router.py at 1ace43ed; the handler: serve/utils/server_utils.py at 0753ceeb).
  absl::StatusOr<std::string> Pause(const Request& q) {
    const std::string mode = q.has_param("mode") ? q.get_param_value("mode") : "abort";
    if (mode != "abort" && mode != "wait" && mode != "keep") {
      return absl::InvalidArgumentError(absl::StrCat(
          "1 validation error: query.mode: Input should be 'abort', 'wait' or 'keep', got '", mode,
          "'"));
    }
    bool clear_cache = true;
    if (q.has_param("clear_cache")) {
      // pydantic's bool from a query string.
      const std::string v = absl::AsciiStrToLower(q.get_param_value("clear_cache"));
      if (v == "true" || v == "1" || v == "yes" || v == "on" || v == "t" || v == "y") {
        clear_cache = true;
      } else if (v == "false" || v == "0" || v == "no" || v == "off" || v == "f" || v == "n") {
        clear_cache = false;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "1 validation error: query.clear_cache: Input should be a valid boolean, got '", v,
            "'"));
      }
    }
    state_.paused = true;
    state_.pause_mode = mode;
    state_.pause_clear_cache = clear_cache;
    return std::string("paused");
  }

  absl::StatusOr<std::string> Resume(const Request&) {
    state_.paused = false;
    return std::string("resumed");
  }

  // The phase checks and their texts are the worker's (v1/worker/gpu_worker.py at
  // 6fbea1171830682c53ecb7d3ae67495fa799e62f), answered 500 as every worker error.
  absl::StatusOr<std::string> StartUpdate(const Request& q) {
    WPUB_RETURN_IF_ERROR(CheckVllmBody(q.body, "start_weight_update"));
    WPUB_RETURN_IF_ERROR(Configured());
    if (!state_.joined) {
      return WorkerError(absl::FailedPreconditionError(
          "no weight transfer engine: POST /init_weight_transfer_engine first"));
    }
    if (state_.updating) {
      return WorkerError(absl::FailedPreconditionError(
          "start_weight_update called while a weight update is already active. Call "
          "finish_weight_update first."));
    }
    state_.updating = true;
    state_.updates = 0;
    staged_.clear();
    return std::string("weight update started");
  }

  absl::StatusOr<std::string> Update(const Request& q) {
    WPUB_RETURN_IF_ERROR(CheckRouteBody(q.body, "update_info"));
    WPUB_RETURN_IF_ERROR(Configured());
    if (!state_.updating) {
      return WorkerError(absl::FailedPreconditionError(
          "start_weight_update must be called before update_weights."));
    }
    if (!state_.joined) {
      return WorkerError(absl::FailedPreconditionError(
          "no weight transfer engine: POST /init_weight_transfer_engine first"));
    }
    // From here a failure ends the update on the worker (it clears its session: a finish then
    // fails, a new start is taken); what earlier updates loaded stays loaded.
    absl::StatusOr<VllmUpdate> decoded =
        options_.weight_transfer_backend == "sparse_nccl"
            ? absl::StatusOr<VllmUpdate>(SparseUpdateRefusal(q.body))
            : DecodeVllmUpdate(q.body, init_, /*packing_allowed=*/!options_.packing_in_init);
    if (!decoded.ok()) {
      EndFailedUpdate();
      return WorkerError(decoded.status());
    }
    const VllmUpdate u = *std::move(decoded);
    std::vector<uint8_t> bytes;
    if (absl::Status s = data_->Receive(u, &bytes); !s.ok()) {
      // The group is unusable after a failed receive; the engine needs a new init.
      state_.joined = false;
      EndFailedUpdate();
      return WorkerError(s);
    }
    if (fail_update_at_ >= 0 && static_cast<uint64_t>(fail_update_at_) == state_.updates) {
      fail_update_at_ = -1;
      // A loader failure after the bytes arrived (a shape the model refuses, a quantization
      // check): the tensors before the failing one were loaded.
      for (size_t k = 0; k < u.tensors.size() / 2; ++k) Stage(u.tensors[k], bytes);
      EndFailedUpdate();
      return WorkerError(absl::InternalError(absl::StrCat(
          "loading ", u.tensors.empty() ? std::string("(no tensor)") : u.tensors.back().name,
          " failed (injected)")));
    }
    for (const transport::ManifestTensor& t : u.tensors) Stage(t, bytes);
    const uint64_t index = state_.updates++;
    if (callbacks_.on_update) callbacks_.on_update(index, u);
    return absl::StrCat("update ", index, ": ", u.tensors.size(), " tensors, ", u.nbytes,
                        " bytes, checksum ",
                        absl::Hex(transport::Checksum(bytes.data(), bytes.size())));
  }

  absl::StatusOr<std::string> Finish(const Request& q) {
    WPUB_ASSIGN_OR_RETURN(std::optional<std::string> version, DecodeVllmFinish(q.body));
    WPUB_RETURN_IF_ERROR(Configured());
    if (!state_.updating) {
      return WorkerError(absl::FailedPreconditionError(
          "finish_weight_update called without a matching start_weight_update."));
    }
    state_.updating = false;
    if (state_.updates == 0) return std::string("nothing received: the weights are unchanged");
    for (auto& [name, t] : staged_) state_.weights[name] = std::move(t);
    staged_.clear();
    if (!version) {
      state_.mixed = true;
      return std::string("partial update applied");
    }
    state_.mixed = false;
    state_.weight_version = *version;
    if (callbacks_.on_version) callbacks_.on_version(state_);
    return absl::StrCat("weight version ", *version, " applied");
  }

  void Stage(const transport::ManifestTensor& t, const std::vector<uint8_t>& bytes) {
    staged_[t.name] = {
        TensorDesc{t.name, t.dtype, t.shape},
        std::vector<uint8_t>(bytes.begin() + t.offset, bytes.begin() + t.offset + t.nbytes)};
  }
  // A failed /update_weights: the worker leaves the update (no finish is taken until the next
  // start), keeping what earlier updates of it loaded -- the layers a layerwise reload processed
  // as they completed (model_loader/reload/layerwise.py at
  // 01424e4b5c6768cacbb637fa08e7064a4301ec68): the weights now mix versions.
  void EndFailedUpdate() {
    state_.updating = false;
    if (staged_.empty()) return;
    for (auto& [name, t] : staged_) state_.weights[name] = std::move(t);
    staged_.clear();
    state_.mixed = true;
  }

  const VllmEngineOptions options_;
  const std::unique_ptr<VllmDataPath> data_;
  const Callbacks callbacks_;
  mutable std::mutex mu_;  // the lifecycle: one request at a time
  VllmEngineState state_;  // guarded by mu_
  VllmInitInfo init_;      // guarded by mu_
  std::map<std::string, std::pair<TensorDesc, std::vector<uint8_t>>> staged_;  // guarded by mu_
  int64_t fail_update_at_ = -1;                                                // guarded by mu_
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

absl::StatusOr<std::unique_ptr<VllmEngine>> VllmEngine::Start(const VllmEngineOptions& options,
                                                              std::unique_ptr<VllmDataPath> data,
                                                              Callbacks callbacks) {
  if (data == nullptr) return absl::InvalidArgumentError("vLLM engine: no data path");
  auto impl = std::make_unique<Impl>(options, std::move(data), std::move(callbacks));
  WPUB_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<VllmEngine>(new VllmEngine(std::move(impl)));
}

VllmEngine::VllmEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VllmEngine::~VllmEngine() = default;
int VllmEngine::port() const { return impl_->port(); }
std::string VllmEngine::url() const { return absl::StrCat("http://127.0.0.1:", impl_->port()); }
VllmEngineState VllmEngine::state() const { return impl_->state(); }
void VllmEngine::FailUpdateAt(int64_t index) { impl_->FailUpdateAt(index); }

}  // namespace wpub::recv
