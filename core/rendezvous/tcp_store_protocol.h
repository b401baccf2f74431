// The wire format of PyTorch's TCPStore (torch/csrc/distributed/c10d/TCPStoreBackend.hpp and
// TCPStore.cpp), shared by wpub's TCPStore server and client. Requests start with a 1-byte
// QueryType; strings and byte vectors are a uint64 length in native byte order followed by the
// bytes; integers are native-endian. Values, not a library: no state, thread-safe.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace wpub::rendezvous {

// Sent (with no reply) right after connecting: VALIDATE + uint32 magic.
inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;

enum class QueryType : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kCancelWait = 12,
  kPing = 13,
};

enum class CheckResponse : uint8_t { kReady = 0, kNotReady = 1 };
enum class WaitResponse : uint8_t { kStopWaiting = 0, kWaitCanceled = 1 };

// Appends wire-encoded values to a byte vector.
class WireWriter {
 public:
  template <typename T>
  WireWriter& Value(T v) {
    const size_t n = out_.size();
    out_.resize(n + sizeof(T));
    std::memcpy(out_.data() + n, &v, sizeof(T));
    return *this;
  }
  WireWriter& Bytes(const void* data, uint64_t size) {
    Value<uint64_t>(size);
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + size);
    return *this;
  }
  WireWriter& String(const std::string& s) { return Bytes(s.data(), s.size()); }
  WireWriter& Vector(const std::vector<uint8_t>& v) { return Bytes(v.data(), v.size()); }
  std::vector<uint8_t>& bytes() { return out_; }

 private:
  std::vector<uint8_t> out_;
};

// Reads wire-encoded values from a buffer that may hold only part of a message: every read
// returns false (and leaves the reader unusable) once the buffer is exhausted, so a caller can
// retry the whole message when more bytes have arrived.
class WireReader {
 public:
  WireReader(const uint8_t* data, size_t size, uint64_t max_item_bytes)
      : data_(data), size_(size), max_item_bytes_(max_item_bytes) {}

  template <typename T>
  bool Value(T* v) {
    if (size_ - pos_ < sizeof(T)) return false;
    std::memcpy(v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // Strings and vectors; `too_large` is set when the announced length exceeds max_item_bytes
  // (a malformed or hostile client: the connection is closed).
  bool String(std::string* s, bool* too_large) {
    uint64_t n = 0;
    if (!Length(&n, too_large)) return false;
    s->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return true;
  }
  bool Vector(std::vector<uint8_t>* v, bool* too_large) {
    uint64_t n = 0;
    if (!Length(&n, too_large)) return false;
    v->assign(data_ + pos_, data_ + pos_ + n);
    pos_ += n;
    return true;
  }
  size_t consumed() const { return pos_; }

 private:
  bool Length(uint64_t* n, bool* too_large) {
    const size_t start = pos_;
    if (!Value(n)) return false;
    if (*n > max_item_bytes_) {
      *too_large = true;
      return false;
    }
    if (size_ - pos_ < *n) {
      pos_ = start;
      return false;
    }
    return true;
  }

  const uint8_t* data_;
  size_t size_;
  uint64_t max_item_bytes_;
  size_t pos_ = 0;
};

}  // namespace wpub::rendezvous
