#include "cli/bytes.h"

#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace wpub::cli {
namespace {

constexpr std::pair<const char*, uint64_t> kUnits[] = {
    {"B", 1},
    {"KiB", uint64_t{1} << 10},
    {"MiB", uint64_t{1} << 20},
    {"GiB", uint64_t{1} << 30},
    {"TiB", uint64_t{1} << 40},
    {"kB", 1000},
    {"KB", 1000},
    {"MB", 1000 * 1000},
    {"GB", 1000 * 1000 * 1000},
    {"TB", uint64_t{1000} * 1000 * 1000 * 1000},
};

constexpr char kUnitsHelp[] =
    "a byte size: a number of bytes, or a number with one of B, KiB, MiB, GiB, TiB (1024^n) or "
    "kB, MB, GB, TB (1000^n), e.g. 256MiB";

}  // namespace

bool AbslParseFlag(absl::string_view text, Bytes* out, std::string* error) {
  text = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < text.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  const absl::string_view number = text.substr(0, digits);
  const absl::string_view unit = absl::StripAsciiWhitespace(text.substr(digits));
  uint64_t scale = 0;
  if (unit.empty()) {
    scale = 1;
  } else {
    for (const auto& [name, factor] : kUnits) {
      if (unit == name) scale = factor;
    }
  }
  if (number.empty() || scale == 0) {
    *error = absl::StrCat("'", text, "' is not ", kUnitsHelp);
    return false;
  }
  uint64_t whole = 0;
  if (absl::SimpleAtoi(number, &whole)) {
    if (whole > UINT64_MAX / scale) {
      *error = absl::StrCat("'", text, "' is more than 2^64 - 1 bytes");
      return false;
    }
    out->value = whole * scale;
    return true;
  }
  double x = 0;
  if (!absl::SimpleAtod(number, &x) || !std::isfinite(x) || x < 0) {
    *error = absl::StrCat("'", text, "' is not ", kUnitsHelp);
    return false;
  }
  const double bytes = x * static_cast<double>(scale);
  if (bytes >= 18446744073709551616.0 || bytes != std::floor(bytes)) {
    *error = absl::StrCat("'", text, "' is not a whole number of bytes below 2^64");
    return false;
  }
  out->value = static_cast<uint64_t>(bytes);
  return true;
}

std::string AbslUnparseFlag(Bytes b) {
  if (b.value == 0) return "0";
  for (int i = 4; i >= 1; --i) {
    const uint64_t factor = kUnits[i].second;
    if (b.value % factor == 0) return absl::StrCat(b.value / factor, kUnits[i].first);
  }
  return absl::StrCat(b.value);
}

}  // namespace wpub::cli
