"""What a colocated SGLang engine spends decoding one /update_weights_from_tensor entry, per
tensor: wpubd's pickle (wpub-colocated-payload --tensors=N) against the pickle a Python trainer
sends for the same bucket (MultiprocessingSerializer: ForkingPickler, the default protocol, of the
same objects), both loaded by SGLang's SafeUnpickler (its allowlist check per find_class; the
allowlist and denylist of tests/python/test_colocated_wire.py, which cites the SGLang commit).
torch and SGLang are stood in for by modules of the same names, so the CUDA tensor's rebuild
costs nothing here: the figures are the unpickle alone, the engine's floor per tensor before it
loads anything.

  /usr/bin/python3 bench/rollout/colocated_decode.py build/tests/rollout/wpub-colocated-payload
"""
import base64
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
from test_colocated_wire import ALLOWED_MODULE_PREFIXES, DENY_CLASSES  # noqa: E402


def stand_in_modules():
    """torch (Size, dtypes, Tensor, TypedStorage, rebuild_cuda_tensor) and SGLang's tensor_bucket
    module, pickled and resolved by the same module and attribute names as the real ones."""
    torch = types.ModuleType("torch")

    class Size(tuple):
        def __reduce__(self):  # torch.Size's: Size(tuple)
            return (Size, (tuple(self),))

    Size.__module__, Size.__qualname__ = "torch", "Size"
    torch.Size = Size

    class DType:
        def __init__(self, name):
            self.name = name

        def __reduce__(self):  # torch.dtype's: the attribute's name, pickled as a global
            return self.name

    DType.__module__ = "torch"
    for name in ("uint8", "float8_e4m3fn", "float32", "bfloat16"):
        setattr(torch, name, DType(name))
    torch.Tensor = type("Tensor", (), {"__module__": "torch"})
    storage = types.ModuleType("torch.storage")
    storage.TypedStorage = type("TypedStorage", (), {"__module__": "torch.storage"})
    reductions = types.ModuleType("torch.multiprocessing.reductions")

    def rebuild_cuda_tensor(*args):
        return ("tensor", args[1])

    rebuild_cuda_tensor.__module__ = "torch.multiprocessing.reductions"
    rebuild_cuda_tensor.__qualname__ = "rebuild_cuda_tensor"
    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
    mp = types.ModuleType("torch.multiprocessing")
    mp.reductions = reductions
    torch.multiprocessing, torch.storage = mp, storage
    bucket = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: object
        dtype: object
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = bucket.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    bucket.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name, mod in (("torch", torch), ("torch.storage", storage),
                      ("torch.multiprocessing", mp), ("torch.multiprocessing.reductions", reductions),
                      ("sglang", types.ModuleType("sglang")), ("sglang.srt", types.ModuleType("x")),
                      ("sglang.srt.weight_sync", types.ModuleType("x")), (bucket.__name__, bucket)):
        sys.modules[name] = mod
    return torch, reductions, bucket


class SafeUnpickler(pickle.Unpickler):
    """SGLang's: the allowlist's prefixes checked in Python on every find_class."""

    def find_class(self, module, name):
        if (module, name) in DENY_CLASSES:
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        if any((module + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")


def python_pickle(entry, torch, reductions, bucket):
    """The same bucket as a Python trainer pickles it: the objects wpub's pickle decodes to,
    dumped again with the default protocol (the flattened tensor as its rebuild call)."""
    payload = SafeUnpickler(io.BytesIO(entry)).load()

    class Shared:
        def __init__(self, args):
            self.args = args

        def __reduce__(self):
            return (reductions.rebuild_cuda_tensor, self.args)

    flat = Shared(("args",) * 15)
    metas = [bucket.FlattenedTensorMetadata(m.name, torch.Size(m.shape), m.dtype, m.start_idx,
                                            m.end_idx, m.numel) for m in payload["metadata"]]
    return pickle.dumps({"flattened_tensor": flat, "metadata": metas})


def unframed(data):
    """The same pickle without its FRAME headers (FRAME is optional in protocol 4): what an
    unframed writer sends, for the comparison."""
    assert data[:2] == b"\x80\x04"
    out, at = bytearray(data[:2]), 2
    while at < len(data):
        assert data[at] == 0x95, at
        n = int.from_bytes(data[at + 1:at + 9], "little")
        out += data[at + 9:at + 9 + n]
        at += 9 + n
    return bytes(out)


def time_loads(data, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        SafeUnpickler(io.BytesIO(data)).load()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    tool = sys.argv[1]
    torch, reductions, bucket = stand_in_modules()
    rows = []
    for n in (1650, 6600):
        out = json.loads(subprocess.check_output([tool, f"--tensors={n}"]))
        entry = base64.b64decode(json.loads(out["body"])["serialized_named_tensors"][0])
        ours = time_loads(entry, 20)
        theirs = time_loads(python_pickle(entry, torch, reductions, bucket), 20)
        flat = time_loads(unframed(entry), 20)
        rows.append(dict(tensors=n, wpub_seconds=ours, python_seconds=theirs,
                         unframed_seconds=flat, wpub_bytes=len(entry)))
        print(f"{n:5d} tensors: wpub's pickle {ours * 1e3:7.3f} ms ({ours / n * 1e6:.2f} us a "
              f"tensor, {len(entry)} B); a Python trainer's {theirs * 1e3:7.3f} ms "
              f"({theirs / n * 1e6:.2f} us a tensor); ratio {ours / theirs:.2f}; "
              f"wpub's unframed {flat * 1e3:7.3f} ms")
    if len(sys.argv) > 2:
        json.dump(rows, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
