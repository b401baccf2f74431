"""The examples next to examples/rl_step.py run against a real wpubd and commit (the torch
ones skip without torch)."""

import os
import re
import subprocess
import sys
import unittest

from harness import DaemonTestCase

EXAMPLES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                         "examples"))

try:
    import torch
    HAVE_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
except ImportError:
    torch, HAVE_GLOO = None, False


class ExamplesTest(DaemonTestCase):

    def run_example(self, name, *args):
        out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name),
                              f"--target={self.daemon.target}", *args],
                             capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, f"{name}:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def committed_steps(self, out):
        return re.findall(r"v\d+ COMMITTED .*?, (\d+) quantized", out)

    def test_rl_step(self):
        out = self.run_example("rl_step.py", "--steps=2")
        self.assertEqual(len(self.committed_steps(out)), 2, out)

    @unittest.skipIf(torch is None, "needs torch")
    def test_torch_module_publish(self):
        out = self.run_example("torch_module_publish.py", "--steps=3")
        quantized = self.committed_steps(out)
        self.assertEqual(len(quantized), 3, out)
        self.assertTrue(all(int(q) == 2 * 8 * 3 for q in quantized), out)

    @unittest.skipUnless(HAVE_GLOO, "needs torch with gloo")
    def test_torch_ranks_per_node(self):
        out = self.run_example("torch_ranks_per_node.py", "--ranks=2", "--steps=2")
        quantized = self.committed_steps(out)
        self.assertEqual(len(quantized), 2, out)
        self.assertTrue(all(int(q) == 4 * 3 for q in quantized), out)


if __name__ == "__main__":
    unittest.main()
