// core/safetensors: writer/reader round trip, pieces written out of order, sharded index, and
// every malformed file the reader must refuse with the file and tensor named.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace wpub::safetensors {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("wpub_st_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A raw file: 8-byte length (or `len_override`), header text, data bytes.
  std::string Raw(const std::string& name, const std::string& header, size_t data_bytes,
                  std::optional<uint64_t> len_override = std::nullopt) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    const uint64_t len = len_override.value_or(header.size());
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
    out << header << std::string(data_bytes, '\x01');
    return path;
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripWithPiecesInAnyOrder) {
  const std::string path = (dir_ / "a.safetensors").string();
  auto w = Writer::Create(path, {{"x", "BF16", {2, 3}}, {"y", "F32", {}}, {"z", "I16", {4}}},
                          {{"format", "pt"}});
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<uint8_t> x = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<uint8_t> y = {0, 0, 0x80, 0x3f};
  const std::vector<uint8_t> z = {9, 8, 7, 6, 5, 4, 3, 2};
  ASSERT_TRUE((*w)->Write(2, 0, z).ok());
  ASSERT_TRUE((*w)->Write(0, 6, absl::MakeConstSpan(x).subspan(6)).ok());
  EXPECT_THAT((*w)->Finish().message(), HasSubstr("'x' has 6 of 12"));
  ASSERT_TRUE((*w)->Write(0, 0, absl::MakeConstSpan(x).subspan(0, 6)).ok());
  ASSERT_TRUE((*w)->Write(1, 0, y).ok());
  EXPECT_FALSE((*w)->Write(1, 1, y).ok());  // past the tensor's end
  ASSERT_TRUE((*w)->Finish().ok());

  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->metadata().at("format"), "pt");
  ASSERT_EQ((*r)->tensors().size(), 3u);
  EXPECT_EQ((*r)->tensors()[0].name, "x");
  EXPECT_EQ((*r)->tensors()[2].wpub_dtype, std::nullopt);  // I16: valid, no wpub enum value
  const TensorInfo* t = (*r)->Find("x");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (Shape{2, 3}));
  auto data = (*r)->Data(*t);
  EXPECT_EQ(std::vector<uint8_t>(data.begin(), data.end()), x);
  auto zd = (*r)->Data(*(*r)->Find("z"));
  EXPECT_EQ(std::vector<uint8_t>(zd.begin(), zd.end()), z);
  // The header is padded to 8 bytes (data starts aligned).
  EXPECT_EQ(((*r)->file_size() - 24) % 8, 0u);
}

TEST_F(SafetensorsTest, WriterRejectsBadTensorLists) {
  EXPECT_FALSE(
      Writer::Create((dir_ / "b").string(), {{"a", "F32", {1}}, {"a", "F32", {1}}}, {}).ok());
  EXPECT_FALSE(Writer::Create((dir_ / "b").string(), {{"a", "Q4", {1}}}, {}).ok());
  EXPECT_FALSE(Writer::Create((dir_ / "b").string(), {{"__metadata__", "F32", {1}}}, {}).ok());
}

struct BadCase {
  const char* label;
  std::string header;
  size_t data;
  std::optional<uint64_t> len;
  const char* expect;
};

