// PickleWriter (pickle_writer.h): the opcodes of Python's pickle protocols 3 and 4.
#include "core/rollout/pickle_writer.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace wpub::rollout {
namespace {

void AppendLe(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

PickleWriter::PickleWriter() = default;

void PickleWriter::Op() {
  const size_t start = frame_ends_.empty() ? 0 : frame_ends_.back();
  if (out_.size() - start >= kFrameTarget) frame_ends_.push_back(out_.size());
}

bool PickleWriter::Get() {
  auto it = memo_.find(key_);
  if (it == memo_.end()) return false;
  if (it->second <= 0xff) {
    out_ += 'h';  // BINGET
    AppendLe(out_, it->second, 1);
  } else {
    out_ += 'j';  // LONG_BINGET
    AppendLe(out_, it->second, 4);
  }
  return true;
}

void PickleWriter::Put() {
  const auto index = static_cast<uint32_t>(memo_.size());
  if (index <= 0xff) {
    out_ += 'q';  // BINPUT
    AppendLe(out_, index, 1);
  } else {
    out_ += 'r';  // LONG_BINPUT
    AppendLe(out_, index, 4);
  }
  memo_.emplace(key_, index);
}

PickleWriter& PickleWriter::Global(absl::string_view module, absl::string_view name) {
  Op();
  key_.assign("g");
  absl::StrAppend(&key_, module, "\n", name);
  if (Get()) return *this;
  out_ += 'c';
  out_.append(module.data(), module.size());
  out_ += '\n';
  out_.append(name.data(), name.size());
  out_ += '\n';
  Put();
  return *this;
}

PickleWriter& PickleWriter::Key(absl::string_view utf8) {
  Op();
  key_.assign("s");
  key_.append(utf8.data(), utf8.size());
  if (Get()) return *this;
  out_ += 'X';  // BINUNICODE
  AppendLe(out_, utf8.size(), 4);
  out_.append(utf8.data(), utf8.size());
  Put();
  return *this;
}

PickleWriter& PickleWriter::None() {
  Op();
  out_ += 'N';
  return *this;
}

PickleWriter& PickleWriter::Bool(bool v) {
  Op();
  out_ += v ? '\x88' : '\x89';
  return *this;
}

PickleWriter& PickleWriter::Int(int64_t v) {
  Op();
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

size_t PickleWriter::Int32Slot(int32_t v) {
  Op();
  out_ += 'J';
  // PROTO (2 bytes), then a 9-byte FRAME header before each frame up to this one.
  const size_t at = 2 + 9 * (frame_ends_.size() + 1) + out_.size();
  AppendLe(out_, static_cast<uint32_t>(v), 4);
  return at;
}

void PickleWriter::PatchInt32(std::string& pickle, size_t at, int32_t v) {
  for (int i = 0; i < 4; ++i) {
    pickle[at + i] = static_cast<char>((static_cast<uint32_t>(v) >> (8 * i)) & 0xff);
  }
}

PickleWriter& PickleWriter::Float(double v) {
  Op();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  out_ += 'G';
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  return *this;
}

PickleWriter& PickleWriter::Str(absl::string_view utf8) {
  Op();
  out_ += 'X';
  AppendLe(out_, utf8.size(), 4);
  out_.append(utf8.data(), utf8.size());
  return *this;
}

PickleWriter& PickleWriter::Bytes(absl::string_view b) {
  Op();
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
  Op();
  out_ += '(';
  return *this;
}
PickleWriter& PickleWriter::Tuple() {
  Op();
  out_ += 't';
  return *this;
}
PickleWriter& PickleWriter::List() {
  Op();
  out_ += 'l';
  return *this;
}
PickleWriter& PickleWriter::Dict() {
  Op();
  out_ += 'd';
  return *this;
}
PickleWriter& PickleWriter::EmptyTuple() {
  Op();
  out_ += ')';
  return *this;
}
PickleWriter& PickleWriter::EmptyDict() {
  Op();
  out_ += '}';
  return *this;
}
PickleWriter& PickleWriter::Reduce() {
  Op();
  out_ += 'R';
  return *this;
}
PickleWriter& PickleWriter::NewObj() {
  Op();
  out_ += '\x81';
  return *this;
}
PickleWriter& PickleWriter::Build() {
  Op();
  out_ += 'b';
  return *this;
}

std::string PickleWriter::Finish() {
  Op();
  out_ += '.';
  frame_ends_.push_back(out_.size());
  std::string framed = "\x80\x04";
  framed.reserve(out_.size() + 2 + 9 * frame_ends_.size());
  size_t start = 0;
  for (size_t end : frame_ends_) {
    framed += '\x95';  // FRAME, an 8-byte length
    AppendLe(framed, end - start, 8);
    framed.append(out_, start, end - start);
    start = end;
  }
  out_.clear();
  frame_ends_.clear();
  return framed;
}

}  // namespace wpub::rollout
