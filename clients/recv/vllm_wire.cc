// vLLM's weight-transfer request bodies as a vLLM engine decodes them (vllm_wire.h).
#include "clients/recv/vllm_wire.h"

#include "absl/strings/str_cat.h"
#include "clients/recv/engine_listener.h"
#include "core/common/json_bounds.h"
#include "core/common/status.h"
#include "core/common/tensor.h"
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

absl::Status CheckVllmBody(std::string_view body, const char* route) {
  return ParseObject(body, route).status();
}

absl::StatusOr<std::optional<std::string>> DecodeVllmFinish(std::string_view body) {
  WPUB_ASSIGN_OR_RETURN(json j, ParseObject(body, "finish_weight_update"));
  if (auto it = j.find("weight_version"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return absl::InvalidArgumentError("weight_version must be a string");
    return it->get<std::string>();
  }
  return std::nullopt;
}

}  // namespace wpub::recv
