// PickleWriter (pickle_writer.h): the opcodes of Python's pickle protocol 3.
#include "core/rollout/pickle_writer.h"

#include <cstring>
#include <limits>

namespace wpub::rollout {
namespace {

void AppendLe(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

PickleWriter::PickleWriter() { out_ = "\x80\x03"; }

PickleWriter& PickleWriter::Global(absl::string_view module, absl::string_view name) {
  out_ += 'c';
  out_.append(module.data(), module.size());
  out_ += '\n';
  out_.append(name.data(), name.size());
  out_ += '\n';
  return *this;
}

PickleWriter& PickleWriter::None() {
  out_ += 'N';
  return *this;
}

PickleWriter& PickleWriter::Bool(bool v) {
  out_ += v ? '\x88' : '\x89';
  return *this;
}

PickleWriter& PickleWriter::Int(int64_t v) {
  if (v >= 0 && v <= 0xff) {
    out_ += 'K';
    AppendLe(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
    out_ += 'J';
    AppendLe(out_, static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    // LONG1: little-endian two's complement, 8 bytes always suffice for int64.
    out_ += '\x8a';
    out_ += '\x08';
    AppendLe(out_, static_cast<uint64_t>(v), 8);
  }
  return *this;
}

PickleWriter& PickleWriter::Float(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  out_ += 'G';
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  return *this;
}

PickleWriter& PickleWriter::Str(absl::string_view utf8) {
  out_ += 'X';
  AppendLe(out_, utf8.size(), 4);
  out_.append(utf8.data(), utf8.size());
  return *this;
}

PickleWriter& PickleWriter::Bytes(absl::string_view b) {
  if (b.size() < 256) {
    out_ += 'C';
    AppendLe(out_, b.size(), 1);
  } else {
    out_ += 'B';
    AppendLe(out_, b.size(), 4);
  }
  out_.append(b.data(), b.size());
  return *this;
}

PickleWriter& PickleWriter::Bytes(absl::Span<const uint8_t> b) {
  return Bytes(absl::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
}

PickleWriter& PickleWriter::Mark() {
  out_ += '(';
  return *this;
}
PickleWriter& PickleWriter::Tuple() {
  out_ += 't';
  return *this;
}
PickleWriter& PickleWriter::List() {
  out_ += 'l';
  return *this;
}
PickleWriter& PickleWriter::Dict() {
  out_ += 'd';
  return *this;
}
PickleWriter& PickleWriter::EmptyTuple() {
  out_ += ')';
  return *this;
}
PickleWriter& PickleWriter::EmptyDict() {
  out_ += '}';
  return *this;
}
PickleWriter& PickleWriter::Reduce() {
  out_ += 'R';
  return *this;
}
PickleWriter& PickleWriter::NewObj() {
  out_ += '\x81';
  return *this;
}
PickleWriter& PickleWriter::Build() {
  out_ += 'b';
  return *this;
}

std::string PickleWriter::Finish() {
  out_ += '.';
  return std::move(out_);
}

}  // namespace wpub::rollout
