"""Several ranks per node: two trainer processes hold TP/EP shards of the test model and
wpub.torch.LocalGather hands rank 1's shards to rank 0 by reference over torch.distributed
(gloo); rank 0 publishes the whole model through a real wpubd. The receiver must hold exactly
the unsharded model (quantized experts bit-exact against the reference).

CPU: rank 1's shards travel as shared-memory references (no copy on rank 0). CUDA (one GPU,
both ranks on it): as CUDA IPC references; needs torch with CUDA and a wpubd with the GPU path
(`--gpu_path`), else skips. Skips without torch or gloo."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

from harness import DaemonTestCase, qwen3_batches, reference

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    import torch.distributed as dist
    HAVE_GLOO = dist.is_available() and dist.is_gloo_available()
    HAVE_CUDA = torch.cuda.is_available()
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401 (torch >= 2.2)
        HAVE_DTENSOR = True
    except ImportError:
        HAVE_DTENSOR = False
except ImportError:
    torch, HAVE_GLOO, HAVE_CUDA, HAVE_DTENSOR = None, False, False, False


class _GatherBase(DaemonTestCase):
    DEVICE = "cpu"

    def run_ranks(self, seed: int, world: int = 2, layout: str = "tp", codes=(0,)):
        version = self.next_version()
        tmp = tempfile.mkdtemp(prefix="wpub-gather-", dir=self.workdir)
        rdzv, result = os.path.join(tmp, "rdzv"), os.path.join(tmp, "result.json")
        procs = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "gather_worker.py"), str(r), str(world), rdzv,
             self.daemon.target, str(version), str(seed), self.DEVICE, result, layout],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
        logs = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            logs.append(out.decode(errors="replace"))
        for r, p in enumerate(procs):
            self.assertIn(p.returncode, codes, f"rank {r}:\n{logs[r]}")
        if codes != (0,):
            return version, logs
        with open(result) as f:
            info = json.load(f)
        return version, info

    def check(self, seed: int, world: int = 2, layout: str = "tp"):
        batches = qwen3_batches(seed=seed)
        expected = reference(self.workdir, batches)
        version, info = self.run_ranks(seed, world, layout)
        self.assertTrue(info["committed"], info)
        self.assertTrue(info["summary"]["committed"])
        self.assertEqual(info["summary"]["version"], version)
        self.assertEqual(info["bytes_in"], sum(a.nbytes for _, ts in batches for _, a in ts))
        self.assertEqual(info["quantized"], 4 * 3)
        self.assertReceivedEqual(expected, version)
        return info


@unittest.skipUnless(HAVE_GLOO, "needs torch with gloo (apt-get install python3-torch)")
class LocalGatherCpuTest(_GatherBase):

    def test_two_ranks_shm_refs(self):
        info = self.check(seed=70)
        # Rank 1's shards (half of the TP tensors, half of the experts) came by reference.
        self.assertGreater(info["shm_zero_copy_bytes"], 0)
        self.assertEqual(info["cuda_ipc_bytes"], 0)
        # A second step refills rank 1's kept segments.
        self.check(seed=71)

    def test_what_one_rank_cannot_share_fails_every_rank(self):
        _, logs = self.run_ranks(seed=74, layout="bad", codes=(4,))
        for r, log in enumerate(logs):
            self.assertIn("REFUSED: rank 1: tensor", log, f"rank {r}")
            self.assertIn("shares one tensor per name", log, f"rank {r}")


@unittest.skipUnless(HAVE_GLOO and HAVE_DTENSOR,
                     "needs torch >= 2.2 with gloo (DTensor and init_device_mesh)")
class LocalGatherDTensorTest(_GatherBase):
    """FSDP2: three ranks hold every parameter as a DTensor sharded along dim 0 (uneven where
    3 does not divide a dimension), the routers replicated; each rank shares its local shard and
    rank 0 publishes the whole model, bit-exact -- no rank gathered a parameter."""

    def test_three_ranks_fsdp2_dtensors(self):
        info = self.check(seed=73, world=3, layout="fsdp2")
        self.assertGreater(info["shm_zero_copy_bytes"], 0)
        # Publishing rank 0's shard alone is refused, naming the tensor and the way.
        self.assertIn("sharded along dim 0 over 3 ranks", info["direct_refusal"])
        self.assertIn("LocalGather", info["direct_refusal"])


@unittest.skipUnless(HAVE_GLOO and HAVE_CUDA, "needs torch with CUDA and gloo (a GPU host)")
class LocalGatherCudaTest(_GatherBase):
    DEVICE = "cuda"
    DAEMON_FLAGS = ("--gpu_path", "--gpu_device=0")

    @classmethod
    def setUpClass(cls):
        try:
            super().setUpClass()
        except RuntimeError as e:  # a wpubd built without CUDA refuses --gpu_path
            raise unittest.SkipTest(f"wpubd has no GPU path: {e}") from None
        if cls.pub.status().backend == "cpu":
            cls.tearDownClass()
            raise unittest.SkipTest("wpubd runs the cpu backend: built without the GPU path")

    def test_two_ranks_cuda_ipc_refs_on_one_gpu(self):
        info = self.check(seed=72)
        self.assertGreater(info["cuda_ipc_bytes"], 0)
        self.assertEqual(info["cuda_ipc_bytes"], info["bytes_in"])


if __name__ == "__main__":
    unittest.main()
