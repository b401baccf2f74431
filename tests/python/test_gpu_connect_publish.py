"""The GPU path end to end from Python (label multi_gpu; one GPU or more): wpubd runs the GPU path
on GPU 0 and starts WITHOUT engines; `wpub-recv --engine_listen --gpu_device=G` plays the SGLang
engine on G = harness.engine_gpu() (GPU 1, or GPU 0 itself on a machine of one GPU, each process
then with an NCCL host identity of its own: harness.nccl_env); the client connects it with
Publisher.connect_engines, then publishes torch CUDA tensors by CUDA IPC (including tensors
assembled from two TP shards living in two different allocations, dim 0 and dim 1) over two
versions, reconnecting between them, and every tensor wpub-recv wrote must equal the reference
bytes (wpub-quantize-ref for quantized experts, the input for passed-through tensors) bit for bit.
Also: a dead engine URL is UNAVAILABLE naming it and leaves no engines connected, and a publication
before any engine is connected commits with no receivers.

Skips with the reason when torch with a CUDA device, the binaries (WPUBD, WPUB_RECV,
WPUB_QUANTIZE_REF) or a wpubd built with the GPU path are missing."""

import os
import shutil
import tempfile
import time
import unittest
import urllib.request

import numpy as np

from harness import (ChildProcess, Daemon, bf16, bf16_cuda, binary, engine_gpu, free_port,
                     nccl_env, qwen3_batches, read_safetensors, reference)

import wpub

try:
    import torch
    GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
except ImportError:
    torch, GPUS = None, 0


class EngineProcess(ChildProcess):
    """wpub-recv serving SGLang's weight-update routes on `device`, writing each applied
    version to `output` (a host identity of its own when it shares GPU 0 with wpubd)."""

    def __init__(self, workdir: str, device: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = os.path.join(workdir, "engine.safetensors")
        self._start([binary("WPUB_RECV"), f"--engine_listen=127.0.0.1:{self.port}",
                     f"--gpu_device={device}", f"--output={self.output}", "--log_level=info"],
                    os.path.join(workdir, "engine.log"), nccl_env(device == 0))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wpub-recv exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"wpub-recv did not serve /health: {self.log()}")
            time.sleep(0.1)


def model(seed: int):
    """Numpy batches (the reference's input) and the same batches as torch CUDA tensors (what
    is published). Layer 0: a small Qwen3-MoE layer, one CUDA tensor per HF tensor. Layer 1:
    expert 0's gate/up split along dim 0 and down along dim 1, and a passed-through o_proj split
    along dim 1, each into two shards of > 10 MB (so the caching allocator gives every shard an
    allocation of its own), published as wpub.concat(shards, dim). Returns (batches, wire,
    shard pairs by name)."""
    batches = qwen3_batches(seed=seed)
    rng = np.random.default_rng(seed + 1000)
    rows, hidden = 3072, 2048
    e, a = "model.layers.1.mlp.experts.0", "model.layers.1.self_attn"
    sharded = [
        ("decoder.layers.1.mlp.experts.linear_fc1.weight0",
         [(f"{e}.gate_proj.weight", bf16(rng, (2 * rows, hidden)), 0),
          (f"{e}.up_proj.weight", bf16(rng, (2 * rows, hidden)), 0)]),
        ("decoder.layers.1.mlp.experts.linear_fc2.weight0",
         [(f"{e}.down_proj.weight", bf16(rng, (hidden, 2 * rows)), 1)]),
        ("decoder.layers.1.self_attention.linear_proj.weight",
         [(f"{a}.o_proj.weight", bf16(rng, (hidden, 2 * rows)), 1)]),
    ]
    wire = [(m, [(n, bf16_cuda(x)) for n, x in ts]) for m, ts in batches]
    shards = {}
    for m, ts in sharded:
        batches.append((m, [(n, x) for n, x, _ in ts]))
        out = []
        for n, x, dim in ts:
            parts = [bf16_cuda(np.ascontiguousarray(h)) for h in np.split(x, 2, axis=dim)]
            shards[n] = parts
            out.append((n, wpub.concat(parts, dim)))
        wire.append((m, out))
    return batches, wire, shards


