// VllmEngine (vllm_engine.h): vLLM's weight-transfer routes (cpp-httplib) and the lifecycle an
// engine keeps between them, over a VllmDataPath; the request decoders and the pickle reader.
#include "clients/recv/vllm_engine.h"

#include <httplib.h>

#include <mutex>
#include <thread>

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

constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 48;

absl::StatusOr<json> ParseObject(std::string_view body, const char* route) {
  constexpr JsonBounds kBounds{kEngineMaxRequestBytes, kClientJsonBounds.max_depth};
  if (body.empty()) return json::object();  // vLLM's routes that take a body accept none
  WPUB_RETURN_IF_ERROR(
      CheckJsonBounds(absl::string_view(body.data(), body.size()), route, kBounds));
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(route, ": the body is not a JSON object"));
  }
  return j;
}

absl::StatusOr<int64_t> IntField(const json& o, const char* where, const char* key,
                                 int64_t fallback, int64_t lo, int64_t hi) {
  auto it = o.find(key);
  if (it == o.end()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < lo || it->get<int64_t>() > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, " must be an integer in [", lo, ", ", hi, "]"));
  }
  return it->get<int64_t>();
}

// The packing fields of `o` (init_info or update_info) into *init.
absl::Status DecodePacking(const json& o, const char* where, VllmInitInfo* init) {
  if (auto it = o.find("packed"); it != o.end()) {
    if (!it->is_boolean()) return absl::InvalidArgumentError(absl::StrCat(where, ".packed"));
    init->packed = it->get<bool>();
  }
  WPUB_ASSIGN_OR_RETURN(
      int64_t bytes, IntField(o, where, "packed_buffer_size_bytes",
                              static_cast<int64_t>(init->packed_buffer_size_bytes), 1, 1LL << 40));
  WPUB_ASSIGN_OR_RETURN(int64_t buffers,
                        IntField(o, where, "packed_num_buffers", init->packed_num_buffers, 1, 64));
  init->packed_buffer_size_bytes = static_cast<uint64_t>(bytes);
  init->packed_num_buffers = static_cast<int>(buffers);
  return absl::OkStatus();
}

bool HasPacking(const json& o) {
  return o.contains("packed") || o.contains("packed_buffer_size_bytes") ||
         o.contains("packed_num_buffers");
}

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

// A little-endian unsigned argument of `n` bytes at p[i..].
uint64_t LittleEndian(std::string_view p, size_t i, size_t n) {
  uint64_t v = 0;
  for (size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(p[i + k])} << (8 * k);
  return v;
}

}  // namespace

std::vector<uint64_t> VllmChunks(absl::Span<const uint64_t> sizes, uint64_t limit) {
  std::vector<uint64_t> chunks;
  uint64_t open = 0;
  for (const uint64_t size : sizes) {
    open += size;
    if (open > limit) {
      chunks.push_back(open);
      open = 0;
    }
  }
  if (open > 0 || chunks.empty()) chunks.push_back(open);
  return chunks;
}

absl::StatusOr<VllmInitInfo> DecodeVllmInit(std::string_view body, bool packing_allowed) {
  WPUB_ASSIGN_OR_RETURN(json j, ParseObject(body, "init_weight_transfer_engine"));
  auto it = j.find("init_info");
  if (it == j.end() || !it->is_object()) {
    return absl::InvalidArgumentError("Invalid init_info: init_info must be an object");
  }
  const json& o = *it;
  if (HasPacking(o) && !packing_allowed) {
    // What a release that takes the packing per update answers (its init_info has no such
    // field): the publisher asks again without them.
    return absl::InvalidArgumentError(
        "Invalid init_info: NCCLWeightTransferInitInfo.__init__() got an unexpected keyword "
        "argument 'packed'");
  }
  VllmInitInfo init;
  auto address = o.find("master_address");
  if (address == o.end() || !address->is_string() || address->get<std::string>().empty()) {
    return absl::InvalidArgumentError("Invalid init_info: master_address must be a host name");
  }
  init.master_address = address->get<std::string>();
  if (!o.contains("master_port") || !o.contains("rank_offset") || !o.contains("world_size")) {
    return absl::InvalidArgumentError(
        "Invalid init_info: master_port, rank_offset and world_size are required");
  }
  WPUB_ASSIGN_OR_RETURN(int64_t port, IntField(o, "init_info", "master_port", 0, 1, 65535));
  WPUB_ASSIGN_OR_RETURN(int64_t world, IntField(o, "init_info", "world_size", 0, 2, 1 << 16));
  WPUB_ASSIGN_OR_RETURN(int64_t offset, IntField(o, "init_info", "rank_offset", 0, 1, world - 1));
  init.master_port = static_cast<int>(port);
  init.world_size = static_cast<int>(world);
  init.rank_offset = static_cast<int>(offset);
  WPUB_RETURN_IF_ERROR(DecodePacking(o, "init_info", &init));
  return init;
}

