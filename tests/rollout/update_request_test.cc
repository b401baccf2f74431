// The flattened-bucket update request: what the publisher encodes is valid JSON that a generic
// parser (nlohmann::json, as SGLang's Python json) reads back field for field, names that need
// escaping included; what the C++ engine decodes equals the publisher's manifest (offsets and
// sizes laid back to back); and every malformed body is refused with a message naming the
// offending field or tensor.
#include "core/rollout/update_request.h"

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace wpub::rollout {
namespace {

using json = nlohmann::json;
using transport::ManifestTensor;

std::vector<ManifestTensor> Tensors() {
  std::vector<ManifestTensor> t(4);
  t[0].name = "model.layers.0.mlp.experts.3.down_proj.weight";
  t[0].dtype = DType::kUInt8;
  t[0].shape = {2048, 384};
  t[1].name = "model.layers.0.mlp.experts.3.down_proj.weight_scale";
  t[1].dtype = DType::kFloat8E4M3;
  t[1].shape = {2048, 48};
  t[2].name = "model.layers.0.mlp.experts.3.down_proj.weight_scale_2";
  t[2].dtype = DType::kFloat32;
  t[2].shape = {};  // 0-d: 4 bytes
  // Needs escaping: quote, backslash, control character, non-ASCII UTF-8.
  t[3].name = "odd \"name\" \\ tab\t \xc3\xa9";
  t[3].dtype = DType::kBFloat16;
  t[3].shape = {3, 0, 5};
  uint64_t off = 0;
  for (auto& x : t) {
    x.offset = off;
    x.nbytes = static_cast<uint64_t>(NumElements(x.shape) * DTypeSize(x.dtype));
    off += x.nbytes;
  }
  return t;
}

TEST(UpdateRequest, EncodedBodyIsJsonAGenericParserReadsBack) {
  UpdateRequestFields f;
  f.group_name = "wpub_weights";
  f.weight_version = "17";
  f.flush_cache = true;
  f.sequence = 5;
  const std::string body = EncodeUpdateRequest(Tensors(), f);
  const json j = json::parse(body);  // throws on invalid JSON
  ASSERT_EQ(j["names"].size(), 4u);
  EXPECT_EQ(j["names"][3], Tensors()[3].name);
  EXPECT_EQ(j["dtypes"], json({"uint8", "float8_e4m3fn", "float32", "bfloat16"}));
  EXPECT_EQ(j["shapes"], json::parse("[[2048,384],[2048,48],[],[3,0,5]]"));
  EXPECT_EQ(j["group_name"], "wpub_weights");
  EXPECT_EQ(j["weight_version"], "17");
  EXPECT_EQ(j["flush_cache"], true);
  EXPECT_EQ(j["load_format"], "flattened_bucket");
  EXPECT_EQ(j["wpub_sequence"], 5);

  f.load_format.clear();
  f.sequence = -1;
  const json k = json::parse(EncodeUpdateRequest({}, f));
  EXPECT_FALSE(k.contains("load_format"));
  EXPECT_FALSE(k.contains("wpub_sequence"));
  EXPECT_TRUE(k["names"].empty());
}

TEST(UpdateRequest, InvalidUtf8InANameIsReplacedNotThrown) {
  std::vector<ManifestTensor> t = Tensors();
  t[0].name = "bad \xff byte";
  const json j = json::parse(EncodeUpdateRequest(t, {}));
  EXPECT_EQ(j["names"][0], "bad \xef\xbf\xbd byte");
}

TEST(UpdateRequest, DecodeInvertsEncode) {
  UpdateRequestFields f;
  f.group_name = "g";
  f.weight_version = "3";
  f.sequence = 0;
  absl::StatusOr<UpdateRequest> r = DecodeUpdateRequest(EncodeUpdateRequest(Tensors(), f));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensors, Tensors());
  EXPECT_EQ(r->nbytes, 2048u * 384 + 2048u * 48 + 4 + 0);
  EXPECT_EQ(r->fields.group_name, "g");
  EXPECT_EQ(r->fields.weight_version, "3");
  EXPECT_EQ(r->fields.sequence, 0);
  EXPECT_EQ(r->fields.load_format, "flattened_bucket");
  EXPECT_FALSE(r->fields.patch.has_value());
  // A patch's fields, checksums over 2^63 included (exact: decoded as unsigned integers).
  f.patch = UpdatePatch{.base_version = 9,
                        .base_checksum = 0xfedcba9876543210ull,
                        .target_checksum = 1,
                        .bytes = 4096};
  r = DecodeUpdateRequest(EncodeUpdateRequest(Tensors(), f));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fields.patch, f.patch);
  EXPECT_EQ(r->nbytes, 2048u * 384 + 2048u * 48 + 4 + 0);  // the bucket's, not the patch's
}

