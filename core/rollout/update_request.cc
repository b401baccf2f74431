// Flattened-bucket update request: a direct JSON writer (nlohmann::json for strings that need
// escaping) and a simdjson on-demand reader.
#include "core/rollout/update_request.h"

#include <charconv>
#include <optional>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "simdjson.h"

namespace wpub::rollout {
namespace {

// Appends `s` as a JSON string. Printable ASCII other than '"' and '\\' (every tensor name and
// dtype in practice) is copied as is; anything else is escaped by nlohmann::json.
void AppendString(std::string& out, std::string_view s) {
  bool plain = true;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u > 0x7e || c == '"' || c == '\\') {
      plain = false;
      break;
    }
  }
  if (plain) {
    out += '"';
    out += s;
    out += '"';
    return;
  }
  out +=
      nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void AppendInt(std::string& out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, r.ptr);
}

}  // namespace

std::string EncodeUpdateRequest(const std::vector<transport::ManifestTensor>& tensors,
                                const UpdateRequestFields& fields) {
  std::string out;
  size_t estimate = 256 + fields.group_name.size();
  for (const transport::ManifestTensor& t : tensors) estimate += t.name.size() + 40;
  out.reserve(estimate);
  out += "{\"names\":[";
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) out += ',';
    AppendString(out, tensors[i].name);
  }
  out += "],\"dtypes\":[";
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) out += ',';
    const absl::string_view dtype = DTypeName(tensors[i].dtype);
    AppendString(out, std::string_view(dtype.data(), dtype.size()));
  }
  out += "],\"shapes\":[";
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) out += ',';
    out += '[';
    for (size_t d = 0; d < tensors[i].shape.size(); ++d) {
      if (d > 0) out += ',';
      AppendInt(out, tensors[i].shape[d]);
    }
    out += ']';
  }
  out += "],\"group_name\":";
  AppendString(out, fields.group_name);
  out += fields.flush_cache ? ",\"flush_cache\":true" : ",\"flush_cache\":false";
  if (!fields.weight_version.empty()) {
    out += ",\"weight_version\":";
    AppendString(out, fields.weight_version);
  }
  if (!fields.load_format.empty()) {
    out += ",\"load_format\":";
    AppendString(out, fields.load_format);
  }
  if (fields.sequence >= 0) {
    out += ",\"wpub_sequence\":";
    AppendInt(out, fields.sequence);
  }
  if (fields.patch.has_value()) {
    const UpdatePatch& p = *fields.patch;
    absl::StrAppend(&out, ",\"wpub_patch\":{\"base_version\":", p.base_version,
                    ",\"base_checksum\":", p.base_checksum,
                    ",\"target_checksum\":", p.target_checksum, ",\"bytes\":", p.bytes, "}");
  }
  out += '}';
  return out;
}

namespace {

namespace od = simdjson::ondemand;

absl::Status Malformed(std::string_view what, simdjson::error_code e) {
  return absl::InvalidArgumentError(absl::StrCat("the request body is not valid JSON (",
                                                 absl::string_view(what.data(), what.size()), ": ",
                                                 simdjson::error_message(e), ")"));
}

// A string value, or nullopt when the value is not a string (an error of the JSON text itself
// is reported through `error`).
std::optional<std::string> StringValue(od::value& v, simdjson::error_code& error) {
  od::json_type type;
  if ((error = v.type().get(type))) return std::nullopt;
  if (type != od::json_type::string) return std::nullopt;
  std::string_view s;
  if ((error = v.get_string().get(s))) return std::nullopt;
  return std::string(s);
}

}  // namespace

