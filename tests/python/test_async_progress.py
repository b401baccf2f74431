"""publish_async (the future, its sent/released events, cancellation, errors, one at a time),
the progress callback and the logging module (one logger per module, silent by default)."""

import logging
import os
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

from harness import DaemonTestCase, as_wire, bf16, qwen3_batches, reference

import wpub

HERE = os.path.dirname(os.path.abspath(__file__))


class AsyncTest(DaemonTestCase):

    def test_async_commits_and_sets_events(self):
        batches = qwen3_batches(seed=50)
        version = self.next_version()
        expected = reference(self.workdir, batches)
        gate = threading.Event()
        consumed = []

        def slow():  # held at the last batch until the test saw the future still running
            for i, item in enumerate(as_wire(batches)):
                if i == len(batches) - 1:
                    gate.wait(30)
                consumed.append(i)
                yield item

        fut = self.pub.publish_async(version, slow())
        self.assertIsInstance(fut, wpub.PublicationFuture)
        self.assertFalse(fut.done())
        self.assertFalse(fut.sent.is_set())
        self.assertFalse(fut.released.is_set())
        # Another publication on the same Publisher is refused at once.
        with self.assertRaises(wpub.FailedPrecondition):
            self.pub.publish(version + 1, as_wire(batches))
        with self.assertRaises(wpub.FailedPrecondition):
            self.pub.publish_async(version + 1, as_wire(batches))
        gate.set()
        report = fut.result(timeout=60)
        self.assertTrue(report.committed, report.summary())
        self.assertTrue(fut.sent.is_set() and fut.released.is_set() and fut.done())
        self.assertEqual(len(consumed), len(batches))
        self.assertIsNone(fut.exception())
        self.assertFalse(fut.cancel())  # already over
        self.assertReceivedEqual(expected, version)
        seen = []
        fut.add_done_callback(seen.append)  # done: called at once
        self.assertEqual(seen, [fut])

    def test_async_cancel(self):
        version = self.next_version()
        rng = np.random.default_rng(51)
        base = as_wire(qwen3_batches(seed=51))

        def endless():
            yield from base[:3]
            while True:
                time.sleep(0.01)
                yield ("extra", [(f"model.extra.{time.monotonic_ns()}.weight",
                                  wpub.Tensor(bf16(rng, (4, 16)), "bfloat16"))])

        done = threading.Event()
        fut = self.pub.publish_async(version, endless())
        fut.add_done_callback(lambda f: done.set())
        while self.pub.status().active is None:  # the daemon opened it
            time.sleep(0.02)
        self.assertTrue(fut.cancel())
        with self.assertRaises(wpub.Cancelled):
            fut.result(timeout=60)
        self.assertTrue(done.is_set())
        self.assertTrue(fut.cancelled())
        self.assertTrue(fut.released.is_set())
        self.assertLess(self.pub.status().committed_version, version)

    def test_async_errors_surface_from_result(self):
        version = self.next_version()

        def broken():
            yield from as_wire(qwen3_batches(seed=52))[:2]
            raise ValueError("converter failed")

        fut = self.pub.publish_async(version, broken())
        with self.assertRaises(ValueError):
            fut.result(timeout=60)
        self.assertIsInstance(fut.exception(), ValueError)
        # The daemon's errors too (K = 40 is not a multiple of 16), naming the tensor.
        rng = np.random.default_rng(53)
        name = "model.layers.0.mlp.experts.0.down_proj.weight"
        fut = self.pub.publish_async(self.next_version(), [
            ("decoder.layers.0.mlp.experts.linear_fc2.weight0",
             [(name, wpub.Tensor(bf16(rng, (64, 40)), "bfloat16"))])])
        with self.assertRaises(wpub.InvalidArgument) as cm:
            fut.result(timeout=60)
        self.assertIn(name, cm.exception.message)

    def test_progress_phases(self):
        batches = as_wire(qwen3_batches(seed=54))
        seen = []
        report = self.pub.publish(self.next_version(), batches, progress=seen.append)
        phases = [p.phase for p in seen]
        self.assertEqual(phases, ["send"] * len(batches) + ["commit", "done"])
        self.assertEqual([p.batches for p in seen[:len(batches)]],
                         list(range(1, len(batches) + 1)))
        last = seen[-1]
        self.assertIs(last.report, report)
        self.assertEqual(last.buckets, report.num_buckets)
        self.assertGreater(last.buckets, 0)
        self.assertEqual(last.bytes_sent, report.bytes_in)
        self.assertEqual(last.tensors, sum(len(ts) for _, ts in batches))
        self.assertTrue(all(a.elapsed_seconds <= b.elapsed_seconds
                            for a, b in zip(seen, seen[1:])))

    def test_progress_failure_and_raising_callback(self):
        seen = []
        v = self.next_version()
        rng = np.random.default_rng(55)
        bad = [("decoder.layers.0.mlp.experts.linear_fc2.weight0",
                [("model.layers.0.mlp.experts.0.down_proj.weight",
                  wpub.Tensor(bf16(rng, (64, 40)), "bfloat16"))])]
        with self.assertRaises(wpub.InvalidArgument):
            self.pub.publish(v, bad, progress=seen.append)
        self.assertEqual(seen[-1].phase, "failed")
        self.assertIsInstance(seen[-1].error, wpub.InvalidArgument)

        class Stop(Exception):
            pass

        def stop_after_two(p):
            if p.phase == "send" and p.batches == 2:
                raise Stop()

        with self.assertRaises(Stop):  # cancels the publication like an iterable's exception
            self.pub.publish(self.next_version(), as_wire(qwen3_batches(seed=56)),
                             progress=stop_after_two)

    def test_logging(self):
        with self.assertLogs("wpub.publisher", level="INFO") as cm:
            report = self.pub.publish(self.next_version(), as_wire(qwen3_batches(seed=57)))
        self.assertTrue(any(f"v{report.version} COMMITTED" in line for line in cm.output))
        with self.assertLogs("wpub.publisher", level="DEBUG") as cm:
            self.pub.publish(self.next_version(), as_wire(qwen3_batches(seed=58)))
        self.assertTrue(any("batch 0 (" in line for line in cm.output), cm.output)
        self.assertEqual(logging.getLogger("wpub").handlers[0].__class__, logging.NullHandler)

    def test_silent_by_default(self):
        # A script that publishes (and fails once) without configuring logging prints nothing.
        code = (
            "import sys, wpub, numpy as np\n"
            "sys.path.insert(0, %r)\n"
            "from harness import as_wire, qwen3_batches\n"
            "pub = wpub.Publisher(%r)\n"
            "v = pub.status().committed_version + 1\n"
            "pub.publish(v, as_wire(qwen3_batches(seed=59)))\n"
            "try:\n"
            "    pub.publish(v, as_wire(qwen3_batches(seed=59)))\n"
            "except wpub.FailedPrecondition:\n"
            "    pass\n"
            "pub.close()\n") % (HERE, self.daemon.target)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual((out.stdout, out.stderr), ("", ""))


if __name__ == "__main__":
    unittest.main()
