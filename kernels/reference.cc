// CPU reference of the NVFP4 kernels. Work is cut into row chunks that a small pool of
// std::threads pulls from an atomic counter; every chunk writes disjoint outputs and the amax
// partials are combined with an order-independent max, so results never depend on the thread
// count.
#include "kernels/reference.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace wpub::kernels {
namespace {

// Elements per chunk of work: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kChunkElements = int64_t{1} << 16;

int ResolveThreads(const CpuOptions& options, int64_t total_elements) {
  int n = options.num_threads;
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t useful = std::max<int64_t>(1, total_elements / kChunkElements);
  return static_cast<int>(std::min<int64_t>(n, useful));
}

// Runs fn(i) for i in [0, n) on `threads` threads (the caller is one of them).
template <class Fn>
void ParallelFor(int64_t n, int threads, const Fn& fn) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  const int extra = static_cast<int>(std::min<int64_t>(threads, n)) - 1;
  pool.reserve(extra);
  for (int t = 0; t < extra; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
}

KernelStatus Fail(std::string* error, std::string message) {
  if (error != nullptr) *error = std::move(message);
  return KernelStatus::kInvalidArgument;
}

// Widens n elements of type t to fp32 (exact).
void Widen(const void* src, ElemType t, int64_t n, float* dst) {
  switch (t) {
    case ElemType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case ElemType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case ElemType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(s[i]);
      return;
    }
  }
}

// Narrows n fp32 values to bf16/fp16 (RNE) at dst.
void Narrow(const float* src, ElemType t, int64_t n, void* dst) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (t == ElemType::kBF16) {
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToFp16(src[i]);
  }
}

const uint8_t* PartSlice(const WeightPart& p, ElemType t, int64_t slice) {
  return static_cast<const uint8_t*>(p.data) +
         static_cast<size_t>(slice * p.rows * p.cols) * ElemSize(t);
}

// Reads logical row `row` of slice `slice` of a (possibly multi-part) weight as fp32.
void ReadRow(const WeightDesc& w, int64_t slice, int64_t row, float* dst) {
  const size_t esize = ElemSize(w.type);
  if (w.concat == ConcatDim::kRows) {
    int64_t r = row;
    for (int p = 0; p < w.num_parts; ++p) {
      const WeightPart& part = w.parts[p];
      if (r < part.rows) {
        Widen(PartSlice(part, w.type, slice) + static_cast<size_t>(r * part.cols) * esize, w.type,
              part.cols, dst);
        return;
      }
      r -= part.rows;
    }
    return;
  }
  for (int p = 0; p < w.num_parts; ++p) {
    const WeightPart& part = w.parts[p];
    Widen(PartSlice(part, w.type, slice) + static_cast<size_t>(row * part.cols) * esize, w.type,
          part.cols, dst);
    dst += part.cols;
  }
}

// max |x| over non-NaN elements and the non-finite count of a contiguous range. Magnitudes
// of non-NaN floats order like their bit patterns, so the max runs on integers; the result is
// the same value the fp32 NaN-skipping max gives.
struct AmaxPartial {
  uint32_t max_bits = 0;  // fp32 bits of the max magnitude
  int64_t nonfinite = 0;
};

AmaxPartial AmaxOfRange(const void* src, ElemType t, int64_t n) {
  AmaxPartial r;
  if (t == ElemType::kF32) {
    const uint32_t* s = static_cast<const uint32_t*>(src);
    uint32_t m = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t a = s[i] & 0x7FFFFFFFu;
      bad += a >= 0x7F800000u;
      m = (a <= 0x7F800000u && a > m) ? a : m;
    }
    r.max_bits = m;
    r.nonfinite = bad;
    return r;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  const uint16_t inf = t == ElemType::kBF16 ? 0x7F80 : 0x7C00;
  uint16_t m = 0;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = s[i] & 0x7FFF;
    bad += a >= inf;
    m = (a <= inf && a > m) ? a : m;
  }
  r.max_bits = FloatBits(t == ElemType::kBF16 ? Bf16ToFloat(m) : Fp16ToFloat(m));
  r.nonfinite = bad;
  return r;
}

