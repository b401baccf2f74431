// What a published version or a checkpoint holds, and how two of them differ: the library behind
// `wpubctl inspect` and `wpubctl diff`.
//
// A Snapshot is one of
//  - a receiver's file (`wpub-recv --output`): one safetensors file whose __metadata__ carries
//    the version, model_id and recipe it holds;
//  - a checkpoint directory (`wpubctl convert`'s output or any HF checkpoint): an index and its
//    shards, or model.safetensors, with config.json and hf_quant_config.json when present.
// Inspect groups the tensors into modules: an NVFP4 module is `<m>.weight` (U8, [rows, cols/2])
// with `<m>.weight_scale` (F8_E4M3, [rows, cols/16]), `<m>.weight_scale_2` (F32, one element or
// one per stacked slice) and optionally `<m>.input_scale` (F32); every other tensor is high
// precision and gets the offline policy's reason for not being quantized (specs/policy.md), or,
// where that reason would have been "quantized", the exclude_modules entry that kept it (a BF16
// layer's glob, an excluded module) when the checkpoint has one. Checks report what an engine's
// NVFP4 loader would reject: incomplete or misshapen NVFP4 modules, scales without their NVFP4
// weight, a non-finite or non-positive global scale, a quantized module some engine's reading
// of the exclude list names, a high-precision linear weight (not an embedding) that no
// reading names (engines would expect NVFP4 there), NVFP4 modules under a quant_algo that is
// not an FP4 one; the exclude checks are skipped for MIXED_PRECISION configs.
//
// Checksums are the project's 64-bit bucket checksum (core/transport/checksum.h) over each tensor's
// bytes; a snapshot's digest is that checksum over the (name length, name, dtype, rank, shape,
// checksum) of every tensor in name order, so two snapshots with one digest hold the same bytes
// under the same names, whatever their sharding -- against accidents, not tampering (the
// checksum is not cryptographic), and configs are not part of it.
//
// Diff matches tensors by name: identical bytes, changed bytes (with the count of differing
// elements and the largest absolute difference: of the values for float tensors, of the
// dequantized values for NVFP4 weights), an NVFP4 weight whose codes are equal but whose scales
// changed (its dequantized values differ), a changed dtype or shape, or present on one side only.
//
// Thread-safety: a Snapshot is immutable after Open and its mapped bytes may be read from any
// thread while it lives. Inspect and Diff block the caller; they checksum and compare tensors
// on `threads` worker threads (0: one per hardware thread), each tensor on one thread, and
// their results do not depend on the thread count.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"
#include "core/policy/ignore_rules.h"

namespace wpub::inspect {

// An exclude list (hf_quant_config.json's exclude_modules, config.json's ignore) as the engines
// read it, which is not one way. Immutable; thread-safe.
class ExcludeList {
 public:
  // INVALID_ARGUMENT quoting the entry for a `re:` entry that does not compile (the project's
  // ignore-rule bounds and RE2 syntax, core/policy/ignore_rules.h).
  static absl::StatusOr<ExcludeList> Create(std::vector<std::string> entries);

  const std::vector<std::string>& entries() const { return entries_; }
  // The first entry every engine reads as naming `module` (the narrowest reading), nullptr for
  // none: an entry with '*' or '?' is a glob over the whole name (fnmatch); a `re:` entry and
  // any other are the project's ignore rules -- a regex anchored at the start, or the module
  // itself or a dotted ancestor ("model.layers.3" names "model.layers.3.mlp.gate", the way a
  // fused-MoE layer's prefix names its experts).
  const std::string* EveryEngine(absl::string_view module) const;
  // The first entry some engine reads as naming it: EveryEngine's, or a plain entry that is a
  // substring of the name (vLLM's rule: "model.layers.1" also names "model.layers.10.mlp.gate").
  const std::string* AnyEngine(absl::string_view module) const;