@unittest.skipUnless(GPUS >= 1, "needs torch with a CUDA device")
class GpuConnectPublishTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix="wpub-py-gpu-connect-")
        cls.daemon = Daemon(cls.workdir, "--gpu_path", "--gpu_device=0",
                            "--engine_deadline=120s", "--nccl_group=wpub_py", log_level="info",
                            commit_deadline="120s", timeout=60,
                            env=nccl_env(engine_gpu() == 0))
        cls.pub = wpub.Publisher(cls.daemon.target, timeout=300)
        cls.pub.wait_ready()
        backend = cls.pub.status().backend
        if backend == "cpu":  # the GPU path's backend reports "gpu"
            cls.tearDownClass()
            raise unittest.SkipTest(f"wpubd runs the '{backend}' backend: built without the "
                                    "GPU path")
        cls.engine = None

    @classmethod
    def tearDownClass(cls):
        cls.pub.close()
        codes = []
        if getattr(cls, "engine", None) is not None:
            codes.append(cls.engine.stop())
        code = cls.daemon.stop()
        if not os.environ.get("WPUB_TEST_KEEP"):
            shutil.rmtree(cls.workdir, ignore_errors=True)
        assert code == 0, f"wpubd exited with {code}"
        assert all(c == 0 for c in codes), f"wpub-recv exit codes {codes}"

    def received(self, version: int, timeout: float = 60.0):
        path = self.engine.output
        deadline = time.monotonic() + timeout
        while True:
            if os.path.exists(path):
                try:
                    got, meta = read_safetensors(path)
                except (ValueError, KeyError, OSError):  # replaced while reading
                    got, meta = None, {}
                if meta.get("version") == str(version):
                    return got
            if time.monotonic() > deadline:
                self.fail(f"the engine did not write v{version} within {timeout} s:\n"
                          f"{self.engine.log()}\n--- wpubd:\n{self.daemon.log()}")
            time.sleep(0.1)

    def publish_and_check(self, version: int, seed: int):
        batches, wire, shards = model(seed)
        for n, (p0, p1) in shards.items():
            h0 = wpub.tensors.normalize(n, p0).parts[0].handle
            h1 = wpub.tensors.normalize(n, p1).parts[0].handle
            self.assertNotEqual(h0, h1, f"{n}: both shards landed in one allocation")
        expected = reference(self.workdir, batches)
        report = self.pub.publish(version, wire, recipe="nvfp4")
        self.assertTrue(report.committed, report.summary())
        self.assertEqual([r.name for r in report.receivers], [self.engine.url])
        self.assertTrue(report.receivers[0].committed)
        self.assertGreater(report.client.cuda_ipc_bytes, 0)
        self.assertEqual(report.client.inline_bytes + report.client.shm_bytes, 0)
        got = self.received(version)
        self.assertEqual(sorted(got), sorted(expected))
        for name, (dtype, shape, raw) in expected.items():
            gd, gs, gr = got[name]
            self.assertEqual((gd, tuple(gs)), (dtype, tuple(shape)), name)
            self.assertTrue(gr == raw, f"v{version} {name}: received bytes differ from the "
                                       "reference")
        return report

    def test_connect_then_publish_two_versions(self):
        # No engines yet: the group is empty.
        s = self.pub.status()
        self.assertIsNotNone(s.engine_group)
        self.assertEqual(s.engines, [])

        # A dead URL: UNAVAILABLE naming it, nothing connected.
        dead = f"http://127.0.0.1:{free_port()}"
        with self.assertRaises(wpub.Unavailable) as cm:
            self.pub.connect_engines([dead], timeout=10)
        self.assertIn(dead, cm.exception.message)
        self.assertEqual(self.pub.status().engines, [])

        # Without engines a publication has no NCCL participants: the GPU backend still runs
        # (its device buckets only ordered on the comm stream) and it commits to nobody.
        small = qwen3_batches(seed=30)
        report = self.pub.publish(1, [(m, [(n, bf16_cuda(x)) for n, x in ts]) for m, ts in small])
        self.assertTrue(report.committed, report.summary())
        self.assertEqual(report.receivers, [])
        self.assertGreater(report.num_buckets, 0)

        type(self).engine = EngineProcess(self.workdir, device=engine_gpu())
        group = self.pub.connect_engines([(self.engine.url, 1)], timeout=60)
        self.assertEqual(group.world_size, 2)
        self.assertEqual([(e.url, e.gpus, e.rank_offset) for e in group.engines],
                         [(self.engine.url, 1, 1)])
        self.assertTrue(group.group_name.startswith("wpub_py_"), group.group_name)
        s = self.pub.status()
        self.assertTrue(s.engine_group.healthy)
        self.assertEqual(s.engine_group.group_name, group.group_name)
        self.assertEqual([(r.name, r.transport) for r in s.receivers],
                         [(self.engine.url, "nccl")])

        self.publish_and_check(2, seed=31)

        # Reconnect (as after an engine restart): a new generation under a new base name.
        again = self.pub.connect_engines([{"url": self.engine.url, "gpus": 1}],
                                         group_name="wpub_py_again", timeout=60)
        self.assertGreater(again.generation, group.generation)
        self.assertTrue(again.group_name.startswith("wpub_py_again_"), again.group_name)
        self.publish_and_check(3, seed=32)
        self.assertEqual(self.pub.status().committed_version, 3)


if __name__ == "__main__":
    unittest.main()
