// CPU backend: global amax over every quantization group first (so non-finite weights reject
// the publication before anything is sent), then bucket by bucket: quantize in place into the
// bucket, gather passthrough parts, checksum, emit.
#include "core/engine/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/engine/weight_pieces.h"
#include "core/transport/checksum.h"
#include "kernels/reference.h"

namespace wpub::engine {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The part addresses of an input as the kernels read them (host memory here).
absl::StatusOr<std::vector<WeightPiece>> MakePieces(const InputTensor& in) {
  std::vector<const uint8_t*> data;
  data.reserve(in.parts.size());
  for (const PartView& p : in.parts) data.push_back(p.data);
  return SplitIntoWeightPieces(in, data);
}

absl::Status KernelError(kernels::KernelStatus st, const std::string& what,
                         const std::string& msg) {
  return absl::InternalError(
      absl::StrCat(what, ": ", kernels::KernelStatusString(st), msg.empty() ? "" : ": ", msg));
}

// Non-finite elements of a floating-point tensor's bytes (exponent all ones), eight bytes at a
// time (SWAR), since this scan reads every passed-through byte.
uint64_t CountNonFinite(const uint8_t* p, uint64_t nbytes, DType dtype) {
  // Per lane width: the exponent mask replicated in every lane, and the lowest bit of each lane.
  uint64_t mask = 0, ones = 0;
  int lane_bits = 0;
  switch (dtype) {
    case DType::kBFloat16:
      mask = 0x7F807F807F807F80ull, ones = 0x0001000100010001ull, lane_bits = 16;
      break;
    case DType::kFloat16:
      mask = 0x7C007C007C007C00ull, ones = 0x0001000100010001ull, lane_bits = 16;
      break;
    case DType::kFloat32:
      mask = 0x7F8000007F800000ull, ones = 0x0000000100000001ull, lane_bits = 32;
      break;
    case DType::kFloat64:
      mask = 0x7FF0000000000000ull, ones = 1, lane_bits = 64;
      break;
    default:
      return 0;
  }
  const uint64_t highs = ones << (lane_bits - 1);
  const uint64_t lane_all = lane_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << lane_bits) - 1;
  uint64_t n = 0;
  for (uint64_t i = 0; i < nbytes; i += 8) {
    uint64_t w = 0;  // a zero-padded tail counts nothing: zero lanes are finite
    std::memcpy(&w, p + i, std::min<uint64_t>(8, nbytes - i));
    // A lane is non-finite iff (w & mask) equals mask there, i.e. v = (w & mask) ^ mask has a
    // zero lane. v's lane sign bits are clear, so the SWAR zero test has no false negatives.
    const uint64_t v = (w & mask) ^ mask;
    if (((v - ones) & ~v & highs) == 0) continue;
    for (int shift = 0; shift < 64; shift += lane_bits) n += ((v >> shift) & lane_all) == 0;
  }
  return n;
}

// Appends an input's parts, concatenated along its concat_dim, to `out` (whose capacity is
// already reserved: appending instead of writing into a resized vector skips zero-filling the
// passed-through bytes).
void AppendParts(const InputTensor& in, std::vector<uint8_t>& out) {
  if (in.parts.size() == 1 || in.concat_dim == 0) {
    for (const PartView& p : in.parts) out.insert(out.end(), p.data, p.data + p.nbytes);
    return;
  }
  const int64_t outer = in.desc.shape[0];
  for (int64_t o = 0; o < outer; ++o) {
    for (const PartView& p : in.parts) {
      const uint64_t row = p.nbytes / static_cast<uint64_t>(outer);
      const uint8_t* src = p.data + static_cast<uint64_t>(o) * row;
      out.insert(out.end(), src, src + row);
    }
  }
}

// Offsets of one quantized input's three outputs in a bucket.
struct QuantSlot {
  size_t input;
  int group;
  uint64_t packed = 0, scales = 0, decode = 0;
};

using InputPieces = std::vector<std::vector<WeightPiece>>;  // [input] (empty: passed through)

