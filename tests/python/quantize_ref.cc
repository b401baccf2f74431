// wpub-quantize-ref: the NVFP4 CPU reference (kernels/reference.h) as a command-line tool, so the
// Python client's tests compare what wpub-recv received with the reference bytes instead of a
// second NVFP4 implementation in Python.
//
//   wpub-quantize-ref --input=in.safetensors --output=ref.safetensors [--recipe=nvfp4]
//                     --groups='a.gate_proj.weight,a.up_proj.weight;b.down_proj.weight;...'
//
// Every tensor of a group (bf16/fp16/fp32, rank 2, or rank 3 for an expert stack) is quantized
// with the group's shared amax (a gate/up pair is one group), giving the policy's three outputs
// per tensor: NAME (uint8 packed), NAME_scale (float8_e4m3fn), NAME_scale_2 (fp32, [] or [E]).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/recv/safetensors.h"
#include "core/common/status.h"
#include "core/engine/recipe.h"
#include "kernels/reference.h"

ABSL_FLAG(std::string, input, "", "safetensors file holding the input tensors.");
ABSL_FLAG(std::string, output, "", "safetensors file to write the reference outputs to.");
ABSL_FLAG(std::string, recipe, "nvfp4", "Recipe (nvfp4 or nvfp4_4over6:<mode>).");
ABSL_FLAG(std::string, groups, "",
          "Groups of tensors sharing one amax: groups separated by ';', names in a group by ','.");

namespace wpub {
namespace {

struct Output {
  TensorDesc desc;
  std::vector<uint8_t> bytes;
};

absl::StatusOr<kernels::WeightDesc> Describe(const std::string& name, const recv::LoadedTensor& t) {
  WPUB_ASSIGN_OR_RETURN(DType dtype, ParseDType(t.dtype));
  kernels::ElemType type;
  switch (dtype) {
    case DType::kBFloat16:
      type = kernels::ElemType::kBF16;
      break;
    case DType::kFloat16:
      type = kernels::ElemType::kF16;
      break;
    case DType::kFloat32:
      type = kernels::ElemType::kF32;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, ": dtype ", t.dtype, " cannot be quantized"));
  }
  if (t.shape.size() == 2)
    return kernels::WeightDesc::Dense(t.bytes.data(), t.shape[0], t.shape[1], type);
  if (t.shape.size() == 3) {
    return kernels::WeightDesc::Stack(t.bytes.data(), t.shape[0], t.shape[1], t.shape[2], type);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tensor ", name, ": rank ", t.shape.size(), " is neither 2 nor 3"));
}

absl::Status Run() {
  WPUB_ASSIGN_OR_RETURN(recv::SafetensorsFile in,
                        recv::ReadSafetensors(absl::GetFlag(FLAGS_input)));
  WPUB_ASSIGN_OR_RETURN(engine::ParsedRecipe recipe,
                        engine::ParseRecipeString(absl::GetFlag(FLAGS_recipe)));
  std::vector<Output> outputs;
  for (absl::string_view group_view :
       absl::StrSplit(absl::GetFlag(FLAGS_groups), ';', absl::SkipEmpty())) {
    const std::string group(group_view);
    std::vector<std::string> names = absl::StrSplit(group, ',', absl::SkipEmpty());
    std::vector<kernels::WeightDesc> members;
    for (const std::string& name : names) {
      auto it = in.tensors.find(name);
      if (it == in.tensors.end()) {
        return absl::NotFoundError(absl::StrCat("tensor ", name, " is not in the input file"));
      }
      WPUB_ASSIGN_OR_RETURN(kernels::WeightDesc w, Describe(name, it->second));
      std::string message;
      if (kernels::ValidateWeight(w, -1, &message) != kernels::KernelStatus::kOk) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", message));
      }
      members.push_back(w);
    }
    if (members.empty()) continue;
    const int64_t slices = members[0].num_slices;
    std::vector<float> amax(static_cast<size_t>(slices));
    kernels::AmaxTask task{members.data(), static_cast<int>(members.size()), amax.data(), nullptr};
    std::string error;
    if (kernels::ComputeAmax(std::span<const kernels::AmaxTask>(&task, 1), {}, &error) !=
        kernels::KernelStatus::kOk) {
      return absl::InvalidArgumentError(absl::StrCat("amax of group ", group, ": ", error));
    }
    for (size_t m = 0; m < members.size(); ++m) {
      const Shape& shape = in.tensors[names[m]].shape;
      const int64_t cols = shape.back();
      Shape packed = shape, scales = shape;
      packed.back() = cols / 2;
      scales.back() = cols / 16;
      Output q{{names[m], DType::kUInt8, packed}, {}};
      Output s{{absl::StrCat(names[m], "_scale"), DType::kFloat8E4M3, scales}, {}};
      Output d{{absl::StrCat(names[m], "_scale_2"), DType::kFloat32,
                shape.size() == 3 ? Shape{shape[0]} : Shape{}},
               {}};
      q.bytes.resize(static_cast<size_t>(q.desc.nbytes()));
      s.bytes.resize(static_cast<size_t>(s.desc.nbytes()));
      d.bytes.resize(static_cast<size_t>(d.desc.nbytes()));
      kernels::QuantOutput out;
      out.packed = q.bytes.data();
      out.scales = s.bytes.data();
      out.decode_scale = reinterpret_cast<float*>(d.bytes.data());
      if (kernels::Quantize(members[m], amax.data(), recipe.mode, out, {}, &error) !=
          kernels::KernelStatus::kOk) {
        return absl::InvalidArgumentError(absl::StrCat("quantize ", names[m], ": ", error));
      }
      outputs.push_back(std::move(q));
      outputs.push_back(std::move(s));
      outputs.push_back(std::move(d));
    }
  }
  std::vector<recv::SafetensorsEntry> entries;
  for (const Output& o : outputs) entries.push_back({o.desc, o.bytes});
  return recv::WriteSafetensors(absl::GetFlag(FLAGS_output), entries,
                                {{"recipe", recipe.canonical}});
}

}  // namespace
}  // namespace wpub

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "wpub-quantize-ref --input=in.safetensors --output=ref.safetensors --groups='a,b;c'");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_input).empty() || absl::GetFlag(FLAGS_output).empty()) {
    std::fprintf(stderr, "wpub-quantize-ref: --input and --output are required\n");
    return 2;
  }
  absl::Status status = wpub::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "wpub-quantize-ref: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
