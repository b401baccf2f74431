"""Publication groups on the GPU path (one GPU): two GPU-path wpubd, each publishing half of a
GLM-like MoE from torch CUDA tensors (CUDA IPC) under one version, to a wpub-recv subscribed to
both; every byte is checked against the CPU reference. Skips without a CUDA-enabled torch."""

import os
import shutil
import tempfile
import threading
import time
import unittest

import wpub
from harness import Daemon, glm_batches, read_safetensors, reference
from test_gpu_ipc import HAVE_CUDA, to_cuda
from test_group import GroupReceiver, split


@unittest.skipUnless(HAVE_CUDA, "needs torch with CUDA (a GPU host)")
class GpuGroupTest(unittest.TestCase):

    def test_two_gpu_path_members_cuda_ipc_bit_exact(self):
        workdir = tempfile.mkdtemp(prefix="wpub-py-gpu-group-")
        daemons = [Daemon(workdir, "--gpu_path", "--gpu_device=0", "--min_receivers=1",
                          f"--nccl_group=wpub_member{i}", "--nccl_store_listen=127.0.0.1:0")
                   for i in range(2)]
        targets = [d.target for d in daemons]
        recv = GroupReceiver(workdir, targets, "recv-gpu")
        pubs = [wpub.Publisher(t, timeout=120) for t in targets]
        try:
            for p in pubs:
                p.wait_ready()
                self.assertEqual(p.status().backend, "gpu")
                deadline = time.monotonic() + 20
                while len(p.status().receivers) < 1:
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.05)
            for version, seed in ((1, 71), (2, 72)):
                model = glm_batches(seed)
                parts = split(model, 2)
                wire = [[(m, [(n, to_cuda(a)) for n, a in ts]) for m, ts in part]
                        for part in parts]
                names = [n for _, ts in model for n, _ in ts]
                out = [None, None]

                def run(i):
                    g = wpub.PublicationGroup(pubs[i], "gpu", 2, i, targets[0])
                    out[i] = g.publish(version, wire[i],
                                       expected_tensors=names if i == 0 else None)

                threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                for i, o in enumerate(out):
                    self.assertTrue(o.committed, f"member {i}: {o.error}")
                    self.assertGreater(o.report.client.cuda_ipc_bytes, 0)
                expected = reference(workdir, model)
                deadline = time.monotonic() + 30
                while True:
                    got, meta = (read_safetensors(recv.output) if os.path.exists(recv.output)
                                 else ({}, {}))
                    if meta.get("version") == str(version):
                        break
                    self.assertLess(time.monotonic(), deadline, meta)
                    time.sleep(0.05)
                self.assertEqual(sorted(got), sorted(expected))
                for name, (dtype, shape, raw) in expected.items():
                    self.assertTrue(got[name][2] == raw, f"v{version} {name}: bytes differ")
        finally:
            for p in pubs:
                p.close()
            self.assertEqual(recv.stop(), 0)
            for d in daemons:
                self.assertEqual(d.stop(), 0)
            if not os.environ.get("WPUB_TEST_KEEP"):
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
