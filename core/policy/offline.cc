// HF-name classification shared by both paths: gate/up suffixes, the routed-expert test with
// its shared-expert veto, and the offline (checkpoint conversion) classifier.
#include "core/policy/policy.h"

#include <array>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/policy/names.h"

namespace wpub::policy {
namespace {

constexpr std::array<absl::string_view, 2> kSharedExpertMarkers = {".shared_expert.",
                                                                   ".shared_experts."};
constexpr std::array<absl::string_view, 3> kRoutedExpertMarkers = {
    ".experts.", "block_sparse_moe.experts.", ".moe.experts."};
constexpr std::array<absl::string_view, 7> kExpertGemmSuffixes = {
    ".w1.weight",      ".w2.weight",        ".w3.weight",          ".gate_proj.weight",
    ".up_proj.weight", ".down_proj.weight", ".gate_up_proj.weight"};

template <size_t N>
bool ContainsAny(absl::string_view s, const std::array<absl::string_view, N>& needles) {
  for (absl::string_view n : needles) {
    if (absl::StrContains(s, n)) return true;
  }
  return false;
}

// True iff the name contains `model.layers.{i}.` for a BF16 head/tail layer i, with i written
// canonically (as Python's f-string would write it: no sign, no leading zero).
bool InBf16HfLayer(absl::string_view name, const PrecisionExceptions& e) {
  if (!e.first_last_layers_bf16) return false;
  constexpr absl::string_view kPrefix = "model.layers.";
  for (size_t pos = name.find(kPrefix); pos != absl::string_view::npos;
       pos = name.find(kPrefix, pos + 1)) {
    size_t begin = pos + kPrefix.size();
    size_t end = begin;
    while (end < name.size() && absl::ascii_isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end == begin || end >= name.size() || name[end] != '.') continue;
    const absl::string_view digits = name.substr(begin, end - begin);
    if (digits.size() > 1 && digits[0] == '0') continue;
    int64_t i = 0;
    if (!absl::SimpleAtoi(digits, &i)) continue;
    if ((i >= 0 && i < e.num_layers_at_start_in_bf16) ||
        (i >= e.num_layers - e.num_layers_at_end_in_bf16 && i < e.num_layers)) {
      return true;
    }
  }
  return false;
}

}  // namespace

PairName SplitPairName(absl::string_view hf_name) {
  absl::string_view base;
  const PairRole role = PairRoleOf(hf_name, &base);
  return PairName{std::string(base), role};
}

bool IsRoutedExpertHfName(absl::string_view hf_name) {
  if (!absl::EndsWith(hf_name, ".weight")) return false;
  // The veto comes first: `.experts.` nested inside a shared-expert path is not routed.
  if (ContainsAny(hf_name, kSharedExpertMarkers)) return false;
  if (!ContainsAny(hf_name, kRoutedExpertMarkers)) return false;
  for (absl::string_view suffix : kExpertGemmSuffixes) {
    if (absl::EndsWith(hf_name, suffix)) return true;
  }
  return false;
}

absl::StatusOr<OfflineDecision> ClassifyOfflineTensor(const TensorDesc& tensor,
                                                      const PrecisionExceptions& exceptions) {
  OfflineDecision d;
  auto keep = [&d](Reason r) {
    d.quantize = false;
    d.reason = r;
    return d;
  };
  const absl::string_view name = tensor.name;
  for (const std::string& s : exceptions.extra_high_precision_layers_hf) {
    if (absl::StrContains(name, s)) return keep(Reason::kExtraHighPrecision);
  }
  if (InBf16HfLayer(name, exceptions)) return keep(Reason::kBf16Layer);
  if (!absl::EndsWith(name, ".weight")) return keep(Reason::kNotWeight);
  if (ContainsAny(name, kSharedExpertMarkers)) return keep(Reason::kSharedExpert);
  if (!ContainsAny(name, kRoutedExpertMarkers)) return keep(Reason::kNotRoutedExpert);
  if (!IsRoutedExpertHfName(name)) return keep(Reason::kNotExpertGemm);
  if (!IsQuantizableFloat(tensor.dtype)) return keep(Reason::kUnsupportedDType);
  if (tensor.shape.size() < 2) return keep(Reason::kRankBelow2);
  if (tensor.shape.back() % kNvfp4GroupSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Last dim K must be divisible by ",
                                                   kNvfp4GroupSize, " for NVFP4 (", name,
                                                   "): K = ", tensor.shape.back()));
  }
  if (tensor.shape.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantizes rank-2 [M, K] or stacked rank-3 [E, M, K] tensors; ", name,
                     " has shape ", ShapeString(tensor.shape)));
  }
  PairName pn = SplitPairName(name);
  d.quantize = true;
  d.reason = Reason::kQuantized;
  d.role = pn.role;
  if (pn.role == PairRole::kGate || pn.role == PairRole::kUp) d.pair_base = std::move(pn.base);
  return d;
}

}  // namespace wpub::policy