// Validates a list of weights, naming the index of the first bad one ("weight 3: ...").
KernelStatus ValidateAll(const WeightDesc* const* weights, size_t n, std::string* error) {
  for (size_t i = 0; i < n; ++i) {
    if (weights[i] == nullptr) return Fail(error, "weight " + std::to_string(i) + ": null");
    if (KernelStatus st = ValidateWeight(*weights[i], static_cast<int>(i), error);
        st != KernelStatus::kOk) {
      return st;
    }
  }
  return KernelStatus::kOk;
}

// Resolves the per-slice amax of each task: the caller's, or computed from the weight alone.
template <class Task>
std::vector<std::vector<float>> ResolveAmax(std::span<const Task> tasks,
                                            const CpuOptions& options) {
  std::vector<std::vector<float>> result(tasks.size());
  std::vector<AmaxTask> to_compute;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int64_t slices = tasks[i].weight->num_slices;
    result[i].assign(static_cast<size_t>(slices), 0.0f);
    if (tasks[i].amax != nullptr) {
      std::copy(tasks[i].amax, tasks[i].amax + slices, result[i].begin());
    } else {
      to_compute.push_back(AmaxTask{tasks[i].weight, 1, result[i].data(), nullptr});
    }
  }
  if (!to_compute.empty()) ComputeAmax(to_compute, options, nullptr);
  return result;
}

// A chunk of rows [begin, end) of the flattened [slices * rows] of task `task`.
struct RowChunk {
  size_t task;
  int64_t begin;
  int64_t end;
};

std::vector<RowChunk> MakeRowChunks(const std::vector<int64_t>& total_rows,
                                    const std::vector<int64_t>& cols, int64_t* elements) {
  std::vector<RowChunk> chunks;
  *elements = 0;
  for (size_t t = 0; t < total_rows.size(); ++t) {
    const int64_t step = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, cols[t]));
    for (int64_t b = 0; b < total_rows[t]; b += step) {
      chunks.push_back(RowChunk{t, b, std::min(total_rows[t], b + step)});
    }
    *elements += total_rows[t] * cols[t];
  }
  return chunks;
}

template <class Traits>
KernelStatus QuantizeImpl(std::span<const QuantizeTask> tasks, const CpuOptions& options) {
  const std::vector<std::vector<float>> amax = ResolveAmax(tasks, options);
  std::vector<std::vector<TensorScales>> scales(tasks.size());
  std::vector<int64_t> total_rows(tasks.size()), cols(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    const WeightDesc& w = *tasks[t].weight;
    for (float a : amax[t]) scales[t].push_back(MakeTensorScales(a, Traits::kE4M3Max));
    for (size_t s = 0; s < scales[t].size(); ++s) tasks[t].out.decode_scale[s] = scales[t][s].s_dec;
    total_rows[t] = w.num_slices * w.rows();
    cols[t] = w.cols();
  }
  int64_t elements = 0;
  const std::vector<RowChunk> chunks = MakeRowChunks(total_rows, cols, &elements);
  ParallelFor(static_cast<int64_t>(chunks.size()), ResolveThreads(options, elements),
              [&](int64_t c) {
                const RowChunk& chunk = chunks[static_cast<size_t>(c)];
                const QuantizeTask& task = tasks[chunk.task];
                const WeightDesc& w = *task.weight;
                const int64_t k = cols[chunk.task], kv = k / kBlockSize, rows = w.rows();
                std::vector<float> row(static_cast<size_t>(k));
                for (int64_t u = chunk.begin; u < chunk.end; ++u) {
                  const int64_t slice = u / rows;
                  ReadRow(w, slice, u % rows, row.data());
                  const TensorScales& ts = scales[chunk.task][static_cast<size_t>(slice)];
                  uint8_t* packed = task.out.packed + u * (k / 2);
                  uint8_t* sf = task.out.scales + u * kv;
                  for (int64_t b = 0; b < kv; ++b) {
                    sf[b] = QuantizeBlockPacked<Traits>(row.data() + b * kBlockSize, ts,
                                                        packed + b * (kBlockSize / 2));
                  }
                }
              });
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (tasks[t].out.swizzled == nullptr) continue;
    const WeightDesc& w = *tasks[t].weight;
    const int64_t rows = w.rows(), kv = cols[t] / kBlockSize;
    const int64_t size = SwizzledScaleSize(rows, kv);
    for (int64_t s = 0; s < w.num_slices; ++s) {
      SwizzleScales(tasks[t].out.scales + s * rows * kv, rows, kv,
                    tasks[t].out.swizzled + s * size);
    }
  }
  return KernelStatus::kOk;
}

