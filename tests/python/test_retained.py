"""The retained copy through the real processes: wpubd --retain=host, wpub-recv receivers that
subscribe late (holding nothing, or an older version in their --output file) are caught up to
the committed version byte for byte without the trainer publishing, status and metrics say what
the copy holds and how far each receiver is behind, Publisher.restore and its refusals
(--retain=off, over --retain_max_bytes)."""

import os
import shutil
import tempfile
import time
import unittest
import urllib.request

from harness import (Daemon, Receiver, as_wire, qwen3_batches, read_safetensors, reference,
                     wait_for_receivers)

import wpub


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


class RetainedCopyTest(unittest.TestCase):

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="wpub-py-retained-")
        self.procs = []

    def tearDown(self):
        codes = [p.stop() for p in reversed(self.procs)]
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.assertTrue(all(c == 0 for c in codes), f"exit codes {codes}")

    def start(self, *flags):
        self.daemon = Daemon(self.workdir, *flags, metrics="127.0.0.1:0")
        self.procs.append(self.daemon)
        self.pub = wpub.Publisher(self.daemon.target, timeout=60)
        self.addCleanup(self.pub.close)
        self.pub.wait_ready()

    def receiver(self, name: str) -> Receiver:
        r = Receiver(self.daemon, name)
        self.procs.append(r)
        return r

    def file_version(self, r: Receiver) -> int:
        if not os.path.exists(r.output):
            return 0
        return int(read_safetensors(r.output)[1].get("version", "0"))

    def test_late_receivers_are_caught_up_byte_for_byte(self):
        self.start("--retain=host")
        early = self.receiver("early")
        wait_for_receivers(self.pub, 1)
        batches = {v: qwen3_batches(seed=v) for v in (1, 2)}
        for v in (1, 2):
            report = self.pub.publish(v, as_wire(batches[v]), model_id="qwen3-toy")
            self.assertTrue(report.committed, report.error_message)
        wait_for(lambda: self.file_version(early) == 2, "early holds v2")
        # Stopped at v2, the early receiver restarts after v3: its file says it holds v2.
        early.stop()
        self.procs.remove(early)
        report = self.pub.publish(3, as_wire(qwen3_batches(seed=3)), model_id="qwen3-toy")
        self.assertTrue(report.committed, report.error_message)
        status = self.pub.status()
        self.assertEqual(status.retained.where, "host")
        self.assertEqual(status.retained.version, 3)
        self.assertEqual(status.retained.bytes, report.bytes_out)
        self.assertEqual(status.retained.held_bytes, report.bytes_out)  # host: the buckets
        self.assertEqual(status.retained.reason, "")

        late = self.receiver("late")  # holds nothing
        again = Receiver(self.daemon, "early")  # the same file: holds v2
        self.procs.append(again)
        expected = reference(self.workdir, qwen3_batches(seed=3))
        for r in (late, again):
            wait_for(lambda: self.file_version(r) == 3, f"{r.output} holds v3")
            got, _ = read_safetensors(r.output)
            self.assertEqual(sorted(got), sorted(expected))
            for name, (dtype, shape, raw) in expected.items():
                self.assertEqual((got[name][0], tuple(got[name][1])), (dtype, tuple(shape)), name)
                self.assertTrue(got[name][2] == raw, f"{name}: caught-up bytes differ")

        status = wait_for(lambda: (lambda s: s if all(
            x.held_version == 3 for x in s.receivers) and len(s.receivers) == 2 else None)(
                self.pub.status()), "both receivers reported at v3")
        self.assertEqual(status.committed_version, 3)
        replays = status.recent_replays
        self.assertTrue(replays)
        self.assertTrue(all(r.kind == "catch_up" and r.completed and r.version == 3
                            for r in replays), replays)
        caught = sorted(o.name for r in replays for o in r.receivers if o.committed)
        self.assertEqual(caught, ["early", "late"])
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.daemon.metrics_port}/metrics", timeout=10) as f:
            metrics = f.read().decode()
        self.assertIn('wpub_receiver_versions_behind{receiver="late"} 0', metrics)
        self.assertIn('wpub_retained_version 3', metrics)
        self.assertIn('wpub_replays_total{kind="catch_up",outcome="completed"}', metrics)

        # An operator's restore: nothing is behind, so it completes with no participant.
        r = self.pub.restore("test")
        self.assertTrue(r.completed, r.error)
        self.assertEqual((r.kind, r.version, r.trigger), ("restore", 3, "test"))
        self.assertEqual(r.receivers, [])
        # The next version still reaches everyone.
        report = self.pub.publish(4, as_wire(qwen3_batches(seed=4)), model_id="qwen3-toy")
        self.assertTrue(report.committed, report.error_message)
        self.assertEqual(len(report.receivers), 2)

    def test_restore_refused_without_a_copy(self):
        self.start()  # --retain=off
        with self.assertRaises(wpub.FailedPrecondition) as cm:
            self.pub.restore()
        self.assertIn("--retain=off", cm.exception.message)
        self.assertEqual(self.pub.status().retained.where, "off")

    def test_over_the_bound_nothing_is_retained(self):
        self.start("--retain=host", "--retain_max_bytes=1KiB")
        report = self.pub.publish(1, as_wire(qwen3_batches(seed=1)), model_id="qwen3-toy")
        self.assertTrue(report.committed, report.error_message)
        retained = self.pub.status().retained
        self.assertEqual((retained.version, retained.over_bound), (0, 1))
        self.assertIn("over the bound of 1024 bytes", retained.reason)
        with self.assertRaises(wpub.FailedPrecondition) as cm:
            self.pub.restore()
        self.assertIn("--retain_max_bytes", cm.exception.message)

    def test_a_bad_retain_flag_is_refused(self):
        with self.assertRaises(RuntimeError) as cm:
            Daemon(self.workdir, "--retain=gpu")
        self.assertIn("--retain: 'gpu' is not one of off, host", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
