// Engine test helpers (see engine_test_util.h).
#include "tests/engine/engine_test_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

#include "kernels/reference.h"

namespace wpub::engine::testing {

static TestTensor MakeTensor(TensorDesc desc, uint64_t seed) {
  TestTensor t;
  t.full.resize(static_cast<size_t>(desc.nbytes()));
  if (IsQuantizableFloat(desc.dtype)) {
    EXPECT_TRUE(synthetic::FillTensor(desc, seed, absl::MakeSpan(t.full)).ok()) << desc.name;
  } else {
    for (size_t i = 0; i < t.full.size(); ++i) t.full[i] = static_cast<uint8_t>(i * 7 + seed);
  }
  t.input.desc = desc;
  t.input.parts = {TensorPart{InlineSource{}, desc.shape}};
  t.part_bytes = {t.full};
  return t;
}

std::vector<TestBatch> ModelBatches(const synthetic::ModelShape& shape, uint64_t seed) {
  auto model = synthetic::SyntheticModel::Create(shape);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<TestBatch> out;
  for (const auto& b : model->batches()) {
    TestBatch tb{b.megatron_name, {}};
    for (const TensorDesc& d : b.tensors) tb.tensors.push_back(MakeTensor(d, seed));
    out.push_back(std::move(tb));
  }
  return out;
}

std::vector<TestBatch> SteppedBatches(const synthetic::ModelShape& shape, uint64_t seed,
                                      uint64_t version) {
  std::vector<TestBatch> batches = ModelBatches(shape, seed);
  for (uint64_t v = 2; v <= version; ++v) {
    for (TestBatch& b : batches) {
      TestTensor& t = b.tensors[v % b.tensors.size()];
      if (t.full.empty() || t.part_bytes.size() != 1) continue;  // one inline part: itself
      const size_t at = (v * 7919) % t.full.size();
      t.full[at] ^= 0x10;
      t.part_bytes[0][at] ^= 0x10;
    }
  }
  return batches;
}

TestBatch StackedExpertBatch(uint64_t seed) {
  TestBatch b;
  b.megatron_name = "decoder.layers.1.mlp.experts.linear_fc1.weight99";
  const std::string base = "model.layers.1.mlp.stacked_experts.";
  b.tensors.push_back(MakeTensor({base + "gate_proj.weight", DType::kBFloat16, {3, 32, 64}}, seed));
  b.tensors.push_back(MakeTensor({base + "up_proj.weight", DType::kBFloat16, {3, 32, 64}}, seed));
  b.tensors.push_back(MakeTensor({base + "down_proj.weight", DType::kFloat32, {3, 64, 32}}, seed));
  SplitIntoParts(b.tensors[0], 1, 2);
  SplitIntoParts(b.tensors[1], 1, 4);
  SplitIntoParts(b.tensors[2], 0, 3);
  return b;
}

void SplitIntoParts(TestTensor& t, int dim, int n) {
  const Shape& s = t.input.desc.shape;
  ASSERT_EQ(s[dim] % n, 0);
  const int64_t esize = DTypeSize(t.input.desc.dtype);
  int64_t outer = 1, inner = esize;
  for (int d = 0; d < dim; ++d) outer *= s[d];
  for (size_t d = dim + 1; d < s.size(); ++d) inner *= s[d];
  const int64_t width = s[dim] / n;
  t.input.parts.clear();
  t.part_bytes.clear();
  t.input.concat_dim = dim;
  for (int p = 0; p < n; ++p) {
    Shape ps = s;
    ps[dim] = width;
    std::vector<uint8_t> bytes;
    for (int64_t o = 0; o < outer; ++o) {
      const uint8_t* src = t.full.data() + (o * s[dim] + p * width) * inner;
      bytes.insert(bytes.end(), src, src + width * inner);
    }
    t.input.parts.push_back(TensorPart{InlineSource{}, ps});
    t.part_bytes.push_back(std::move(bytes));
  }
}

std::unique_ptr<ShmSegment> ShmSegment::Create(const std::string& name, size_t size) {
  shm_unlink(name.c_str());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_NE(p, MAP_FAILED);
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, static_cast<uint8_t*>(p), size));
}

ShmSegment::~ShmSegment() {
  munmap(data_, size_);
  shm_unlink(name_.c_str());
}

