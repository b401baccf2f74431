// A byte-size flag value: `--bucket_bytes=256MiB`, `--grpc_memory_bytes=1GB`, or a plain count of
// bytes (`--bucket_bytes=268435456`, as before). Units: B; KiB, MiB, GiB, TiB (powers of 1024);
// kB/KB, MB, GB, TB (powers of 1000); an optional space between number and unit; the number is
// an integer, or a decimal whose product with the unit is a whole number of bytes ("1.5GiB").
// Anything else -- "64M", "1 gigabyte", a negative or fractional byte count, more than 2^64 - 1
// bytes -- is refused naming the units. Printed (--help's defaults) in the largest binary unit
// that divides it exactly ("256MiB"), else in bytes.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace wpub::cli {

struct Bytes {
  uint64_t value = 0;
  Bytes() = default;
  constexpr Bytes(uint64_t v) : value(v) {}  // NOLINT: a count of bytes reads as one
  friend bool operator==(Bytes a, Bytes b) { return a.value == b.value; }
};

// absl flag hooks.
bool AbslParseFlag(absl::string_view text, Bytes* out, std::string* error);
std::string AbslUnparseFlag(Bytes b);

}  // namespace wpub::cli