TEST_F(SafetensorsTest, RefusesMalformedFilesNamingFileAndTensor) {
  const std::vector<BadCase> cases = {
      {"truncated_json", R"({"w": {"dtype": "F32", "shape": [1], "data_o)", 4, {}, "truncated"},
      {"len_beyond_file", R"({})", 0, 4096, "beyond the file"},
      {"len_huge", R"({})", 0, uint64_t{1} << 40, "limit"},
      {"not_object", R"([1, 2])", 0, {}, "not a JSON object"},
      {"unknown_dtype",
       R"({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}})",
       1,
       {},
       "'w': unknown dtype 'Q7'"},
      {"out_of_bounds",
       R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})",
       4,
       {},
       "'w': data_offsets [0, 8] are out of bounds"},
      {"overlap",
       R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
       6,
       {},
       "'b': data_offsets [2, 6] overlap tensor 'a'"},
      {"hole",
       R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
           "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})",
       5,
       {},
       "'b': data_offsets start at 3, leaving a hole"},
      {"wrong_length",
       R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})",
       4,
       {},
       "'w': 4 bytes at data_offsets for F32 [2] (8 expected)"},
      {"reversed",
       R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}})",
       4,
       {},
       "reversed"},
      {"negative_dim",
       R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}})",
       0,
       {},
       "negative"},
      // Beside a 0 dim the element count stays 0, so only the dim's own range refuses it.
      {"dim_beyond_int64",
       R"({"w": {"dtype": "U8", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})",
       0,
       {},
       "'w': shape dim 18446744073709551615 is too large"},
      {"trailing",
       R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})",
       3,
       {},
       "trailing"},
      {"bad_metadata", R"({"__metadata__": {"format": 1}})", 0, {}, "not a string"},
  };
  for (const BadCase& c : cases) {
    const std::string path = Raw(std::string(c.label) + ".safetensors", c.header, c.data, c.len);
    auto r = Reader::Open(path);
    ASSERT_FALSE(r.ok()) << c.label;
    EXPECT_THAT(r.status().message(), HasSubstr(path)) << c.label;
    EXPECT_THAT(r.status().message(), HasSubstr(c.expect)) << c.label << ": " << r.status();
  }
  // Shorter than the 8-byte length itself.
  const std::string tiny = (dir_ / "tiny.safetensors").string();
  std::ofstream(tiny, std::ios::binary) << "abc";
  auto r = Reader::Open(tiny);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("truncated header"));
}

TEST_F(SafetensorsTest, ShardedCheckpointAndIndexChecks) {
  for (const char* shard : {"s1.safetensors", "s2.safetensors"}) {
    auto w = Writer::Create((dir_ / shard).string(), {{std::string("t_") + shard, "U8", {2}}}, {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(0, 0, std::vector<uint8_t>{1, 2}).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  auto write_index = [&](const std::vector<std::pair<std::string, std::string>>& wm) {
    std::ofstream(dir_ / std::string(kIndexFileName)) << IndexJson(4, wm);
  };
  write_index({{"t_s1.safetensors", "s1.safetensors"}, {"t_s2.safetensors", "s2.safetensors"}});
  auto c = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->sharded());
  EXPECT_EQ((*c)->num_tensors(), 2u);
  EXPECT_EQ((*c)->Find("t_s2.safetensors")->shard, 1);
  EXPECT_EQ((*c)->total_tensor_bytes(), 4u);

  write_index({{"t_s1.safetensors", "s1.safetensors"}, {"t_s2.safetensors", "s3.safetensors"}});
  c = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("names shard 's3.safetensors', which is missing"));

  write_index({{"t_s1.safetensors", "s1.safetensors"}, {"t_s2.safetensors", "../s2.safetensors"}});
  EXPECT_FALSE(Checkpoint::Open(dir_.string()).ok());

  write_index({{"t_s1.safetensors", "s1.safetensors"}, {"t_s2.safetensors", "s1.safetensors"}});
  c = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("'t_s2.safetensors' is named by the index but missing"));

  write_index({{"t_s1.safetensors", "s1.safetensors"}});
  c = Checkpoint::Open(dir_.string());  // a shard the index does not name is not read
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->num_tensors(), 1u);
  // A shard holding a tensor the index does not name.
  {
    auto w = Writer::Create((dir_ / "s1.safetensors").string(),
                            {{"t_s1.safetensors", "U8", {2}}, {"stray", "U8", {1}}}, {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(0, 0, std::vector<uint8_t>{1, 2}).ok());
    ASSERT_TRUE((*w)->Write(1, 0, std::vector<uint8_t>{3}).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  c = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("tensor 'stray' is not in"));
  fs::remove(dir_ / std::string(kIndexFileName));
  EXPECT_EQ(Checkpoint::Open(dir_.string()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace wpub::safetensors
