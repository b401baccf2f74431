// Reference publication: policy plan + CPU reference quantization, per conversion batch.
#include "tests/daemon/reference.h"

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/policy/policy.h"
#include "kernels/reference.h"

namespace wpub::testing {
namespace {

absl::StatusOr<kernels::ElemType> ElemTypeOf(const TensorDesc& desc) {
  switch (desc.dtype) {
    case DType::kBFloat16:
      return kernels::ElemType::kBF16;
    case DType::kFloat16:
      return kernels::ElemType::kF16;
    case DType::kFloat32:
      return kernels::ElemType::kF32;
    default:
      return absl::InvalidArgumentError(absl::StrCat(desc.name, ": not a quantizable dtype"));
  }
}

absl::StatusOr<kernels::WeightDesc> WeightOf(const TensorDesc& desc, const uint8_t* data,
                                             bool stacked) {
  WPUB_ASSIGN_OR_RETURN(kernels::ElemType type, ElemTypeOf(desc));
  const Shape& s = desc.shape;
  if (stacked) return kernels::WeightDesc::Stack(data, s[0], s[1], s[2], type);
  return kernels::WeightDesc::Dense(data, s[0], s[1], type);
}

}  // namespace

absl::StatusOr<ExpectedPublication> ComputeExpected(const synthetic::SyntheticModel& model,
                                                    const policy::PolicySettings& settings,
                                                    kernels::QuantMode mode, uint64_t seed) {
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<policy::Policy> policy, policy::Policy::Create(settings));
  ExpectedPublication out;
  for (const synthetic::ConversionBatch& batch : model.batches()) {
    WPUB_ASSIGN_OR_RETURN(policy::BatchPlan plan,
                          policy->PlanBatch(batch.megatron_name, batch.tensors));
    std::vector<std::vector<uint8_t>> inputs(batch.tensors.size());
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      inputs[i].resize(static_cast<size_t>(batch.tensors[i].nbytes()));
      WPUB_RETURN_IF_ERROR(
          synthetic::FillTensor(batch.tensors[i], seed, absl::MakeSpan(inputs[i])));
      out.input_bytes += inputs[i].size();
    }
    // Global amax per group (a gate/up pair shares one), per slice for stacks.
    std::vector<std::vector<float>> amax(plan.amax_groups.size());
    for (size_t g = 0; g < plan.amax_groups.size(); ++g) {
      const policy::AmaxGroup& group = plan.amax_groups[g];
      std::vector<kernels::WeightDesc> members;
      for (int m : group.members) {
        WPUB_ASSIGN_OR_RETURN(kernels::WeightDesc w, WeightOf(batch.tensors[m], inputs[m].data(),
                                                              plan.tensors[m].stacked));
        members.push_back(w);
      }
      amax[g].assign(static_cast<size_t>(group.slices), 0.0f);
      kernels::AmaxTask task{members.data(), static_cast<int>(members.size()), amax[g].data(),
                             nullptr};
      std::string error;
      if (kernels::ComputeAmax(std::span<const kernels::AmaxTask>(&task, 1), {}, &error) !=
          kernels::KernelStatus::kOk) {
        return absl::InternalError(absl::StrCat(batch.megatron_name, ": amax: ", error));
      }
    }
    for (size_t i = 0; i < batch.tensors.size(); ++i) {
      const policy::TensorPlan& tp = plan.tensors[i];
      if (tp.action == policy::Action::kPass) {
        // The three counts are disjoint: an ignored tensor is not also counted as passed.
        if (tp.reason == policy::Reason::kIgnored) {
          ++out.ignored;
        } else {
          ++out.passthrough;
        }
        const TensorDesc& o = plan.outputs[tp.first_output];
        out.output_bytes += inputs[i].size();
        out.tensors[o.name] = ExpectedTensor{o, inputs[i]};
        continue;
      }
      ++out.quantized;
      const TensorDesc& packed_desc = plan.outputs[tp.first_output];
      const TensorDesc& scale_desc = plan.outputs[tp.first_output + 1];
      const TensorDesc& scale2_desc = plan.outputs[tp.first_output + 2];
      ExpectedTensor packed{packed_desc, std::vector<uint8_t>(packed_desc.nbytes())};
      ExpectedTensor scales{scale_desc, std::vector<uint8_t>(scale_desc.nbytes())};
      ExpectedTensor scale2{scale2_desc, std::vector<uint8_t>(scale2_desc.nbytes())};
      WPUB_ASSIGN_OR_RETURN(kernels::WeightDesc w,
                            WeightOf(batch.tensors[i], inputs[i].data(), tp.stacked));
      kernels::QuantOutput q;
      q.packed = packed.bytes.data();
      q.scales = scales.bytes.data();
      q.decode_scale = reinterpret_cast<float*>(scale2.bytes.data());
      std::string error;
      if (kernels::Quantize(w, amax[tp.amax_group].data(), mode, q, {}, &error) !=
          kernels::KernelStatus::kOk) {
        return absl::InternalError(absl::StrCat(batch.tensors[i].name, ": quantize: ", error));
      }
      for (ExpectedTensor* t : {&packed, &scales, &scale2}) {
        out.output_bytes += t->bytes.size();
        out.tensors[t->desc.name] = std::move(*t);
      }
    }
  }
  return out;
}

}  // namespace wpub::testing