// 1. Global amax per group (and slice) into *group_amax, non-finite counts of every input
// (quantized and passed) into *result; INVALID_ARGUMENT naming the first tensor with non-finite
// elements unless the plan allows them.
absl::Status GlobalAmax(const ExecutionPlan& plan, const InputPieces& pieces,
                        const kernels::CpuOptions& cpu, std::vector<std::vector<float>>* group_amax,
                        ExecutionResult* result) {
  const std::vector<InputTensor>& inputs = *plan.inputs;
  auto t0 = Clock::now();
  group_amax->assign(plan.amax_groups.size(), {});
  struct PieceResult {
    size_t input;
    size_t group;
    int64_t slice_offset;
    std::vector<float> amax;
    std::vector<int64_t> nonfinite;
  };
  std::vector<PieceResult> results;
  for (size_t g = 0; g < plan.amax_groups.size(); ++g) {
    (*group_amax)[g].assign(static_cast<size_t>(plan.amax_groups[g].slices), 0.0f);
    for (size_t m : plan.amax_groups[g].members) {
      for (const WeightPiece& p : pieces[m]) {
        results.push_back(PieceResult{m, g, p.slice_offset,
                                      std::vector<float>(static_cast<size_t>(p.slices)),
                                      std::vector<int64_t>(static_cast<size_t>(p.slices))});
      }
    }
  }
  std::vector<kernels::AmaxTask> tasks;
  tasks.reserve(results.size());
  size_t r = 0;
  for (size_t g = 0; g < plan.amax_groups.size(); ++g) {
    for (size_t m : plan.amax_groups[g].members) {
      for (const WeightPiece& p : pieces[m]) {
        tasks.push_back(
            kernels::AmaxTask{&p.weight, 1, results[r].amax.data(), results[r].nonfinite.data()});
        ++r;
      }
    }
  }
  std::string error;
  if (auto st = kernels::ComputeAmax(std::span<const kernels::AmaxTask>(tasks), cpu, &error);
      st != kernels::KernelStatus::kOk) {
    return KernelError(st, absl::StrCat("amax of publication ", plan.version), error);
  }
  std::vector<uint64_t> nonfinite(inputs.size(), 0);
  for (const PieceResult& pr : results) {
    for (size_t s = 0; s < pr.amax.size(); ++s) {
      float& dst = (*group_amax)[pr.group][static_cast<size_t>(pr.slice_offset) + s];
      dst = std::max(dst, pr.amax[s]);  // amax never NaN (skipped); max is exact
      nonfinite[pr.input] += static_cast<uint64_t>(pr.nonfinite[s]);
    }
  }
  result->quantize_seconds += Since(t0);
  // Passed-through floating-point tensors.
  t0 = Clock::now();
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    if (plan.sources[i].kind != OutputKind::kPassthrough) continue;
    const InputTensor& in = inputs[plan.sources[i].input];
    for (const PartView& p : in.parts) {
      nonfinite[plan.sources[i].input] += CountNonFinite(p.data, p.nbytes, in.desc.dtype);
    }
  }
  result->pack_seconds += Since(t0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    result->non_finite += nonfinite[i];
    if (nonfinite[i] != 0 && !plan.allow_non_finite) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", inputs[i].desc.name, " has ", nonfinite[i],
                       " non-finite elements (NaN/Inf); the publication is rejected "
                       "(allow_non_finite is off)"));
    }
  }
  return absl::OkStatus();
}

// 2a. A bucket's bytes in offset order: passed-through tensors appended back to back, room for
// the quantized outputs; returns where each quantized input's outputs go.
absl::StatusOr<std::vector<QuantSlot>> LayOutBucket(const ExecutionPlan& plan,
                                                    const transport::BucketLayout& layout,
                                                    std::vector<uint8_t>* bytes) {
  const std::vector<InputTensor>& inputs = *plan.inputs;
  bytes->reserve(layout.nbytes);
  std::vector<QuantSlot> slots;
  std::unordered_map<size_t, size_t> slot_of;  // input -> index into slots
  for (const transport::PlacedTensor& t : layout.tensors) {
    const OutputSource& src = plan.sources[t.output];
    if (bytes->size() != t.offset) {
      return absl::InternalError(absl::StrCat("bucket ", layout.index, ": tensor ",
                                              plan.outputs[t.output].name, " at offset ", t.offset,
                                              ", packed up to ", bytes->size()));
    }
    if (src.kind == OutputKind::kPassthrough) {
      AppendParts(inputs[src.input], *bytes);
      continue;
    }
    bytes->resize(bytes->size() + t.nbytes);  // written by the quantizer
    auto [it, added] = slot_of.emplace(src.input, slots.size());
    if (added) slots.push_back(QuantSlot{src.input, src.amax_group});
    QuantSlot& slot = slots[it->second];
    if (src.kind == OutputKind::kPacked) slot.packed = t.offset;
    if (src.kind == OutputKind::kScales) slot.scales = t.offset;
    if (src.kind == OutputKind::kDecodeScale) slot.decode = t.offset;
  }
  if (bytes->size() != layout.nbytes) {
    return absl::InternalError(absl::StrCat("bucket ", layout.index, " packed ", bytes->size(),
                                            " bytes, planned ", layout.nbytes));
  }
  return slots;
}

