"""Client-side tensor description (no daemon): dtype mapping, explicit dtypes, concatenations,
shared-memory segments, header construction and error mapping."""

import os
import unittest

import grpc
import numpy as np

import harness  # noqa: F401  (puts clients/python on sys.path)
import wpub
from wpub import _options, errors
from wpub.shm import ShmPool
from wpub.tensors import CudaPart, HostPart, normalize, raw_ipc_handle

try:
    import torch
except ImportError:
    torch = None


class NormalizeTest(unittest.TestCase):

    def test_numpy_dtypes(self):
        for np_dtype, name in [(np.float32, "float32"), (np.float16, "float16"),
                               (np.int64, "int64"), (np.uint8, "uint8"), (np.bool_, "bool")]:
            t = normalize("x", np.zeros((2, 3), dtype=np_dtype))
            self.assertEqual((t.dtype, t.shape, len(t.parts)), (name, (2, 3), 1))
            self.assertIsInstance(t.parts[0], HostPart)

    def test_bf16_needs_explicit_dtype(self):
        with self.assertRaisesRegex(wpub.TensorError, "x.weight.*bfloat16"):
            normalize("x.weight", np.zeros((2, 16), dtype=np.uint16))
        t = normalize("x.weight", wpub.Tensor(np.zeros((2, 16), dtype=np.uint16), "bfloat16"))
        self.assertEqual((t.dtype, t.parts[0].nbytes), ("bfloat16", 64))
        with self.assertRaisesRegex(wpub.TensorError, "item size 4"):
            normalize("y", wpub.Tensor(np.zeros(4, np.float32), "bfloat16"))
        with self.assertRaisesRegex(wpub.TensorError, "not supported"):
            normalize("z", wpub.Tensor(np.zeros(4, np.uint16), "uint16"))

    def test_non_contiguous_is_copied(self):
        a = np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2]
        t = normalize("x", a)
        self.assertTrue(t.parts[0].array.flags.c_contiguous)
        np.testing.assert_array_equal(t.parts[0].array, a)

    def test_concat(self):
        a, b = np.zeros((4, 16), np.float32), np.zeros((2, 16), np.float32)
        t = normalize("w", wpub.concat([a, b], 0))
        self.assertEqual((t.shape, t.concat_dim, [p.shape for p in t.parts]),
                         ((6, 16), 0, [(4, 16), (2, 16)]))
        t = normalize("w", wpub.concat([np.zeros((4, 8), np.float32)] * 3, 1))
        self.assertEqual((t.shape, t.concat_dim), ((4, 24), 1))
        t = normalize("w", wpub.concat([a], 1))  # one part: concat_dim is irrelevant
        self.assertEqual((t.shape, t.concat_dim), ((4, 16), 0))
        with self.assertRaisesRegex(wpub.TensorError, "w: part 1 shape"):
            normalize("w", wpub.concat([a, np.zeros((4, 8), np.float32)], 0))
        with self.assertRaisesRegex(wpub.TensorError, "w: part 1 has dtype float16"):
            normalize("w", wpub.concat([a, np.zeros((2, 16), np.float16)], 0))
        with self.assertRaisesRegex(wpub.TensorError, "dim must be 0 or 1"):
            wpub.concat([a, b], 2)
        with self.assertRaisesRegex(wpub.TensorError, "out of range for rank 1"):
            normalize("v", wpub.concat([np.zeros(4, np.float32)] * 2, 1))

    def test_cuda_ipc_reference(self):
        t = normalize("w", wpub.CudaIpc(b"\0" * 64, "GPU-1", 128, (4, 16), "bfloat16"))
        p = t.parts[0]
        self.assertIsInstance(p, CudaPart)
        self.assertEqual((p.nbytes, p.offset, p.device_uuid), (128, 128, "GPU-1"))

    def test_torch_shareable_handle_formats(self):
        raw = bytes(range(64))
        self.assertEqual(raw_ipc_handle("w", raw), raw)  # torch < 2.2: the raw handle
        self.assertEqual(raw_ipc_handle("w", b"\x02c" + raw), raw)  # version 2, cudaMalloc
        self.assertEqual(raw_ipc_handle("w", b"\x03c" + raw), raw)  # version 3, cudaMalloc
        with self.assertRaisesRegex(wpub.TensorError, "w lives in an expandable"):
            raw_ipc_handle("w", b"\x02e" + raw)
        with self.assertRaisesRegex(wpub.TensorError, "w: unrecognized"):
            raw_ipc_handle("w", b"\x02x" + raw)

    def test_unsupported_type(self):
        with self.assertRaisesRegex(wpub.TensorError, "w: unsupported type list"):
            normalize("w", [1, 2, 3])
        with self.assertRaisesRegex(wpub.TensorError, "non-empty str"):
            normalize("", np.zeros(2, np.float32))

    @unittest.skipIf(torch is None, "torch is not installed for this Python")
    def test_torch_cpu(self):
        x = torch.randn(4, 16).to(torch.bfloat16)
        t = normalize("w", x)
        self.assertEqual((t.dtype, t.shape), ("bfloat16", (4, 16)))
        self.assertEqual(t.parts[0].array.tobytes(), x.view(torch.int16).numpy().tobytes())
        t = normalize("w", x.t())  # strided view: copied contiguous
        self.assertEqual(t.shape, (16, 4))
        self.assertEqual(t.parts[0].array.tobytes(),
                         x.t().contiguous().view(torch.int16).numpy().tobytes())


