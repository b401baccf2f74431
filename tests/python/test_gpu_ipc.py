"""Torch CUDA tensors published by CUDA IPC (GPU host only; skips without a CUDA-enabled torch).

The daemon ingests CUDA IPC sources only with its GPU backend (the GPU issue). A daemon running
the CPU backend answers UNIMPLEMENTED naming the tensor: these tests then assert exactly that
(and that nothing was published), so they keep passing before the GPU path lands and start
checking bytes once `GetStatus.backend` reports "cuda"."""

import gc
import hashlib
import json
import os
import subprocess
import sys
import unittest

import numpy as np

from harness import DaemonTestCase, qwen3_batches, reference

import wpub

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch, HAVE_CUDA = None, False


def to_cuda(a: np.ndarray):
    """A uint16 bf16 array as a torch bfloat16 CUDA tensor of its own."""
    return torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16).cuda()


@unittest.skipUnless(HAVE_CUDA, "needs torch with CUDA (a GPU host)")
class CudaIpcTest(DaemonTestCase):

    def gpu_backend(self) -> bool:
        return self.pub.status().backend == "cuda"

    def publish_or_unimplemented(self, batches, wire):
        version = self.next_version()
        if not self.gpu_backend():
            with self.assertRaises(wpub.Unimplemented) as cm:
                self.pub.publish(version, wire)
            self.assertIn("CUDA IPC", cm.exception.message)
            self.assertIn("model.layers.0.", cm.exception.message)  # names the tensor
            self.assertLess(self.pub.status().committed_version, version)
            return None
        expected = reference(self.workdir, batches)
        report = self.pub.publish(version, wire)
        self.assertTrue(report.committed, report.summary())
        self.assertGreater(report.client.cuda_ipc_bytes, 0)
        self.assertReceivedEqual(expected, version)
        return report

    def test_cuda_tensors_by_ipc(self):
        batches = qwen3_batches(seed=21)
        wire = [(m, [(n, to_cuda(a)) for n, a in ts]) for m, ts in batches]
        self.publish_or_unimplemented(batches, wire)

    def test_cuda_tensors_from_a_thread_without_a_context(self):
        # A publishing thread the trainer started has no CUDA context current until a runtime
        # call binds one; the export must bind the tensor's device's primary context itself.
        import threading
        batches = qwen3_batches(seed=23)
        wire = [(m, [(n, to_cuda(a)) for n, a in ts]) for m, ts in batches]
        result = {}

        def run():
            try:
                result["report"] = self.publish_or_unimplemented(batches, wire)
            except BaseException as e:  # noqa: B902 -- reported below
                result["error"] = e
        t = threading.Thread(target=run)
        t.start()
        t.join(120)
        self.assertNotIn("error", result, result.get("error"))

    def test_tensor_views_at_offsets(self):
        # Every tensor of a batch is a view into ONE allocation, at a non-zero offset: the IPC
        # handle is the allocation's and the offset locates the tensor.
        batches = qwen3_batches(seed=22)
        wire = []
        for m, ts in batches:
            flat = torch.empty(64 + sum(a.size for _, a in ts), dtype=torch.bfloat16, device="cuda")
            off, views = 64, []
            for n, a in ts:
                v = flat[off:off + a.size].view(a.shape)
                v.copy_(to_cuda(a))
                views.append((n, v))
                off += a.size
            wire.append((m, views))
        self.publish_or_unimplemented(batches, wire)

    def test_export_matches_torch(self):
        # The driver-API export names the same allocation and offset as torch's own sharing.
        block = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
        view = block[4096:8192]
        part = wpub.tensors.normalize("w", view).parts[0]
        shared = view.untyped_storage()._share_cuda_()
        self.assertEqual(part.handle, wpub.tensors.raw_ipc_handle("w", bytes(shared[1])))
        self.assertEqual(part.offset, int(shared[3]) + view.storage_offset() * 2)
        self.assertEqual(part.nbytes, 4096 * 2)
        self.assertTrue(part.device_uuid.startswith("GPU-"))

    def test_references_resolve_to_the_tensor_bytes(self):
        # Another process opens every exported (handle, offset, length) as wpubd's GPU path
        # will and must read exactly the tensors' bytes: views at offsets inside one block, two
        # separate allocations, a strided tensor (shared as a contiguous copy), TP shards.
        block = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
        big0 = torch.randn(3 << 20, device="cuda")  # > 10 MB: a segment of its own
        big1 = torch.randn(3 << 20, device="cuda")
        strided = torch.randn(256, 512, device="cuda").to(torch.bfloat16).t()
        tensors = {"view_a": block[1000:5096], "view_b": block[70000:80000].view(100, 100),
                   "big0": big0, "big1": big1[17:], "strided": strided,
                   "shards": wpub.concat([big0[:4096].view(64, 64), big1[:4096].view(64, 64)], 0)}
        parts, expected = [], []
        for name, t in tensors.items():
            norm = wpub.tensors.normalize(name, t)
            for p in norm.parts:
                parts.append({"handle": p.handle.hex(), "device_uuid": p.device_uuid,
                              "offset": p.offset, "length": p.nbytes})
                expected.append(hashlib.sha256(
                    p.keepalive.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
        torch.cuda.synchronize()
        out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                           "ipc_reader.py")],
                             input=json.dumps(parts), capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertEqual(out.stdout.split(), expected)
        handles = {p["handle"] for p in parts}
        self.assertGreaterEqual(len(handles), 3)  # block, big0, big1 (+ the strided copy)

    def test_shared_tensors_are_released(self):
        # Publishing must not pin the trainer's memory after the report (torch's _share_cuda_
        # would keep every shared block in its IPC limbo until the process exits).
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        batches = qwen3_batches(seed=24)
        wire = [(m, [(n, to_cuda(a)) for n, a in ts]) for m, ts in batches]
        self.assertGreater(torch.cuda.memory_allocated(), before)
        self.publish_or_unimplemented(batches, wire)
        del wire
        gc.collect()  # the exception of the UNIMPLEMENTED path holds frames in a cycle
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.memory_allocated(), before)

    def test_two_tp_shards_in_two_allocations(self):
        # gate/up split along dim 0 and down along dim 1 into two shards, each shard large enough
        # (> 10 MB) for the caching allocator to give it its own cudaMalloc segment.
        rows, hidden = 3072, 2048
        rng = np.random.default_rng(23)
        from harness import bf16
        gate, up = bf16(rng, (2 * rows, hidden)), bf16(rng, (2 * rows, hidden))
        down = bf16(rng, (hidden, 2 * rows))
        e = "model.layers.0.mlp.experts.0"
        batches = [("decoder.layers.0.mlp.experts.linear_fc1.weight0",
                    [(f"{e}.gate_proj.weight", gate), (f"{e}.up_proj.weight", up)]),
                   ("decoder.layers.0.mlp.experts.linear_fc2.weight0",
                    [(f"{e}.down_proj.weight", down)])]
        shards = {}
        wire = []
        for m, ts in batches:
            out = []
            for n, a in ts:
                dim = 1 if n.endswith("down_proj.weight") else 0
                parts = [to_cuda(np.ascontiguousarray(h)) for h in np.split(a, 2, axis=dim)]
                shards[n] = parts
                out.append((n, wpub.concat(parts, dim)))
            wire.append((m, out))
        for n, (p0, p1) in shards.items():
            h0 = wpub.tensors.normalize(n, p0).parts[0].handle
            h1 = wpub.tensors.normalize(n, p1).parts[0].handle
            self.assertNotEqual(h0, h1, f"{n}: both shards landed in one allocation")
        self.publish_or_unimplemented(batches, wire)


if __name__ == "__main__":
    unittest.main()