 private:
  ExcludeList(std::vector<std::string> entries, policy::RegexIgnoreRules rules)
      : entries_(std::move(entries)), rules_(std::move(rules)) {}
  std::vector<std::string> entries_;
  // entries_ as ignore rules; a glob entry is inert there (no name holds its '*' or '?').
  policy::RegexIgnoreRules rules_;
};

// One tensor of a snapshot: its header entry and its bytes (mapped, valid while the Snapshot
// lives).
struct Tensor {
  std::string name;
  std::string dtype;  // safetensors name as stored ("BF16", "U8", "F8_E4M3", ...)
  Shape shape;
  absl::Span<const uint8_t> bytes;
  std::string file;  // file name inside the snapshot (the shard for a directory)
};

class Snapshot {
 public:
  enum class Kind : uint8_t { kFile, kDirectory };

  // `path` is a safetensors file or a checkpoint directory. Errors name the path: NOT_FOUND
  // when it does not exist or the directory holds no checkpoint, whatever
  // safetensors::Reader/Checkpoint::Open rejects (malformed headers, offsets, index entries),
  // INVALID_ARGUMENT for an hf_quant_config.json or config.json that is not JSON or whose
  // exclude list is not a list of strings or holds a `re:` entry that does not compile.
  static absl::StatusOr<std::unique_ptr<Snapshot>> Open(const std::string& path);
  ~Snapshot();
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;

  const std::string& path() const { return path_; }
  Kind kind() const { return kind_; }
  // Tensors sorted by name.
  const std::vector<Tensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const Tensor* Find(absl::string_view name) const;
  // A file's __metadata__ (the first shard's for a directory).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // hf_quant_config.json's quantization.quant_algo, else config.json's
  // quantization_config.quant_algo; empty when neither names one.
  const std::string& quant_algo() const { return quant_algo_; }
  // hf_quant_config.json's quantization.exclude_modules, else config.json's
  // quantization_config.ignore; nullptr when the snapshot has no quantization config.
  const ExcludeList* exclude_list() const { return exclude_ ? &*exclude_ : nullptr; }
  // Shard file names (one for a file).
  const std::vector<std::string>& files() const { return files_; }