template <class Traits>
KernelStatus FakeQuantizeImpl(std::span<const QdqTask> tasks, const CpuOptions& options) {
  const std::vector<std::vector<float>> amax = ResolveAmax(tasks, options);
  std::vector<std::vector<TensorScales>> scales(tasks.size());
  std::vector<int64_t> total_rows(tasks.size()), cols(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (float a : amax[t]) scales[t].push_back(MakeTensorScales(a, Traits::kE4M3Max));
    total_rows[t] = tasks[t].weight->num_slices * tasks[t].weight->rows();
    cols[t] = tasks[t].weight->cols();
  }
  int64_t elements = 0;
  const std::vector<RowChunk> chunks = MakeRowChunks(total_rows, cols, &elements);
  ParallelFor(static_cast<int64_t>(chunks.size()), ResolveThreads(options, elements),
              [&](int64_t c) {
                const RowChunk& chunk = chunks[static_cast<size_t>(c)];
                const QdqTask& task = tasks[chunk.task];
                const WeightDesc& w = *task.weight;
                const int64_t k = cols[chunk.task], rows = w.rows();
                std::vector<float> row(static_cast<size_t>(k)), y(static_cast<size_t>(k));
                for (int64_t u = chunk.begin; u < chunk.end; ++u) {
                  const int64_t slice = u / rows;
                  ReadRow(w, slice, u % rows, row.data());
                  const TensorScales& ts = scales[chunk.task][static_cast<size_t>(slice)];
                  for (int64_t b = 0; b < k; b += kBlockSize) {
                    uint8_t codes[kBlockSize];
                    const uint8_t sf = QuantizeBlock<Traits>(row.data() + b, ts, codes);
                    const float factor = DecodeFactor<Traits>(sf, ts.amax);
                    for (int i = 0; i < kBlockSize; ++i) {
                      y[static_cast<size_t>(b + i)] = DecodeElement(codes[i], factor);
                    }
                  }
                  Narrow(y.data(), w.type, k,
                         static_cast<uint8_t*>(task.out) + static_cast<size_t>(u * k) * 2);
                }
              });
  return KernelStatus::kOk;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

KernelStatus ComputeAmax(std::span<const AmaxTask> tasks, const CpuOptions& options,
                         std::string* error) {
  // Contiguous ranges, each contributing to (task, slice); split into chunks for the threads.
  struct Range {
    size_t task;
    int64_t slice;
    const void* data;
    ElemType type;
    int64_t n;
  };
  std::vector<Range> ranges;
  int64_t elements = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const AmaxTask& task = tasks[t];
    if (task.members == nullptr || task.num_members < 1 || task.amax == nullptr) {
      return Fail(error, "amax task " + std::to_string(t) +
                             ": needs at least one member and an amax output");
    }
    for (int m = 0; m < task.num_members; ++m) {
      std::string msg;
      const WeightDesc& w = task.members[m];
      if (ValidateWeight(w, -1, &msg) != KernelStatus::kOk) {
        return Fail(
            error, "amax task " + std::to_string(t) + ", member " + std::to_string(m) + ": " + msg);
      }
      if (w.num_slices != task.members[0].num_slices) {
        return Fail(error, "amax task " + std::to_string(t) + ": member " + std::to_string(m) +
                               " has " + std::to_string(w.num_slices) + " slices, member 0 has " +
                               std::to_string(task.members[0].num_slices));
      }
      for (int64_t s = 0; s < w.num_slices; ++s) {
        for (int p = 0; p < w.num_parts; ++p) {
          const WeightPart& part = w.parts[p];
          const int64_t n = part.rows * part.cols;
          const uint8_t* base = PartSlice(part, w.type, s);
          for (int64_t b = 0; b < n; b += kChunkElements * 4) {
            ranges.push_back(Range{t, s, base + static_cast<size_t>(b) * ElemSize(w.type), w.type,
                                   std::min(n - b, kChunkElements * 4)});
          }
          elements += n;
        }
      }
    }
  }
  std::vector<AmaxPartial> partial(ranges.size());
  ParallelFor(static_cast<int64_t>(ranges.size()), ResolveThreads(options, elements),
              [&](int64_t i) {
                const Range& r = ranges[static_cast<size_t>(i)];
                partial[static_cast<size_t>(i)] = AmaxOfRange(r.data, r.type, r.n);
              });
  for (const AmaxTask& task : tasks) {
    for (int64_t s = 0; s < task.members[0].num_slices; ++s) {
      task.amax[s] = 0.0f;
      if (task.nonfinite != nullptr) task.nonfinite[s] = 0;
    }
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    const AmaxTask& task = tasks[ranges[i].task];
    float& a = task.amax[ranges[i].slice];
    a = MaxSkipNan(a, BitsFloat(partial[i].max_bits));
    if (task.nonfinite != nullptr) task.nonfinite[ranges[i].slice] += partial[i].nonfinite;
  }
  return KernelStatus::kOk;
}