absl::StatusOr<UpdateRequest> DecodeUpdateRequest(std::string_view body) {
  const simdjson::padded_string padded(body);
  od::parser parser;
  od::document doc;
  if (auto e = parser.iterate(padded).get(doc)) return Malformed("document", e);
  od::object object;
  if (auto e = doc.get_object().get(object)) {
    if (e == simdjson::INCORRECT_TYPE) {
      return absl::InvalidArgumentError("the request body is not a JSON object");
    }
    return Malformed("document", e);
  }

  // Per tensor, as found: nullopt where the element has the wrong JSON type.
  std::vector<std::optional<std::string>> names, dtypes;
  std::vector<std::optional<Shape>> shapes;
  bool have_names = false, have_dtypes = false, have_shapes = false;
  UpdateRequest out;
  simdjson::error_code e = simdjson::SUCCESS;
  for (auto member : object) {
    od::field field;
    if ((e = std::move(member).get(field))) return Malformed("object member", e);
    std::string_view key;
    if ((e = field.unescaped_key().get(key))) return Malformed("key", e);
    od::value value = field.value();
    if (key == "names" || key == "dtypes") {
      const bool is_names = key == "names";
      od::array array;
      if (value.get_array().get(array)) {
        return absl::InvalidArgumentError(is_names ? "names must be an array"
                                                   : "dtypes must be an array");
      }
      auto& into = is_names ? names : dtypes;
      (is_names ? have_names : have_dtypes) = true;
      into.clear();
      for (auto element : array) {
        od::value v;
        if ((e = std::move(element).get(v))) return Malformed(key, e);
        into.push_back(StringValue(v, e));
        if (e) return Malformed(key, e);
      }
    } else if (key == "shapes") {
      od::array array;
      if (value.get_array().get(array)) {
        return absl::InvalidArgumentError("shapes must be an array");
      }
      have_shapes = true;
      shapes.clear();
      for (auto element : array) {
        od::value v;
        if ((e = std::move(element).get(v))) return Malformed(key, e);
        od::array dims;
        if (v.get_array().get(dims)) {
          shapes.emplace_back(std::nullopt);
          continue;
        }
        Shape shape;
        bool ok = true;
        for (auto dim : dims) {
          int64_t n = 0;
          if (dim.get_int64().get(n) || n < 0) {
            ok = false;
            break;
          }
          shape.push_back(n);
        }
        shapes.push_back(ok ? std::optional<Shape>(std::move(shape)) : std::nullopt);
      }
    } else if (key == "group_name" || key == "weight_version" || key == "load_format") {
      std::optional<std::string> s = StringValue(value, e);
      if (e) return Malformed(key, e);
      if (!s) continue;  // a non-string value is ignored, as an absent field
      (key == "group_name"       ? out.fields.group_name
       : key == "weight_version" ? out.fields.weight_version
                                 : out.fields.load_format) = *std::move(s);
    } else if (key == "flush_cache") {
      bool flag = false;
      if (!value.get_bool().get(flag)) out.fields.flush_cache = flag;
    } else if (key == "wpub_sequence") {
      uint64_t n = 0;
      if (value.get_uint64().get(n) || n > (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError("wpub_sequence must be an integer in [0, 2^31]");
      }
      out.fields.sequence = static_cast<int64_t>(n);
    } else if (key == "wpub_patch") {
      od::object o;
      if (value.get_object().get(o)) {
        return absl::InvalidArgumentError("wpub_patch must be an object");
      }
      UpdatePatch p;
      bool seen[4] = {false, false, false, false};
      for (auto pm : o) {
        od::field pf;
        if ((e = std::move(pm).get(pf))) return Malformed("wpub_patch member", e);
        std::string_view k;
        if ((e = pf.unescaped_key().get(k))) return Malformed("wpub_patch key", e);
        const int i = k == "base_version"      ? 0
                      : k == "base_checksum"   ? 1
                      : k == "target_checksum" ? 2
                      : k == "bytes"           ? 3
                                               : -1;
        if (i < 0) continue;
        uint64_t v = 0;
        if (pf.value().get_uint64().get(v)) {
          return absl::InvalidArgumentError(absl::StrCat("wpub_patch.",
                                                         absl::string_view(k.data(), k.size()),
                                                         " must be an unsigned integer"));
        }
        (i == 0   ? p.base_version
         : i == 1 ? p.base_checksum
         : i == 2 ? p.target_checksum
                  : p.bytes) = v;
        seen[i] = true;
      }
      for (int i = 0; i < 4; ++i) {
        if (!seen[i]) {
          static constexpr const char* kNames[] = {"base_version", "base_checksum",
                                                   "target_checksum", "bytes"};
          return absl::InvalidArgumentError(absl::StrCat("wpub_patch.", kNames[i], " is missing"));
        }
      }
      out.fields.patch = p;
    }
  }
  if (const char* rest = nullptr; !doc.current_location().get(rest)) {
    return absl::InvalidArgumentError("the request body has content after its JSON object");
  }
  if (!have_names || !have_dtypes || !have_shapes || names.size() != dtypes.size() ||
      names.size() != shapes.size()) {
    return absl::InvalidArgumentError(
        "names, dtypes and shapes are required: arrays of one length");
  }

  out.tensors.reserve(names.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!names[i] || !dtypes[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, ": name and dtype must be strings, shape an array"));
    }
    transport::ManifestTensor t;
    t.name = *std::move(names[i]);
    absl::StatusOr<DType> dtype = ParseDType(absl::string_view(*dtypes[i]));
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " (", t.name, "): ", dtype.status().message()));
    }
    t.dtype = *dtype;
    if (!shapes[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " (", t.name, "): the shape is not a list of non-negative integers"));
    }
    t.shape = *std::move(shapes[i]);
    uint64_t n = static_cast<uint64_t>(DTypeSize(t.dtype));
    for (const int64_t d : t.shape) {
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", i, " (", t.name, "): the shape's size overflows"));
      }
    }
    t.offset = offset;
    t.nbytes = n;
    if (__builtin_add_overflow(offset, n, &offset)) {
      return absl::InvalidArgumentError("the bucket's size overflows");
    }
    out.tensors.push_back(std::move(t));
  }
  out.nbytes = offset;
  return out;
}

}  // namespace wpub::rollout
