// Python pickles written without Python: the engines' weight routes take objects pickled by the
// trainer's Python (SGLang's serialized named tensors, vLLM's pickled ncclUniqueId and IPC
// handles), so the daemon writes the same opcode stream its receiver's `pickle.loads` reads.
// Protocol 3 (bytes objects, no framing), the opcodes of pickletools' documentation; no memo
// (every object is written once). A writer only appends: the caller writes a well-formed
// stream (each Mark closed by its Tuple/List/Dict), which the unit tests check by loading the
// result with Python's own pickle module.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace wpub::rollout {

class PickleWriter {
 public:
  PickleWriter();  // PROTO 3
  // A module-level object by reference ("torch", "bfloat16"): GLOBAL.
  PickleWriter& Global(absl::string_view module, absl::string_view name);
  PickleWriter& None();
  PickleWriter& Bool(bool v);
  PickleWriter& Int(int64_t v);   // BININT1 / BININT / LONG1, the smallest that holds it
  PickleWriter& Float(double v);  // BINFLOAT
  PickleWriter& Str(absl::string_view utf8);         // BINUNICODE
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
  // STOP; the pickle. The writer is spent.
  std::string Finish();

 private:
  std::string out_;
};

}  // namespace wpub::rollout