KernelStatus ComputeAmax(const WeightDesc& weight, float* amax, int64_t* nonfinite,
                         const CpuOptions& options, std::string* error) {
  const AmaxTask task{&weight, 1, amax, nonfinite};
  return ComputeAmax(std::span<const AmaxTask>(&task, 1), options, error);
}

KernelStatus ComputePairAmax(const WeightDesc& gate, const WeightDesc& up, float* amax,
                             int64_t* nonfinite, const CpuOptions& options, std::string* error) {
  const WeightDesc members[2] = {gate, up};
  const AmaxTask task{members, 2, amax, nonfinite};
  return ComputeAmax(std::span<const AmaxTask>(&task, 1), options, error);
}

namespace {

KernelStatus CheckScaleInput(const F32Array& amax, int e4m3_max, std::string* error) {
  if (e4m3_max != 448 && e4m3_max != 256) {
    return Fail(error, "e4m3_max " + std::to_string(e4m3_max) + " is neither 448 nor 256");
  }
  int64_t n = 1;
  for (int64_t d : amax.shape) n *= d;
  if (n != static_cast<int64_t>(amax.values.size())) {
    return Fail(error, "amax has " + std::to_string(amax.values.size()) +
                           " values but its shape holds " + std::to_string(n));
  }
  return KernelStatus::kOk;
}

}  // namespace

KernelStatus GlobalEncodeScales(const F32Array& amax, int e4m3_max, F32Array* s_enc,
                                std::string* error) {
  if (KernelStatus st = CheckScaleInput(amax, e4m3_max, error); st != KernelStatus::kOk) return st;
  F32Array r{amax.shape, std::vector<float>(amax.values.size())};
  for (size_t i = 0; i < amax.values.size(); ++i) {
    r.values[i] = GlobalEncodeScale(amax.values[i], static_cast<float>(e4m3_max));
  }
  *s_enc = std::move(r);
  return KernelStatus::kOk;
}

KernelStatus GlobalDecodeScales(const F32Array& amax, int e4m3_max, F32Array* s_dec,
                                std::string* error) {
  if (KernelStatus st = CheckScaleInput(amax, e4m3_max, error); st != KernelStatus::kOk) return st;
  F32Array r{amax.shape, std::vector<float>(amax.values.size())};
  for (size_t i = 0; i < amax.values.size(); ++i) {
    r.values[i] =
        GlobalDecodeScale(GlobalEncodeScale(amax.values[i], static_cast<float>(e4m3_max)));
  }
  *s_dec = std::move(r);
  return KernelStatus::kOk;
}

KernelStatus Quantize(std::span<const QuantizeTask> tasks, QuantMode mode,
                      const CpuOptions& options, std::string* error) {
  if (!mode.IsValid()) return Fail(error, "invalid quantization mode");
  std::vector<const WeightDesc*> weights;
  for (const QuantizeTask& t : tasks) weights.push_back(t.weight);
  if (KernelStatus st = ValidateAll(weights.data(), weights.size(), error);
      st != KernelStatus::kOk) {
    return st;
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    const QuantOutput& o = tasks[i].out;
    if (o.packed == nullptr || o.scales == nullptr || o.decode_scale == nullptr) {
      return Fail(error, "quantize task " + std::to_string(i) +
                             ": packed, scales and decode_scale outputs are required");
    }
  }
  return DispatchQuantMode(mode,
                           [&]<class Traits>() { return QuantizeImpl<Traits>(tasks, options); });
}

