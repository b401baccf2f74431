// Exact equivalents of the trainer's Megatron-name regexes, and the HF gate/up suffixes.
#include "core/policy/names.h"

#include <array>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"

namespace wpub::policy {
namespace {

// End of the line starting at `from` ('.' never matches '\n').
size_t LineEnd(absl::string_view s, size_t from) {
  const size_t nl = s.find('\n', from);
  return nl == absl::string_view::npos ? s.size() : nl;
}

// re.search(prefix + r"(\d+)\.(.+)", s): the leftmost occurrence of `prefix` followed by digits
// (greedy; backtracking cannot help since a digit is never '.'), a '.', and at least one
// character before the end of the line.
std::optional<MegatronLayer> SearchLayer(absl::string_view s, absl::string_view prefix) {
  for (size_t pos = s.find(prefix); pos != absl::string_view::npos; pos = s.find(prefix, pos + 1)) {
    const size_t digits = pos + prefix.size();
    size_t end = digits;
    while (end < s.size() && absl::ascii_isdigit(static_cast<unsigned char>(s[end]))) ++end;
    if (end == digits || end >= s.size() || s[end] != '.') continue;
    const size_t rest = end + 1;
    const size_t line_end = LineEnd(s, rest);
    if (line_end == rest) continue;
    MegatronLayer m;
    m.index_digits = std::string(s.substr(digits, end - digits));
    m.rest = std::string(s.substr(rest, line_end - rest));
    return m;
  }
  return std::nullopt;
}

struct PairSuffix {
  absl::string_view suffix;
  PairRole role;
};
constexpr std::array<PairSuffix, 5> kPairSuffixes = {{
    {".gate_up_proj.weight", PairRole::kGateUp},
    {".gate_proj.weight", PairRole::kGate},
    {".w1.weight", PairRole::kGate},
    {".up_proj.weight", PairRole::kUp},
    {".w3.weight", PairRole::kUp},
}};

}  // namespace

PairRole PairRoleOf(absl::string_view hf_name, absl::string_view* base) {
  for (const PairSuffix& p : kPairSuffixes) {
    if (absl::EndsWith(hf_name, p.suffix)) {
      *base = hf_name.substr(0, hf_name.size() - p.suffix.size());
      return p.role;
    }
  }
  *base = absl::string_view();
  return PairRole::kNone;
}

std::optional<MegatronLayer> ParseMegatronLayer(absl::string_view megatron_name) {
  if (auto m = SearchLayer(megatron_name, "decoder.layers.")) return m;
  auto m = SearchLayer(megatron_name, "mtp.layers.");
  if (!m) return std::nullopt;
  m->mtp = true;
  // Two passes in this order, as the trainer's chained str.replace does.
  m->rest = absl::StrReplaceAll(m->rest, {{"transformer_layer.", ""}});
  m->rest = absl::StrReplaceAll(m->rest, {{"mtp_model_layer.", ""}});
  return m;
}

bool IsRoutedExpertGemmRest(absl::string_view rest) {
  // "mlp", any character but '\n', "experts."; then (.+) greedy: group 1 ends at the LAST
  // ".weight<digit>" that starts after at least one character and lies within the first line.
  constexpr size_t kGroupStart = 12;  // strlen("mlp.experts.")
  if (rest.size() <= kGroupStart || rest.substr(0, 3) != "mlp" || rest[3] == '\n' ||
      rest.substr(4, 8) != "experts.") {
    return false;
  }
  const size_t line_end = LineEnd(rest, kGroupStart);
  constexpr absl::string_view kWeight = ".weight";
  for (size_t j = rest.rfind(kWeight); j != absl::string_view::npos && j > kGroupStart;
       j = j == 0 ? absl::string_view::npos : rest.rfind(kWeight, j - 1)) {
    const size_t digit = j + kWeight.size();
    if (digit >= line_end || !absl::ascii_isdigit(static_cast<unsigned char>(rest[digit]))) {
      continue;
    }
    const absl::string_view group = rest.substr(kGroupStart, j - kGroupStart);
    return group == "linear_fc1" || group == "linear_fc2";
  }
  return false;
}

}  // namespace wpub::policy