class ShmTest(unittest.TestCase):

    def test_pool_write_reuse_and_close(self):
        a = np.arange(1000, dtype=np.float32)
        pool = ShmPool("wpub-test")
        s = pool.acquire(0, 8192)
        s.write(64, a)
        with open(s.path, "rb") as f:
            self.assertEqual(f.read()[64:64 + a.nbytes], a.tobytes())
        self.assertTrue(s.name.startswith(f"/wpub-test-{os.getpid()}-"))
        self.assertNotIn("/", s.name[1:])
        pool.release({0: s}, reuse=True)
        self.assertIs(pool.acquire(0, 4096), s)  # same slot, fits: reused
        pool.release({0: s}, reuse=True)
        bigger = pool.acquire(0, 16384)  # too small now: replaced and unlinked
        self.assertIsNot(bigger, s)
        self.assertFalse(os.path.exists(s.path))
        pool.release({0: bigger}, reuse=False)  # not reusable: unlinked at once
        self.assertFalse(os.path.exists(bigger.path))
        kept = pool.acquire(1, 100)
        pool.release({1: kept}, reuse=True)
        self.assertTrue(os.path.exists(kept.path))
        pool.close()
        self.assertFalse(os.path.exists(kept.path))
        late = ShmPool("wpub-test")
        seg = late.acquire(0, 64)
        late.close()  # e.g. Publisher.close() while a publish() was in flight
        late.release({0: seg}, reuse=True)
        self.assertFalse(os.path.exists(seg.path))

    def test_orphans_of_dead_processes_are_removed(self):
        orphan = "/dev/shm/wpub-orphan-test-999999999-dead-1"
        with open(orphan, "wb") as f:
            f.write(b"x")
        ShmPool("wpub-orphan-test").close()
        self.assertFalse(os.path.exists(orphan))


class HeaderAndErrorsTest(unittest.TestCase):

    def test_header(self):
        h = _options.build_header(7, "nvfp4", {"first_last_layers_bf16": True, "num_layers": 48,
                                               "extra_high_precision_layers_hf": "lm_head"},
                                  {"quant_algo": "NVFP4"}, "m", False, True, 0)
        self.assertEqual((h.version, h.recipe, h.queue), (7, "nvfp4", True))
        self.assertEqual(list(h.precision_exceptions.extra_high_precision_layers_hf), ["lm_head"])
        self.assertEqual(h.precision_exceptions.num_layers, 48)
        self.assertEqual(h.quantization_config_json, '{"quant_algo": "NVFP4"}')
        with self.assertRaisesRegex(wpub.InvalidArgument, "unknown key"):
            _options.build_header(7, "nvfp4", {"num_layer": 3}, None, "", False, False, 0)

    def test_error_mapping(self):
        cases = {grpc.StatusCode.INVALID_ARGUMENT: wpub.InvalidArgument,
                 grpc.StatusCode.FAILED_PRECONDITION: wpub.FailedPrecondition,
                 grpc.StatusCode.UNIMPLEMENTED: wpub.Unimplemented,
                 grpc.StatusCode.UNAUTHENTICATED: wpub.Unauthenticated,
                 grpc.StatusCode.DEADLINE_EXCEEDED: wpub.DeadlineExceeded,
                 grpc.StatusCode.CANCELLED: wpub.Cancelled,
                 grpc.StatusCode.UNAVAILABLE: wpub.Unavailable}
        for code, cls in cases.items():
            e = errors.error_for(code, "tensor x.weight: bad")
            self.assertIs(type(e), cls)
            self.assertIsInstance(e, wpub.WpubError)
            self.assertEqual((e.code, e.message), (code, "tensor x.weight: bad"))
            self.assertIn("x.weight", str(e))
        self.assertIs(type(errors.error_for(grpc.StatusCode.UNKNOWN, "?")), wpub.WpubError)


if __name__ == "__main__":
    unittest.main()