KernelStatus Quantize(const WeightDesc& weight, const float* amax, QuantMode mode,
                      const QuantOutput& out, const CpuOptions& options, std::string* error) {
  const QuantizeTask task{&weight, amax, out};
  return Quantize(std::span<const QuantizeTask>(&task, 1), mode, options, error);
}

KernelStatus Dequantize(const QuantizedView& in, QuantMode mode, ElemType out_type, void* out,
                        const CpuOptions& options, std::string* error) {
  if (!mode.IsValid()) return Fail(error, "invalid quantization mode");
  if (out_type != ElemType::kBF16 && out_type != ElemType::kF16) {
    if (error != nullptr) *error = "dequantize outputs bfloat16 or float16 only";
    return KernelStatus::kUnsupported;
  }
  if (in.packed == nullptr || in.scales == nullptr || in.amax == nullptr || out == nullptr ||
      in.rows < 1 || in.num_slices < 1 || in.cols < 1 || in.cols % kBlockSize != 0) {
    return Fail(error,
                "dequantize: needs packed, scales, amax and out, positive extents and "
                "cols (" +
                    std::to_string(in.cols) + ") a multiple of 16");
  }
  const uint32_t inv_six_e = mode.e4m3_max == 448 ? kInv2688Bits : kInv1536Bits;
  const int64_t k = in.cols, kv = k / kBlockSize, total = in.num_slices * in.rows;
  int64_t elements = 0;
  const std::vector<RowChunk> chunks = MakeRowChunks({total}, {k}, &elements);
  ParallelFor(static_cast<int64_t>(chunks.size()), ResolveThreads(options, elements),
              [&](int64_t c) {
                std::vector<float> y(static_cast<size_t>(k));
                for (int64_t u = chunks[static_cast<size_t>(c)].begin;
                     u < chunks[static_cast<size_t>(c)].end; ++u) {
                  const float amax = in.amax[u / in.rows];
                  const uint8_t* packed = in.packed + u * (k / 2);
                  for (int64_t b = 0; b < kv; ++b) {
                    const float factor = DecodeFactor(in.scales[u * kv + b], amax, inv_six_e);
                    for (int64_t i = 0; i < kBlockSize; ++i) {
                      const uint8_t byte = packed[(b * kBlockSize + i) / 2];
                      const uint8_t code = (i % 2 == 0) ? (byte & 0xF) : (byte >> 4);
                      y[static_cast<size_t>(b * kBlockSize + i)] = DecodeElement(code, factor);
                    }
                  }
                  Narrow(y.data(), out_type, k,
                         static_cast<uint8_t*>(out) + static_cast<size_t>(u * k) * 2);
                }
              });
  return KernelStatus::kOk;
}

KernelStatus FakeQuantize(std::span<const QdqTask> tasks, QuantMode mode, const CpuOptions& options,
                          std::string* error) {
  if (!mode.IsValid()) return Fail(error, "invalid quantization mode");
  std::vector<const WeightDesc*> weights;
  for (const QdqTask& t : tasks) weights.push_back(t.weight);
  if (KernelStatus st = ValidateAll(weights.data(), weights.size(), error);
      st != KernelStatus::kOk) {
    return st;
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].out == nullptr) {
      return Fail(error, "qdq task " + std::to_string(i) + ": null output");
    }
    if (tasks[i].weight->type == ElemType::kF32) {
      if (error != nullptr) {
        *error = "qdq task " + std::to_string(i) + ": fused QDQ takes bfloat16 or float16 weights";
      }
      return KernelStatus::kUnsupported;
    }
  }
  return DispatchQuantMode(
      mode, [&]<class Traits>() { return FakeQuantizeImpl<Traits>(tasks, options); });
}

void SwizzleScales(const uint8_t* linear, int64_t rows, int64_t kv, uint8_t* swizzled) {
  std::memset(swizzled, 0, static_cast<size_t>(SwizzledScaleSize(rows, kv)));
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < kv; ++k) swizzled[SwizzledScaleIndex(m, k, kv)] = linear[m * kv + k];
  }
}

}  // namespace wpub::kernels
