"""The harness's NCCL placement helpers (no GPU needed): every process an NCCL test starts on a
shared GPU gets a host identity of its own and NCCL's loopback socket settings; ranks on GPUs of
their own keep the environment as it is; WPUB_TEST_ENGINE_GPU places the engines."""

import os
import unittest
from unittest import mock

from harness import engine_gpu, nccl_env


class NcclEnvTest(unittest.TestCase):

    def test_shared_processes_get_distinct_host_identities_and_loopback_sockets(self):
        base = {"PATH": "/usr/bin", "NCCL_HOSTID": "inherited", "NCCL_SOCKET_IFNAME": "eth0"}
        a, b = nccl_env(True, base), nccl_env(True, base)
        self.assertNotEqual(a["NCCL_HOSTID"], b["NCCL_HOSTID"])
        self.assertNotIn("inherited", (a["NCCL_HOSTID"], b["NCCL_HOSTID"]))
        for env in (a, b):
            self.assertEqual(env["NCCL_SOCKET_IFNAME"], "lo")
            self.assertEqual(env["NCCL_IB_DISABLE"], "1")
            self.assertEqual(env["PATH"], "/usr/bin")
        self.assertEqual(base["NCCL_HOSTID"], "inherited", "the base must not be changed")

    def test_ranks_on_their_own_gpus_keep_the_environment(self):
        base = {"PATH": "/usr/bin", "NCCL_SOCKET_IFNAME": "eth0"}
        self.assertEqual(nccl_env(False, base), base)
        with mock.patch.dict(os.environ, {"WPUB_HARNESS_PROBE": "1"}):
            self.assertEqual(nccl_env(False)["WPUB_HARNESS_PROBE"], "1")

    def test_engine_gpu_follows_the_environment(self):
        with mock.patch.dict(os.environ, {"WPUB_TEST_ENGINE_GPU": "0"}):
            self.assertEqual(engine_gpu(), 0)
        with mock.patch.dict(os.environ, {"WPUB_TEST_ENGINE_GPU": "3"}):
            self.assertEqual(engine_gpu(), 3)


if __name__ == "__main__":
    unittest.main()
