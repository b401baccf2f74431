// safetensors checkpoints: a memory-mapped reader that validates a file completely before any
// tensor is used, sharded checkpoints through `model.safetensors.index.json`, and a writer that
// lays out a file's header up front and then takes tensor bytes in any order (pwrite), so a
// converter can stream large outputs without holding them in memory.
//
// Format: a little-endian uint64 N, N bytes of JSON header {"__metadata__": {str: str},
// name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}, then the data section. Offsets are
// relative to the data section; the tensors must tile it exactly (no overlap, no hole, no
// trailing bytes), as the reference implementation requires.
//
// Thread-safety: Reader and Checkpoint are immutable after Open; their spans may be read from
// any thread while the object lives. Writer::Write may be called concurrently (pwrite at fixed
// offsets; concurrent pieces must not overlap); Create and Finish are single-threaded.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"

namespace wpub::safetensors {

// File name of a sharded checkpoint's index, and of an unsharded checkpoint's only file.
inline constexpr absl::string_view kIndexFileName = "model.safetensors.index.json";
inline constexpr absl::string_view kSingleFileName = "model.safetensors";

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxHeaderBytes = 100u << 20;

// safetensors dtype name of a wpub DType ("BF16", "F8_E4M3", ...).
absl::string_view DTypeName(DType dtype);
// Bytes per element of a safetensors dtype name; nullopt for a name the format does not define
// (or a sub-byte type this reader cannot address).
std::optional<int64_t> DTypeSizeOf(absl::string_view name);

// One tensor of a file, as its header describes it.
struct TensorInfo {
  std::string name;
  std::string dtype;                // safetensors name as stored ("BF16", "I16", ...)
  std::optional<DType> wpub_dtype;  // nullopt for a valid dtype wpub has no enum value for
  Shape shape;
  uint64_t begin = 0;  // offsets into the data section
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
  // Desc for the policy; dtype is meaningful only when wpub_dtype is set.
  TensorDesc desc() const { return TensorDesc{name, wpub_dtype.value_or(DType::kUInt8), shape}; }
};

// One memory-mapped, fully validated safetensors file. The mapping is read-only and private;
// pages are faulted in on first touch (nothing is read up front but the header).
class Reader {
 public:
  // INVALID_ARGUMENT naming the file (and the tensor where there is one) for: a file shorter
  // than 8 bytes, a header length beyond the file or above kMaxHeaderBytes, a header that is not
  // a JSON object, an entry without dtype/shape/data_offsets, an unknown dtype, a negative dim
  // or one above 2^63 - 1, offsets out of bounds, reversed, of the wrong length for dtype x
  // shape, overlapping another tensor, leaving a hole, or a non-string metadata value. NOT_FOUND /
  // INTERNAL for I/O errors.
  static absl::StatusOr<std::unique_ptr<Reader>> Open(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in data-offset order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(absl::string_view name) const;
  // The tensor's bytes inside the mapping (valid while the Reader lives).
  absl::Span<const uint8_t> Data(const TensorInfo& info) const;
  uint64_t file_size() const { return file_size_; }
  // Asks the kernel to read the byte range of `infos` ahead (madvise WILLNEED); never blocks
  // and never fails visibly (a hint).
  void Prefetch(const TensorInfo& info) const;

 private:
  Reader() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: either `model.safetensors.index.json` and the shards its weight_map
// names, or a single `model.safetensors`. Every shard is opened (mapped and validated) up front.
class Checkpoint {
 public:
  // Errors name the file and tensor: a malformed index (no weight_map, non-string entries, a
  // shard path that leaves the directory), an index naming a missing shard, a tensor the index
  // maps to a shard that lacks it, a tensor present in a shard but absent from the index or
  // present in two shards, any Reader::Open error; NOT_FOUND when the directory has neither an
  // index nor model.safetensors.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  struct Location {
    int shard = -1;
    const TensorInfo* info = nullptr;
  };

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  // Shard file names (relative to dir), sorted; shard i is readers()[i].
  const std::vector<std::string>& shard_names() const { return shard_names_; }
  const std::vector<std::unique_ptr<Reader>>& readers() const { return readers_; }
  std::optional<Location> Find(absl::string_view name) const;
  uint64_t total_tensor_bytes() const { return total_bytes_; }
  size_t num_tensors() const { return locations_.size(); }

 private:
  Checkpoint() = default;
  std::string dir_;
  bool sharded_ = false;
  std::vector<std::string> shard_names_;
  std::vector<std::unique_ptr<Reader>> readers_;
  absl::flat_hash_map<std::string, Location> locations_;
  uint64_t total_bytes_ = 0;
};

// One tensor to write: name, safetensors dtype name and shape (bytes = numel x dtype size).
struct OutputTensor {
  std::string name;
  std::string dtype;
  Shape shape;
};

// Writes one safetensors file. Create fixes the layout (tensors in the given order, back to back)
// and writes the header; Write fills a tensor's bytes (or a piece of them) in any order; Finish
// checks that every byte was written, flushes and closes. A Writer destroyed without Finish
// leaves a partial file behind: write into a temporary directory.
class Writer {
 public:
  // INVALID_ARGUMENT for a repeated or empty name, "__metadata__" as a tensor name, an unknown
  // dtype or a negative dim; INTERNAL naming the path when the file cannot be created.
  static absl::StatusOr<std::unique_ptr<Writer>> Create(
      const std::string& path, std::vector<OutputTensor> tensors,
      const std::map<std::string, std::string>& metadata);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Writes `bytes` at `offset` inside tensor `index` (blocking pwrite). INVALID_ARGUMENT when the
  // range leaves the tensor; INTERNAL naming the file and tensor on an I/O error.
  absl::Status Write(size_t index, uint64_t offset, absl::Span<const uint8_t> bytes);
  // Byte count of tensor `index`.
  uint64_t nbytes(size_t index) const { return sizes_[index]; }
  const std::vector<OutputTensor>& tensors() const { return tensors_; }
  uint64_t file_size() const { return data_start_ + data_bytes_; }
  // FAILED_PRECONDITION naming the first tensor not completely written; INTERNAL on I/O errors.
  absl::Status Finish();

 private:
  Writer() = default;
  std::string path_;
  int fd_ = -1;
  std::vector<OutputTensor> tensors_;
  std::vector<uint64_t> offsets_;  // into the data section
  std::vector<uint64_t> sizes_;
  // Bytes written per tensor; atomic so pieces of one tensor may be written from several threads.
  std::unique_ptr<std::atomic<uint64_t>[]> written_;
  uint64_t data_start_ = 0;
  uint64_t data_bytes_ = 0;
};

// `model.safetensors.index.json` text: {"metadata": {"total_size": N}, "weight_map": {...}} with
// the weight map in the given order.
std::string IndexJson(uint64_t total_size,
                      const std::vector<std::pair<std::string, std::string>>& weight_map);

}  // namespace wpub::safetensors
