"""What a colocated SGLang engine unpickles from wpubd's /update_weights_from_tensor request,
loaded the way SGLang's own code loads it (no GPU: the CUDA tensor is rebuilt over the bucket's
known bytes instead of an IPC mapping).

Modelled from SGLang's code: the HTTP body (io_struct.py UpdateWeightsFromTensorReqInput,
msgspec_utils.py Base64Bytes: standard base64, validate=True) and the scheduler's decode
(scheduler_components/weight_updater.py at 00a2ca2e56d59f0a19186d7a8a58bdda5201023f: entry
[tp_rank]), MultiprocessingSerializer.deserialize's SafeUnpickler (utils/common.py at
004f0c7a8d398a9c4b6844c1d8071502fa88e78c: module-prefix allowlist, class denylist), the patched
rebuild_cuda_tensor's device argument (utils/patch_torch.py at 04643955: a UUID string), and the
multi-dtype FlattenedTensorBucket (weight_sync/tensor_bucket.py at 0cbf0687: byte offsets,
flattened[start:end].view(dtype).reshape(shape)); torch's rebuild_cuda_tensor argument order
and the types THPStorage_newSharedCuda checks (torch/multiprocessing/reductions.py,
torch/csrc/StorageSharing.cpp).
"""
import base64
import dataclasses
import inspect
import io
import json
import os
import pickle
import subprocess
import unittest

import numpy as np

PAYLOAD = os.environ.get("WPUB_COLOCATED_PAYLOAD", "")

ALLOWED_MODULE_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
    "weakref.", "torch.", "torch._tensor.", "torch.storage.", "torch.nn.parameter.",
    "torch.autograd.function.", "torch.distributed.", "torch.distributed._shard.",
    "torch.distributed._composable.", "torch._C._distributed_c10d.",
    "torch._C._distributed_fsdp.", "torch.distributed.optim.", "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.", "pickletools.", "peft.", "transformers.", "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.",
    "sglang.srt.layers.", "sglang.srt.utils.")
DENY_CLASSES = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
                ("os", "system"), ("subprocess", "Popen"), ("subprocess", "run"),
                ("codecs", "decode"), ("types", "CodeType"), ("types", "FunctionType")}

# torch's element sizes by dtype attribute name (the names a receiving torch resolves).
ITEMSIZE = {"uint8": 1, "int8": 1, "float8_e4m3fn": 1, "bfloat16": 2, "float16": 2,
            "float32": 4, "int32": 4, "int64": 8, "float64": 8, "bool": 1}
REBUILD_PARAMS = ["tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls",
                  "dtype", "storage_device", "storage_handle", "storage_size_bytes",
                  "storage_offset_bytes", "requires_grad", "ref_counter_handle",
                  "ref_counter_offset", "event_handle", "event_sync_required"]


@dataclasses.dataclass
class FlattenedTensorMetadata:  # sglang/srt/weight_sync/tensor_bucket.py's six fields
    name: str
    shape: tuple
    dtype: str
    start_idx: int
    end_idx: int
    numel: int


class Global:
    """A torch global as the unpickler resolved it (a name, since CI's torch may predate fp8)."""

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __repr__(self):
        return f"{self.module}.{self.name}"


class FakeTensor:
    """The rebuilt CUDA tensor: a 1-d view of the bucket's bytes."""

    def __init__(self, data):
        self.data = data