 private:
  struct Storage;
  Snapshot() = default;
  std::string path_;
  Kind kind_ = Kind::kFile;
  std::unique_ptr<Storage> storage_;  // the mapped readers the tensors' bytes point into
  std::vector<Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
  std::string quant_algo_;
  std::optional<ExcludeList> exclude_;
  std::vector<std::string> files_;
};

// What one tensor is.
enum class Role : uint8_t {
  kNvfp4Weight,       // <m>.weight: packed E2M1 codes of an NVFP4 module
  kNvfp4BlockScale,   // <m>.weight_scale: E4M3 scale per 16 elements
  kNvfp4GlobalScale,  // <m>.weight_scale_2
  kNvfp4InputScale,   // <m>.input_scale
  kHighPrecision,     // anything else
};
// "nvfp4_weight", "nvfp4_block_scale", "nvfp4_global_scale", "nvfp4_input_scale",
// "high_precision".
absl::string_view RoleName(Role role);

struct TensorRow {
  std::string name;
  std::string dtype;
  Shape shape;
  uint64_t nbytes = 0;
  uint64_t checksum = 0;
  Role role = Role::kHighPrecision;
  std::string module;  // the module name (the name without its last component)
  // Why it is (not) quantized: "quantized" for the parts of an NVFP4 module; for a
  // high-precision tensor the offline classifier's reason (policy::ReasonName) or
  // "excluded:<entry>" / "not_excluded" (the classifier would quantize it but it was kept:
  // by the exclude entry shown, or by a setting the snapshot does not record).
  std::string reason;
  std::string file;
};

struct Nvfp4Module {
  std::string name;
  Shape logical_shape;  // the unquantized weight's shape ([slices,] rows, cols)
  bool has_input_scale = false;
  bool has_global_scale = false;  // weight_scale_2 was consistent and read (min/max below)
  float min_global_scale = 0;     // over the slices of weight_scale_2
  float max_global_scale = 0;
};

// Count and bytes of the tensors of one kind (a role, a dtype, a reason).
struct Tally {
  int64_t tensors = 0;
  uint64_t bytes = 0;
};

struct Inventory {
  std::string path;
  Snapshot::Kind kind = Snapshot::Kind::kFile;
  std::map<std::string, std::string> metadata;
  std::string quant_algo;
  std::optional<std::vector<std::string>> exclude_modules;
  std::vector<std::string> files;
  std::vector<TensorRow> tensors;  // by name
  std::vector<Nvfp4Module> modules;
  std::map<std::string, Tally> by_role;    // RoleName
  std::map<std::string, Tally> by_dtype;   // safetensors dtype name
  std::map<std::string, Tally> by_reason;  // high-precision tensors only
  uint64_t total_bytes = 0;
  uint64_t digest = 0;
  // What an engine's loader would reject or misread, one sentence each naming the tensor.
  std::vector<std::string> problems;
};

Inventory Inspect(const Snapshot& snapshot, int threads = 0);

// The text report: the snapshot's kind, metadata and quantization config, tallies by role,
// dtype and reason, the digest, the problems; with `list_tensors`, one line per tensor
// (name, dtype, shape, bytes, checksum, role, reason).
std::string FormatInventory(const Inventory& inventory, bool list_tensors);
// The same as one JSON object (every tensor listed).
std::string InventoryJson(const Inventory& inventory);

enum class Change : uint8_t {
  kIdentical,
  kChangedBytes,   // same dtype and shape, other bytes
  kChangedScales,  // an NVFP4 weight with the same codes whose block or global scales changed
  kChangedDesc,    // other dtype or shape
  kOnlyInA,
  kOnlyInB,
};
// "identical", "changed_bytes", "changed_scales", "changed_desc", "only_in_a", "only_in_b".
absl::string_view ChangeName(Change change);

struct TensorDiff {
  std::string name;
  Change change = Change::kIdentical;
  std::string dtype_a, dtype_b;
  Shape shape_a, shape_b;
  int64_t elements = 0;            // kChangedBytes/kChangedScales: elements compared
  int64_t differing_elements = 0;  // elements whose bytes (NVFP4: codes) differ
  // kChangedBytes, float tensors and NVFP4 weights (dequantized with each side's own scales):
  // the largest |a - b| over elements where both are finite; nullopt for other dtypes.
  std::optional<double> max_abs_diff;
  // kChangedBytes: elements finite on one side and not on the other.
  int64_t finiteness_changes = 0;
};

struct DiffReport {
  std::string path_a, path_b;
  std::vector<TensorDiff> tensors;        // every name of either side, by name
  std::map<std::string, int64_t> counts;  // ChangeName -> tensors
  uint64_t digest_a = 0, digest_b = 0;
  // Metadata keys and quantization config fields whose values differ: key -> (a, b); an absent
  // value reads "<absent>".
  std::map<std::string, std::pair<std::string, std::string>> config_changes;
  // Compare what both sides carry: a tensor only one side has is listed (only_in_a/b) but does
  // not make the report differ -- e.g. an offline conversion (with input_scale) against a live
  // publication of the same weights (which carries none). Set by the caller before formatting.
  bool common_only = false;
  // Every tensor identical (metadata may differ); with common_only, every tensor both sides
  // hold.
  bool identical() const;
};

DiffReport Diff(const Snapshot& a, const Snapshot& b, int threads = 0);

// The text report: counts, config changes, and one line per tensor that is not identical (at
// most `max_rows`; -1 for all).
std::string FormatDiff(const DiffReport& report, int64_t max_rows);
std::string DiffJson(const DiffReport& report);

}  // namespace wpub::inspect