absl::StatusOr<VllmUpdate> DecodeVllmUpdate(std::string_view body, const VllmInitInfo& init,
                                            bool packing_allowed) {
  WPUB_ASSIGN_OR_RETURN(json j, ParseObject(body, "update_weights"));
  auto it = j.find("update_info");
  if (it == j.end() || !it->is_object()) {
    return absl::InvalidArgumentError("update_info must be an object");
  }
  const json& o = *it;
  VllmInitInfo packing = init;
  if (HasPacking(o)) {
    if (!packing_allowed) {
      return absl::InvalidArgumentError(
          "update_info: the packing is set at init_weight_transfer_engine by this release");
    }
    WPUB_RETURN_IF_ERROR(DecodePacking(o, "update_info", &packing));
  }
  const json* arrays[3];
  const char* keys[3] = {"names", "dtype_names", "shapes"};
  for (int k = 0; k < 3; ++k) {
    auto a = o.find(keys[k]);
    if (a == o.end() || !a->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("update_info.", keys[k], " must be a list"));
    }
    arrays[k] = &*a;
  }
  const size_t n = arrays[0]->size();
  if (arrays[1]->size() != n || arrays[2]->size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("update_info: names, dtype_names and shapes have different lengths (", n, ", ",
                     arrays[1]->size(), ", ", arrays[2]->size(), ")"));
  }
  VllmUpdate u;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < n; ++i) {
    const json& name = (*arrays[0])[i];
    if (!name.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("update_info.names[", i, "] is not a string"));
    }
    transport::ManifestTensor t;
    t.name = name.get<std::string>();
    const json& dtype = (*arrays[1])[i];
    absl::StatusOr<DType> parsed = dtype.is_string()
                                       ? ParseDType(dtype.get_ref<const std::string&>())
                                       : absl::InvalidArgumentError("not a string");
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("update_info.dtype_names[", i, "] of '",
                                                     t.name, "': ", dtype.dump().substr(0, 64),
                                                     " is not a torch dtype"));
    }
    t.dtype = *parsed;
    const json& shape = (*arrays[2])[i];
    if (!shape.is_array() || shape.size() > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("update_info.shapes[", i, "] of '", t.name, "' is not a list of dims"));
    }
    uint64_t numel = 1;
    for (const json& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
          (d.get<int64_t>() > 0 && numel > kMaxTensorBytes / d.get<uint64_t>())) {
        return absl::InvalidArgumentError(absl::StrCat("update_info.shapes[", i, "] of '", t.name,
                                                       "': ", shape.dump().substr(0, 64),
                                                       " has a negative or oversized dimension"));
      }
      t.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
    }
    t.nbytes = numel * static_cast<uint64_t>(DTypeSize(t.dtype));
    if (t.nbytes > kMaxTensorBytes || u.nbytes + t.nbytes > kMaxTensorBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("update_info: tensor '", t.name, "' takes the update past 2^48 bytes"));
    }
    t.offset = u.nbytes;
    u.nbytes += t.nbytes;
    sizes.push_back(t.nbytes);
    u.tensors.push_back(std::move(t));
  }
  // Packed: vLLM's chunks. Otherwise one broadcast per tensor.
  u.chunks = packing.packed ? VllmChunks(sizes, packing.packed_buffer_size_bytes) : sizes;
  return u;
}

