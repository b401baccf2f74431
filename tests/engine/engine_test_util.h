// Helpers of the engine tests: a small synthetic MoE as publication inputs (with multi-part,
// stacked and shared-memory tensors), sending a publication, and the independent oracle: the
// policy plus the CPU reference quantizer applied to each whole tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "core/policy/policy.h"
#include "core/synthetic/synthetic.h"
#include "kernels/nvfp4.h"

namespace wpub::engine::testing {

struct TestTensor {
  TensorInput input;                             // parts describe how it is sent
  std::vector<uint8_t> full;                     // the whole tensor, contiguous
  std::vector<std::vector<uint8_t>> part_bytes;  // bytes of each inline part
};

struct TestBatch {
  std::string megatron_name;
  std::vector<TestTensor> tensors;
};

// Every batch of `shape` with deterministic values (seeded); single inline parts.
std::vector<TestBatch> ModelBatches(const synthetic::ModelShape& shape, uint64_t seed);

// Version `version` of an RL run over ModelBatches(shape, seed): version 1 is that model, and
// each later version moves one byte of one tensor of every batch (the tensor and the byte vary
// with the version) -- the few changed elements of an RL step, for bucket patches.
std::vector<TestBatch> SteppedBatches(const synthetic::ModelShape& shape, uint64_t seed,
                                      uint64_t version);

// A conversion batch of stacked [E, M, K] experts in layer 1: a gate/up pair split along dim 1
// (rows of every slice) and a down stack split along dim 0 (experts).
TestBatch StackedExpertBatch(uint64_t seed);

// Re-describes `t` as `n` equal inline parts concatenated along `dim` (0 or 1).
void SplitIntoParts(TestTensor& t, int dim, int n);

// A POSIX shared-memory segment holding some tensors' bytes; unlinked on destruction.
class ShmSegment {
 public:
  static std::unique_ptr<ShmSegment> Create(const std::string& name, size_t size);
  ~ShmSegment();
  uint8_t* data() { return data_; }
  const std::string& name() const { return name_; }
  // Moves `t` into the segment at `offset` as a single shm part.
  void Place(TestTensor& t, uint64_t offset);
  // Shrinks the segment to `size` bytes, as a trainer may at any time (bytes beyond it must
  // not be touched through data() afterwards).
  void Truncate(size_t size);

 private:
  ShmSegment(std::string name, uint8_t* data, size_t size)
      : name_(std::move(name)), data_(data), size_(size) {}
  std::string name_;
  uint8_t* data_;
  size_t size_;
};

// Header of an NVFP4 publication with no ignore rules.
PublicationHeader Header(uint64_t version, std::string recipe = "nvfp4");

// AddBatch for every batch and AppendInline of every inline part in `chunk`-byte chunks
// (parts in reverse order to exercise out-of-order chunks).
absl::Status Send(PublicationSession& session, const std::vector<TestBatch>& batches,
                  size_t chunk = 1000);

// The oracle: name -> bytes of every output tensor.
std::map<std::string, std::vector<uint8_t>> ExpectedOutputs(const std::vector<TestBatch>& batches,
                                                            const policy::Policy& policy,
                                                            kernels::QuantMode mode);

// The policy a header's recipe/config implies (NVFP4, no rules, no exceptions).
std::unique_ptr<policy::Policy> PlainPolicy(policy::Recipe recipe = policy::Recipe::kNvfp4);

// The small model's batches of each version (ModelShape::Tiny, seeded `seed_base + version`)
// and the oracle's outputs of each, computed once per version (standard NVFP4, no rules).
class VersionedModel {
 public:
  explicit VersionedModel(uint64_t seed_base) : seed_base_(seed_base) {}
  std::vector<TestBatch> Batches(uint64_t version) const;
  const std::map<std::string, std::vector<uint8_t>>& Expected(uint64_t version);

 private:
  const uint64_t seed_base_;
  const std::unique_ptr<policy::Policy> policy_ = PlainPolicy();
  std::map<uint64_t, std::map<std::string, std::vector<uint8_t>>> expected_;
};

bool HasSubstr(const absl::Status& s, const std::string& needle);

}  // namespace wpub::engine::testing
