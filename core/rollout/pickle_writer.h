// Python pickles written without Python: the engines' weight routes take objects pickled by the
// trainer's Python (SGLang's serialized named tensors, vLLM's pickled ncclUniqueId and IPC
// handles), so the daemon writes the same opcode stream its receiver's `pickle.loads` reads.
// Protocol 4 as Python's pickler writes it where it matters to the receiver's speed:
// - framed: the opcodes go in FRAMEs of ~64 KiB, so an unpickler reading a file object (SGLang's
//   SafeUnpickler over io.BytesIO) reads a frame per call, not one read() per opcode (an
//   unframed pickle of a 6,600-tensor bucket decodes 2.1-2.7x slower:
//   bench/rollout/colocated_decode.py);
// - memoized: globals and keys are written once and BINPUT, every later reference is a BINGET,
//   so a receiver's find_class (SafeUnpickler checks its allowlist in Python per call) runs once
//   per distinct global, not once per tensor.
// Other opcodes are protocol 3's (bytes objects), from pickletools' documentation. A writer
// only appends: the caller writes a well-formed stream (each Mark closed by its
// Tuple/List/Dict), which the unit tests check by loading the result with Python's own pickle
// module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace wpub::rollout {

class PickleWriter {
 public:
  PickleWriter();  // PROTO 4
  // A module-level object by reference ("torch", "bfloat16"): GLOBAL and BINPUT the first time,
  // BINGET after.
  PickleWriter& Global(absl::string_view module, absl::string_view name);
  PickleWriter& None();
  PickleWriter& Bool(bool v);
  PickleWriter& Int(int64_t v);  // BININT1 / BININT / LONG1, the smallest that holds it
  // BININT with all 4 bytes whatever the value, for a caller that rewrites it in copies of the
  // finished pickle (PatchInt32): returns where the 4 bytes are in what Finish() returns.
  size_t Int32Slot(int32_t v);
  // Rewrites the 4 bytes Int32Slot wrote at `at` in a finished pickle.
  static void PatchInt32(std::string& pickle, size_t at, int32_t v);
  PickleWriter& Float(double v);              // BINFLOAT
  PickleWriter& Str(absl::string_view utf8);  // BINUNICODE
  // A str written many times (a dict key of every object): BINUNICODE and BINPUT the first
  // time, BINGET after. The receiver gets the same str object each time, as from Python.
  PickleWriter& Key(absl::string_view utf8);
  PickleWriter& Bytes(absl::Span<const uint8_t> b);  // SHORT_BINBYTES / BINBYTES
  PickleWriter& Bytes(absl::string_view b);
  // MARK ... Tuple() / List() / Dict(): the objects written since the mark become one tuple,
  // list, or dict (alternating keys and values).
  PickleWriter& Mark();
  PickleWriter& Tuple();
  PickleWriter& List();
  PickleWriter& Dict();
  PickleWriter& EmptyTuple();
  PickleWriter& EmptyDict();
  // callable, args-tuple -> callable(*args).
  PickleWriter& Reduce();
  // cls, args-tuple -> cls.__new__(cls, *args) (copyreg.__newobj__ of protocol 2+).
  PickleWriter& NewObj();
  // obj, state -> obj.__setstate__(state) or obj.__dict__.update(state).
  PickleWriter& Build();
  // STOP; the pickle (PROTO, then the opcodes in FRAMEs). The writer is spent.
  std::string Finish();

  // How many objects are memoized (distinct globals and keys written so far).
  size_t memoized() const { return memo_.size(); }

 private:
  // The memo is keyed by `key_`: 'g' module '\n' name for a global, 's' text for a key.
  // Get: a BINGET of key_'s entry and true, or nothing written and false.
  bool Get();
  // BINPUT of the object on top of the stack (the caller wrote it just before) as key_'s entry,
  // under the next index.
  void Put();
  // Called before each object's opcodes: ends the current frame once it holds kFrameTarget
  // bytes, so no opcode straddles two frames.
  void Op();

  static constexpr size_t kFrameTarget = 64 << 10;  // Python's _FRAME_SIZE_TARGET
  std::string out_;                                 // the opcodes, unframed
  std::vector<size_t> frame_ends_;                  // offsets in out_ where a frame ends
  std::string key_;                                 // the memo key being looked up
  absl::flat_hash_map<std::string, uint32_t> memo_;
};

}  // namespace wpub::rollout