absl::StatusOr<std::vector<uint8_t>> DecodeVllmUniqueIdPickle(std::string_view p) {
  constexpr size_t kIdBytes = 128;
  std::vector<std::vector<uint8_t>> byte_objects;
  std::vector<std::string> strings;  // text pushed, for STACK_GLOBAL's names
  std::vector<std::string> classes;  // every global referenced
  size_t i = 0;
  auto need = [&](size_t n, const char* what) -> absl::Status {
    if (p.size() - i < n) {
      return absl::InvalidArgumentError(absl::StrCat("unique-id pickle: truncated in ", what));
    }
    return absl::OkStatus();
  };
  while (i < p.size()) {
    const uint8_t op = static_cast<uint8_t>(p[i++]);
    switch (op) {
      case 0x80:  // PROTO
        WPUB_RETURN_IF_ERROR(need(1, "PROTO"));
        if (static_cast<uint8_t>(p[i]) < 3 || static_cast<uint8_t>(p[i]) > 5) {
          return absl::InvalidArgumentError(absl::StrCat(
              "unique-id pickle: protocol ", static_cast<int>(p[i]), " (3 to 5 are read)"));
        }
        i += 1;
        break;
      case 0x95:  // FRAME
        WPUB_RETURN_IF_ERROR(need(8, "FRAME"));
        i += 8;
        break;
      case 'c': {  // GLOBAL "module\nname\n"
        const size_t a = p.find('\n', i);
        const size_t b = a == std::string_view::npos ? a : p.find('\n', a + 1);
        if (b == std::string_view::npos) return need(p.size() + 1, "GLOBAL");
        classes.emplace_back(p.substr(a + 1, b - a - 1));
        i = b + 1;
        break;
      }
      case 0x93:  // STACK_GLOBAL: module and name were the last two strings
        if (strings.size() < 2) {
          return absl::InvalidArgumentError("unique-id pickle: STACK_GLOBAL without names");
        }
        classes.push_back(strings.back());
        break;
      case 0x8c:    // SHORT_BINUNICODE
      case 'X':     // BINUNICODE
      case 0x8d:    // BINUNICODE8
      case 'C':     // SHORT_BINBYTES
      case 'B':     // BINBYTES
      case 0x8e: {  // BINBYTES8
        const size_t width = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
        WPUB_RETURN_IF_ERROR(need(width, "a length"));
        const uint64_t n = LittleEndian(p, i, width);
        i += width;
        WPUB_RETURN_IF_ERROR(need(n, "a string"));
        const std::string_view data = p.substr(i, n);
        i += n;
        if (op == 'C' || op == 'B' || op == 0x8e) {
          byte_objects.emplace_back(data.begin(), data.end());
        } else {
          strings.emplace_back(data);
        }
        break;
      }
      case 'q':  // BINPUT
      case 'h':  // BINGET
      case 'K':  // BININT1
        WPUB_RETURN_IF_ERROR(need(1, "an argument"));
        i += 1;
        break;
      case 'M':  // BININT2
        WPUB_RETURN_IF_ERROR(need(2, "an argument"));
        i += 2;
        break;
      case 'r':  // LONG_BINPUT
      case 'j':  // LONG_BINGET
      case 'J':  // BININT
        WPUB_RETURN_IF_ERROR(need(4, "an argument"));
        i += 4;
        break;
      case 0x94:  // MEMOIZE
      case '}':   // EMPTY_DICT
      case ')':   // EMPTY_TUPLE
      case ']':   // EMPTY_LIST
      case '(':   // MARK
      case 0x85:  // TUPLE1
      case 0x86:  // TUPLE2
      case 0x87:  // TUPLE3
      case 't':   // TUPLE
      case 'R':   // REDUCE
      case 'b':   // BUILD
      case 's':   // SETITEM
      case 'u':   // SETITEMS
      case 'N':   // NONE
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        break;
      case '.': {  // STOP
        if (i != p.size()) {
          return absl::InvalidArgumentError("unique-id pickle: bytes after STOP");
        }
        bool is_id = false;
        for (const std::string& c : classes) is_id = is_id || c == "ncclUniqueId";
        if (!is_id) {
          return absl::InvalidArgumentError(
              "unique-id pickle: not a pickle of vLLM's ncclUniqueId (no such class named)");
        }
        if (byte_objects.size() != 1 || byte_objects[0].size() != kIdBytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("unique-id pickle: ", byte_objects.size(), " bytes objects (",
                           byte_objects.empty() ? 0 : byte_objects[0].size(),
                           " bytes first), not one of ", kIdBytes));
        }
        return std::move(byte_objects[0]);
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unique-id pickle: opcode 0x", absl::Hex(op), " at byte ", i - 1,
                         " is not one a ctypes Structure's pickle uses"));
    }
  }
  return absl::InvalidArgumentError("unique-id pickle: no STOP");
}

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
    Route("/init_weight_transfer_engine", &Impl::Init);
    Route("/pause", &Impl::Pause);
    Route("/resume", &Impl::Resume);
    Route("/start_weight_update", &Impl::StartUpdate);
    Route("/update_weights", &Impl::Update);
    Route("/finish_weight_update", &Impl::Finish);
  }

  absl::StatusOr<std::string> Init(const Request& q) {
    WPUB_RETURN_IF_ERROR(CheckRouteBody(q.body, "init_info"));
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

  absl::StatusOr<std::string> Pause(const Request& q) {
    const std::string mode = q.has_param("mode") ? q.get_param_value("mode") : "abort";
    if (mode != "abort" && mode != "wait" && mode != "keep") {
      return absl::InvalidArgumentError(
          absl::StrCat("pause mode '", mode, "' is not abort, wait or keep"));
    }
    state_.paused = true;
    state_.pause_mode = mode;
    return std::string("paused");
  }

  absl::StatusOr<std::string> Resume(const Request&) {
    state_.paused = false;
    return std::string("resumed");
  }

  // The phase checks and their texts are the worker's (v1/worker/gpu_worker.py at
  // 6fbea1171830682c53ecb7d3ae67495fa799e62f), answered 500 as every worker error.
  absl::StatusOr<std::string> StartUpdate(const Request& q) {
    WPUB_RETURN_IF_ERROR(ParseObject(q.body, "start_weight_update").status());
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
        DecodeVllmUpdate(q.body, init_, /*packing_allowed=*/!options_.packing_in_init);
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
    WPUB_ASSIGN_OR_RETURN(json j, ParseObject(q.body, "finish_weight_update"));
    std::optional<std::string> version;
    if (auto it = j.find("weight_version"); it != j.end() && !it->is_null()) {
      if (!it->is_string()) return absl::InvalidArgumentError("weight_version must be a string");
      version = it->get<std::string>();
    }
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