class Receiver(pickle.Unpickler):
    """SGLang's SafeUnpickler, resolving torch's and SGLang's globals to recorders."""

    def __init__(self, data, bucket, case):
        super().__init__(io.BytesIO(data))
        self.bucket, self.case, self.calls, self.resolved = bucket, case, [], []

    def find_class(self, module, name):
        self.resolved.append((module, name))
        if (module, name) in DENY_CLASSES or not any(
                (module + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self.rebuild
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        if (module, name) == ("torch", "Size"):
            return tuple
        if module == "torch":
            return Global(module, name)
        if (module, name) == ("torch.storage", "TypedStorage"):
            return Global(module, name)
        raise AssertionError(f"unexpected global {module}.{name}")

    def rebuild(self, *args):
        c = self.case
        self.calls.append(args)
        c.assertEqual(len(args), 15)
        (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
         offset_bytes, requires_grad, rc_handle, rc_offset, event, sync) = args
        c.assertEqual(repr(tensor_cls), "torch.Tensor")
        c.assertEqual(repr(storage_cls), "torch.storage.TypedStorage")
        c.assertEqual(repr(dtype), "torch.uint8")
        # THPStorage_newSharedCuda's checks: bytes handles, ints, a bool.
        for v in (handle, rc_handle, event):
            c.assertIsInstance(v, bytes)
        for v in (size_bytes, offset_bytes, rc_offset, offset):
            c.assertIsInstance(v, int)
        c.assertIs(type(sync), bool)
        c.assertIs(type(requires_grad), bool)
        c.assertFalse(requires_grad)
        # SGLang's patched rebuild maps a UUID string (torch's str(uuid)) to the local device.
        if getattr(self, "rebuild_device_is_index", False):
            c.assertIsInstance(device, int)
        else:
            c.assertIsInstance(device, str)
            c.assertRegex(device,
                          r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
        return FakeTensor(dict(size=size, stride=stride, offset=offset, device=device,
                               handle=handle, size_bytes=size_bytes, offset_bytes=offset_bytes,
                               rc_handle=rc_handle, rc_offset=rc_offset, event=event, sync=sync,
                               bytes=self.bucket[offset:offset + size[0]]))


@unittest.skipUnless(PAYLOAD, "WPUB_COLOCATED_PAYLOAD (the wpub-colocated-payload tool) not set")
class ColocatedWireTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out = json.loads(subprocess.check_output([PAYLOAD]))
        cls.body = json.loads(cls.out["body"])
        cls.bucket = bytes.fromhex(cls.out["bucket_hex"])

    def test_body_is_sglangs_request(self):
        b = self.body
        self.assertEqual(set(b), {"serialized_named_tensors", "load_format", "flush_cache"})
        self.assertEqual(b["load_format"], "flattened_bucket")
        self.assertIs(b["flush_cache"], False)  # SGLang asserts a flush it cannot do
        self.assertEqual(len(b["serialized_named_tensors"]), self.out["tp"])
        for entry in b["serialized_named_tensors"]:
            self.assertIsInstance(entry, str)
            base64.b64decode(entry, validate=True)  # Base64Bytes: standard alphabet, padded

    def test_each_rank_rebuilds_every_tensor_byte_for_byte(self):
        shared = self.out["shared"]
        for rank, entry in enumerate(self.body["serialized_named_tensors"]):
            r = Receiver(base64.b64decode(entry, validate=True), self.bucket, self)
            payload = r.load()
            self.assertEqual(set(payload), {"flattened_tensor", "metadata"})
            flat = payload["flattened_tensor"].data
            self.assertEqual(len(r.calls), 1)
            self.assertEqual(flat["size"], (self.out["nbytes"],))
            self.assertEqual(flat["stride"], (1,))
            self.assertEqual(flat["offset"], 0)
            self.assertEqual(flat["handle"].hex(), shared["mem_handle_hex"])  # raw 64 bytes
            self.assertEqual(len(flat["handle"]), 64)
            self.assertEqual(flat["event"].hex(), shared["event_handle_hex"])
            self.assertTrue(flat["sync"])  # the receiver's stream waits on the event
            self.assertEqual(flat["size_bytes"], self.out["nbytes"])
            self.assertEqual(flat["offset_bytes"], shared["offset_bytes"])
            self.assertEqual(flat["rc_handle"], shared["ref_counter"].encode())
            # One reference-counter slot per rank: each decrements its own.
            self.assertEqual(flat["rc_offset"],
                             shared["ref_counter_offset"] + self.out["first_slot"] + rank)
            self.assertEqual(flat["device"], shared["device_uuid"][4:].lower())
            metas = payload["metadata"]
            self.assertEqual(len(metas), len(self.out["tensors"]))
            # SafeUnpickler's find_class runs its allowlist in Python per call: each global is
            # resolved once (memoized after, as Python's pickler writes it), not per tensor.
            self.assertEqual(len(r.resolved), len(set(r.resolved)), r.resolved)
            self.assertEqual(r.resolved.count(("torch", "Size")), 1)
            for meta, want in zip(metas, self.out["tensors"]):
                self.assertIsInstance(meta, FlattenedTensorMetadata)
                self.assertEqual(meta.name, want["name"])
                self.assertEqual(tuple(meta.shape), tuple(want["shape"]))
                self.assertEqual(repr(meta.dtype), "torch." + want["dtype"])
                self.assertEqual(meta.start_idx, want["offset"])
                self.assertEqual(meta.end_idx, want["offset"] + want["nbytes"])
                self.assertEqual(meta.numel, want["nbytes"])
                # FlattenedTensorBucket.reconstruct_tensors: flattened[start:end].view(dtype)
                # .reshape(shape) -- the byte count must match the shape, the slice the bytes.
                item = ITEMSIZE[want["dtype"]]
                n = int(np.prod(want["shape"])) if want["shape"] else 1
                self.assertEqual(meta.end_idx - meta.start_idx, n * item)
                self.assertEqual(meta.start_idx % item, 0)
                self.assertEqual(flat["bytes"][meta.start_idx:meta.end_idx],
                                 self.bucket[want["offset"]:want["offset"] + want["nbytes"]])

    def test_a_many_tensor_bucket_is_framed_as_pythons_pickler_frames(self):
        """A bucket of 3,000 tensors spans several FRAMEs; Python's own unpickler (the pure-Python
        one checks that no opcode crosses a frame's end) loads every tensor's metadata."""
        out = json.loads(subprocess.check_output([PAYLOAD, "--tensors=3000"]))
        entry = base64.b64decode(json.loads(out["body"])["serialized_named_tensors"][0])
        self.assertEqual(entry[:3], b"\x80\x04\x95")  # PROTO 4, FRAME
        self.assertGreater(entry.count(b"\x95"), 2)

        class Strict(pickle._Unpickler):
            find_class = Receiver.find_class

            def __init__(self, data, case):
                super().__init__(io.BytesIO(data))
                self.bucket, self.case, self.calls, self.resolved = b"\0" * out["nbytes"], case, [], []

            rebuild = Receiver.rebuild

        r = Strict(entry, self)
        payload = r.load()
        self.assertEqual(len(payload["metadata"]), 3000)
        self.assertEqual([m.name for m in payload["metadata"]], [t["name"] for t in out["tensors"]])
        self.assertEqual(len(r.resolved), len(set(r.resolved)))

    def test_vllm_worker_takes_its_gpus_packed_handle(self):
        """vLLM's IPC backend (ipc_engine.py: plain pickle.loads of ipc_handles_pickled; a dict
        {GPU UUID: rebuild_cuda_tensor's arguments} in the packed form; packed_tensor.py: the
        tensor split by tensor_sizes, each viewed as dtype and shape)."""
        u = json.loads(self.out["vllm_body"])["update_info"]
        self.assertEqual(set(u), {"names", "dtype_names", "shapes", "ipc_handles_pickled",
                                  "tensor_sizes"})  # vLLM refuses unknown keys
        want = self.out["tensors"]
        self.assertEqual(u["names"], [t["name"] for t in want])
        self.assertEqual(u["dtype_names"], [t["dtype"] for t in want])
        self.assertEqual(u["tensor_sizes"], [t["nbytes"] for t in want])
        # 0-d tensors are declared [1] (the packed unpack cannot view []).
        self.assertEqual(u["shapes"], [t["shape"] or [1] for t in want])
        r = Receiver(base64.b64decode(u["ipc_handles_pickled"]), self.bucket, self)
        r.rebuild_device_is_index = True
        handles = r.load()
        self.assertEqual(sorted(handles), sorted(["0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
                                                  "11111111-2222-3333-4444-555555555555"]))
        for uuid, args in handles.items():
            self.assertIsInstance(args, tuple)
            self.assertEqual(len(args), 15)
            args = list(args)
            args[6] = 0  # the worker writes its own device index over it
            flat = r.rebuild(*args).data["bytes"]
            # packed[:sum(sizes)].split(sizes): back to back, the bucket's own layout.
            off = 0
            for t, n in zip(want, u["tensor_sizes"]):
                self.assertEqual(t["offset"], off)
                self.assertEqual(flat[off:off + n], self.bucket[off:off + n])
                off += n

    def test_torch_rebuild_takes_these_arguments(self):
        try:
            from torch.multiprocessing import reductions
        except ImportError:
            self.skipTest("torch not importable")
        self.assertEqual(list(inspect.signature(reductions.rebuild_cuda_tensor).parameters),
                         REBUILD_PARAMS)


if __name__ == "__main__":
    unittest.main()
