"""Unit tests of the publication model (run by ctest as projection_unit)."""

import copy
import io
import os
import sys
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cluster  # noqa: E402
import project  # noqa: E402
import shapes  # noqa: E402
import validate  # noqa: E402


class BenchModelTest(unittest.TestCase):
    """The benchmark's model as bench/RESULTS.md counts it (lines 332-338, 448, 602)."""

    def test_counts_and_bytes(self):
        data = project.load()
        units = validate.bench_units(data)
        t = shapes.totals(units)
        self.assertEqual(t.units, 18864)
        self.assertEqual(t.tensors_quantized, 18432)
        self.assertEqual(t.entries, 55728)
        self.assertAlmostEqual(t.in_bytes / 1e9, 59.82, places=2)
        self.assertAlmostEqual(t.in_bytes_quantized / 1e9, 57.98, places=2)
        self.assertAlmostEqual(t.out_bytes / 1e9, 18.15, places=2)
        self.assertEqual(len(shapes.plan_buckets(units, 1 << 30)), 17)
        self.assertEqual(len(shapes.plan_buckets(shapes.bf16_all(units), 1 << 30)), 56)

    def test_planner_keeps_units_whole(self):
        big = shapes.Unit(3000, 3000, 1, False, False)
        small = shapes.Unit(10, 10, 1, False, False)
        sizes = [b.out_bytes for b in shapes.plan_buckets([small, big, small, small], 1000)]
        self.assertEqual(sizes, [10, 3000, 20])


class ValidationGateTest(unittest.TestCase):
    def test_current_inputs_pass(self):
        with redirect_stdout(io.StringIO()):
            self.assertEqual(project.self_check(project.load()), 0)

    def test_a_wrong_rate_fails_the_gate(self):
        data = copy.deepcopy(project.load())
        data["profiles"]["current"]["bcast_Bps"]["value"] = 2.0e11  # 372 -> 200 GB/s
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(project.self_check(data), 1)
        self.assertIn("**NO**", out.getvalue())

    def test_a_wrong_shape_fails_the_gate(self):
        data = copy.deepcopy(project.load())
        data["models"]["kimi_k2"]["experts"] = 256
        with redirect_stdout(io.StringIO()):
            self.assertEqual(project.self_check(data), 1)


class ScaleTest(unittest.TestCase):
    def setUp(self):
        self.data = project.load()
        self.lay = self.data["layouts"]["perplexity"]

    def test_broadcast_is_bounded_by_every_byte_into_every_gpu(self):
        r = cluster.project(self.data, "qwen3_235b_a22b", self.lay, "broadcast",
                            publishers_per_node=8)
        self.assertEqual(r.per_engine_gpu_bytes, r.wire_bytes_model)
        self.assertGreaterEqual(r.wall_s, r.bound_s)
        self.assertIn("every byte", r.bound_what)

    def test_sharded_transfer_moves_a_shard_per_gpu(self):
        b = cluster.project(self.data, "qwen3_235b_a22b", self.lay, "broadcast")
        m = cluster.project(self.data, "qwen3_235b_a22b", self.lay, "many2many",
                            publishers_per_node=8)
        en = self.lay["engine"]
        expect = (b.wire_bytes_model - shapes.totals(
            shapes.model_units(self.data["models"]["qwen3_235b_a22b"])).out_bytes_expert)
        expert = b.wire_bytes_model - expect
        self.assertAlmostEqual(m.per_engine_gpu_bytes,
                               expert / en["gpus_per_engine"] + expect / en["attn_tp"], delta=1.0)
        self.assertLess(m.wall_s, b.wall_s)

    def test_coordination_is_a_marked_placeholder(self):
        self.assertTrue(self.data["coordination"]["PLACEHOLDER"])
        one = dict(self.lay, trainer=dict(self.lay["trainer"], nodes=1))
        self.assertEqual(cluster.project(self.data, "qwen3_235b_a22b", one,
                                         "broadcast").coordination_s, 0.0)


if __name__ == "__main__":
    unittest.main()