// 2b. The quantized outputs of a bucket, written at their slots in `base`.
absl::Status QuantizeBucket(const ExecutionPlan& plan, const transport::BucketLayout& layout,
                            const InputPieces& pieces,
                            const std::vector<std::vector<float>>& group_amax,
                            const std::vector<QuantSlot>& slots, const kernels::CpuOptions& cpu,
                            uint8_t* base) {
  const std::vector<InputTensor>& inputs = *plan.inputs;
  std::vector<kernels::QuantizeTask> tasks;
  for (const QuantSlot& slot : slots) {
    const Shape& s = inputs[slot.input].desc.shape;
    const int64_t rows = s[s.size() - 2];
    const int64_t cols = s.back();
    const uint64_t packed_stride = static_cast<uint64_t>(rows * cols / 2);
    const uint64_t scale_stride = static_cast<uint64_t>(rows * cols / 16);
    for (const WeightPiece& p : pieces[slot.input]) {
      const uint64_t so = static_cast<uint64_t>(p.slice_offset);
      kernels::QuantizeTask task;
      task.weight = &p.weight;
      task.amax = group_amax[static_cast<size_t>(slot.group)].data() + so;
      task.out.packed = base + slot.packed + so * packed_stride;
      task.out.scales = base + slot.scales + so * scale_stride;
      task.out.decode_scale = reinterpret_cast<float*>(base + slot.decode) + so;
      tasks.push_back(task);
    }
  }
  if (tasks.empty()) return absl::OkStatus();
  std::string error;
  if (auto st =
          kernels::Quantize(std::span<const kernels::QuantizeTask>(tasks), plan.mode, cpu, &error);
      st != kernels::KernelStatus::kOk) {
    return KernelError(st, absl::StrCat("quantize of bucket ", layout.index), error);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const CpuBackendOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError("cpu backend: num_threads must be >= 0");
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(options));
}

absl::StatusOr<ExecutionResult> CpuBackend::Execute(const ExecutionPlan& plan,
                                                    const ExecutionHooks& hooks) {
  const std::vector<InputTensor>& inputs = *plan.inputs;
  const kernels::CpuOptions cpu{options_.num_threads};
  ExecutionResult result;

  // Pieces of every quantized input (index = input; empty for passed inputs).
  InputPieces pieces(inputs.size());
  for (const AmaxGroupPlan& g : plan.amax_groups) {
    for (size_t m : g.members) {
      WPUB_ASSIGN_OR_RETURN(pieces[m], MakePieces(inputs[m]));
    }
  }
  std::vector<std::vector<float>> group_amax;
  WPUB_RETURN_IF_ERROR(GlobalAmax(plan, pieces, cpu, &group_amax, &result));

  // 2. Buckets: laid out, quantized, checksummed, emitted (host buckets).
  const int threads = options_.num_threads == 0
                          ? static_cast<int>(std::thread::hardware_concurrency())
                          : options_.num_threads;
  for (const transport::BucketLayout& layout : plan.buckets) {
    if (hooks.cancelled && hooks.cancelled()) {
      return absl::CancelledError(absl::StrCat("publication ", plan.version, " was cancelled"));
    }
    auto t0 = Clock::now();
    auto bucket = std::make_shared<transport::Bucket>();
    bucket->version = plan.version;
    bucket->manifest = transport::MakeBucketManifest(layout, plan.outputs);
    WPUB_ASSIGN_OR_RETURN(const std::vector<QuantSlot> slots,
                          LayOutBucket(plan, layout, &bucket->bytes));
    uint8_t* base = bucket->bytes.data();
    result.pack_seconds += Since(t0);
    t0 = Clock::now();
    WPUB_RETURN_IF_ERROR(QuantizeBucket(plan, layout, pieces, group_amax, slots, cpu, base));
    result.quantize_seconds += Since(t0);
    t0 = Clock::now();
    bucket->manifest.checksum = transport::ParallelChecksum(base, layout.nbytes, threads);
    result.pack_seconds += Since(t0);
    WPUB_RETURN_IF_ERROR(hooks.emit(std::move(bucket)));
  }
  return result;
}

}  // namespace wpub::engine