TEST(UpdateRequest, TrailingWhitespaceIsAccepted) {
  EXPECT_TRUE(DecodeUpdateRequest("{\"names\": [], \"dtypes\": [], \"shapes\": []} \n ").ok());
}

TEST(UpdateRequest, DecodeAcceptsAnyFieldOrderAndIgnoresUnknownFields) {
  absl::StatusOr<UpdateRequest> r = DecodeUpdateRequest(
      R"({"extra": {"nested": [1, 2, {"x": null}]}, "shapes": [[2, 8]], "dtypes": ["torch.bfloat16"],
          "weight_version": 7, "names": ["w"], "flush_cache": "yes"})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tensors.size(), 1u);
  EXPECT_EQ(r->tensors[0].name, "w");
  EXPECT_EQ(r->tensors[0].dtype, DType::kBFloat16);
  EXPECT_EQ(r->tensors[0].nbytes, 32u);
  EXPECT_EQ(r->fields.weight_version, "");  // not a string: as absent
  EXPECT_EQ(r->fields.sequence, -1);
  EXPECT_FALSE(r->fields.flush_cache);
}

TEST(UpdateRequest, MalformedBodiesAreRefusedNamingTheFieldOrTensor) {
  const struct {
    const char* body;
    const char* message;
  } cases[] = {
      {"", "not valid JSON"},
      {"[1, 2]", "not a JSON object"},
      {R"({"names": ["a"], "dtypes": ["uint8"]})", "arrays of one length"},
      {R"({"names": ["a", "b"], "dtypes": ["uint8"], "shapes": [[1]]})", "arrays of one length"},
      {R"({"names": "a", "dtypes": ["uint8"], "shapes": [[1]]})", "names must be an array"},
      {R"({"names": [1], "dtypes": ["uint8"], "shapes": [[1]]})", "tensor 0: name and dtype"},
      {R"({"names": ["a", "w1"], "dtypes": ["uint8", "complex7"], "shapes": [[1], [1]]})",
       "tensor 1 (w1)"},
      {R"({"names": ["w"], "dtypes": ["uint8"], "shapes": [[-1]]})", "tensor 0 (w): the shape"},
      {R"({"names": ["w"], "dtypes": ["uint8"], "shapes": [[1.5]]})", "tensor 0 (w): the shape"},
      {R"({"names": ["w"], "dtypes": ["uint8"], "shapes": [7]})", "tensor 0 (w): the shape"},
      // A bad shape followed by more shapes and fields: the reader skips the rest of it.
      {R"({"names": ["w", "v"], "dtypes": ["uint8", "uint8"],
           "shapes": [[-1, 5, [7]], [2]], "weight_version": "9"})",
       "tensor 0 (w): the shape"},
      {R"({"names": ["w"], "dtypes": ["float64"], "shapes": [[4611686018427387904, 8]]})",
       "overflows"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_sequence": -1})", "wpub_sequence"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_sequence": 4294967296})",
       "wpub_sequence"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_patch": 3})",
       "wpub_patch must be an object"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_patch": {"base_version": 1,
           "base_checksum": 2, "target_checksum": 3}})",
       "wpub_patch.bytes is missing"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_patch": {"base_version": 1,
           "base_checksum": "2", "target_checksum": 3, "bytes": 4}})",
       "wpub_patch.base_checksum must be an unsigned integer"},
      {R"({"names": [], "dtypes": [], "shapes": [], "wpub_patch": {"base_version": -1,
           "base_checksum": 2, "target_checksum": 3, "bytes": 4}})",
       "wpub_patch.base_version must be an unsigned integer"},
      {R"({"names": ["a"], "dtypes": ["uint8"], "shapes": [[1]],)", "not valid JSON"},
      {R"({"names": [], "dtypes": [], "shapes": []} {})", "content after its JSON object"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<UpdateRequest> r = DecodeUpdateRequest(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(std::string(r.status().message()).find(c.message), std::string::npos)
        << c.body << " -> " << r.status();
  }
}

}  // namespace
}  // namespace wpub::rollout
