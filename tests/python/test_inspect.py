"""`wpubctl inspect` and `wpubctl diff` on versions a real wpubd published to two real wpub-recv:
each receiver's file is a clean NVFP4 version (modules as the report counts them, no problem),
both receivers hold one digest and diff identical, and the next version differs from the last
in exactly the quantized experts' bytes (the passed-through tensors of one seed too)."""

import json
import shutil
import subprocess
import unittest

from harness import DaemonTestCase, as_wire, binary, qwen3_batches


def wpubctl(*args):
    return subprocess.run([binary("WPUBCTL"), *args], capture_output=True, text=True, timeout=60)


class InspectPublishedTest(DaemonTestCase):
    RECEIVERS = 2

    def inspect(self, path):
        r = wpubctl("inspect", path, "--output_format=json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return json.loads(r.stdout)

    def test_receivers_files_inspected_and_diffed(self):
        v1 = self.next_version()
        report = self.pub.publish(v1, as_wire(qwen3_batches(seed=1)), model_id="qwen3-toy")
        self.assertTrue(report.committed, report.summary())
        for i in range(2):
            self.received(i, v1)
        a, b = (self.inspect(r.output) for r in self.receivers)
        self.assertEqual(a["kind"], "file")
        self.assertEqual(a["metadata"]["version"], str(v1))
        self.assertEqual(a["metadata"]["model_id"], "qwen3-toy")
        self.assertEqual(a["problems"], [])
        # One NVFP4 module per quantized tensor, and no input_scale on the live path.
        self.assertEqual(len(a["nvfp4_modules"]), report.tensors_quantized)
        self.assertNotIn("nvfp4_input_scale", a["by_role"])
        self.assertEqual(a["by_role"]["high_precision"]["tensors"], report.tensors_passthrough)
        self.assertEqual(a["digest"], b["digest"])
        r = wpubctl("diff", self.receivers[0].output, self.receivers[1].output)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("identical tensors", r.stdout)

        kept = self.receivers[0].output + ".v1"
        shutil.copyfile(self.receivers[0].output, kept)
        v2 = self.next_version()
        self.assertTrue(self.pub.publish(v2, as_wire(qwen3_batches(seed=2))).committed)
        self.received(0, v2)
        r = wpubctl("diff", kept, self.receivers[0].output, "--output_format=json")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        d = json.loads(r.stdout)
        self.assertEqual(d["config_changes"]["metadata.version"], {"a": str(v1), "b": str(v2)})
        self.assertNotIn("only_in_a", d["counts"])
        self.assertNotIn("changed_desc", d["counts"])
        weights = [t for t in d["tensors"]
                   if t["name"].endswith(".weight") and ".mlp.experts." in t["name"]]
        self.assertEqual(len(weights), report.tensors_quantized)
        for t in weights:
            self.assertEqual(t["change"], "changed_bytes")
            self.assertGreater(t["max_abs_diff"], 0, t["name"])


if __name__ == "__main__":
    unittest.main()