void ShmSegment::Truncate(size_t size) {
  const int fd = shm_open(name_.c_str(), O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  close(fd);
}

void ShmSegment::Place(TestTensor& t, uint64_t offset) {
  ASSERT_LE(offset + t.full.size(), size_);
  std::memcpy(data_ + offset, t.full.data(), t.full.size());
  t.input.parts = {TensorPart{ShmSource{name_, offset, t.full.size()}, t.input.desc.shape}};
  t.input.concat_dim = 0;
  t.part_bytes = {{}};
}

PublicationHeader Header(uint64_t version, std::string recipe) {
  PublicationHeader h;
  h.version = version;
  h.model_id = "glm-small";
  h.recipe = std::move(recipe);
  h.quantization_config_json = R"({"quant_algo": "NVFP4", "quant_method": "modelopt"})";
  return h;
}

absl::Status Send(PublicationSession& session, const std::vector<TestBatch>& batches,
                  size_t chunk) {
  const uint64_t first = session.num_batches();
  for (const TestBatch& b : batches) {
    BatchInput in{b.megatron_name, {}};
    for (const TestTensor& t : b.tensors) in.tensors.push_back(t.input);
    if (absl::Status s = session.AddBatch(std::move(in)); !s.ok()) return s;
  }
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    for (size_t ti = 0; ti < batches[bi].tensors.size(); ++ti) {
      const TestTensor& t = batches[bi].tensors[ti];
      for (size_t p = t.input.parts.size(); p-- > 0;) {
        if (!std::holds_alternative<InlineSource>(t.input.parts[p].source)) continue;
        const std::vector<uint8_t>& bytes = t.part_bytes[p];
        for (size_t off = 0; off < bytes.size() || (off == 0 && bytes.empty()); off += chunk) {
          const size_t n = std::min(chunk, bytes.size() - off);
          absl::Status s =
              session.AppendInline(first + bi, static_cast<uint32_t>(ti), static_cast<uint32_t>(p),
                                   off, absl::MakeConstSpan(bytes.data() + off, n));
          if (!s.ok()) return s;
          if (bytes.empty()) break;
        }
      }
    }
  }
  return absl::OkStatus();
}

static kernels::WeightDesc Whole(const TestTensor& t) {
  const Shape& s = t.input.desc.shape;
  const kernels::ElemType type = t.input.desc.dtype == DType::kFloat32   ? kernels::ElemType::kF32
                                 : t.input.desc.dtype == DType::kFloat16 ? kernels::ElemType::kF16
                                                                         : kernels::ElemType::kBF16;
  if (s.size() == 3) return kernels::WeightDesc::Stack(t.full.data(), s[0], s[1], s[2], type);
  return kernels::WeightDesc::Dense(t.full.data(), s[0], s[1], type);
}

std::map<std::string, std::vector<uint8_t>> ExpectedOutputs(const std::vector<TestBatch>& batches,
                                                            const policy::Policy& policy,
                                                            kernels::QuantMode mode) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const TestBatch& b : batches) {
    std::vector<TensorDesc> descs;
    for (const TestTensor& t : b.tensors) descs.push_back(t.input.desc);
    auto plan = policy.PlanBatch(b.megatron_name, descs);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return out;
    for (size_t i = 0; i < b.tensors.size(); ++i) {
      const policy::TensorPlan& tp = plan->tensors[i];
      if (tp.action == policy::Action::kPass) {
        out[b.tensors[i].input.desc.name] = b.tensors[i].full;
        continue;
      }
      const kernels::WeightDesc w = Whole(b.tensors[i]);
      std::vector<float> amax(static_cast<size_t>(w.num_slices));
      if (tp.partner >= 0) {
        const bool gate = tp.action == policy::Action::kQuantizeGate;
        const kernels::WeightDesc other = Whole(b.tensors[static_cast<size_t>(tp.partner)]);
        EXPECT_EQ(gate ? kernels::ComputePairAmax(w, other, amax.data())
                       : kernels::ComputePairAmax(other, w, amax.data()),
                  kernels::KernelStatus::kOk);
      } else {
        EXPECT_EQ(kernels::ComputeAmax(w, amax.data()), kernels::KernelStatus::kOk);
      }
      const TensorDesc& dp = plan->outputs[tp.first_output];
      const TensorDesc& ds = plan->outputs[tp.first_output + 1];
      const TensorDesc& d2 = plan->outputs[tp.first_output + 2];
      std::vector<uint8_t> packed(dp.nbytes()), scales(ds.nbytes()), dec(d2.nbytes());
      kernels::QuantOutput q;
      q.packed = packed.data();
      q.scales = scales.data();
      q.decode_scale = reinterpret_cast<float*>(dec.data());
      EXPECT_EQ(kernels::Quantize(w, amax.data(), mode, q), kernels::KernelStatus::kOk);
      out[dp.name] = std::move(packed);
      out[ds.name] = std::move(scales);
      out[d2.name] = std::move(dec);
    }
  }
  return out;
}

std::unique_ptr<policy::Policy> PlainPolicy(policy::Recipe recipe) {
  policy::PolicySettings s;
  s.recipe = recipe;
  s.quantization.quant_algo = "NVFP4";
  s.quantization.quant_method = "modelopt";
  auto p = policy::Policy::Create(s);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

bool HasSubstr(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

std::vector<TestBatch> VersionedModel::Batches(uint64_t version) const {
  return ModelBatches(synthetic::ModelShape::Tiny(), seed_base_ + version);
}

const std::map<std::string, std::vector<uint8_t>>& VersionedModel::Expected(uint64_t version) {
  auto it = expected_.find(version);
  if (it == expected_.end()) {
    it = expected_
             .emplace(version,
                      ExpectedOutputs(Batches(version), *policy_, kernels::QuantMode::Standard()))
             .first;
  }
  return it->second;
}

}  // namespace wpub::engine::testing
