"""Every way a publication fails surfaces as the right wpub exception with the daemon's message
(naming the tensor); cancellations (exception in the iterable, KeyboardInterrupt, cancel(),
deadline) abort the publication on the daemon and receivers keep the previous version."""

import threading
import time
import unittest

import numpy as np

from harness import Daemon, DaemonTestCase, as_wire, bf16, qwen3_batches, wait_idle

import wpub

EXPERT = "model.layers.0.mlp.experts.0"


class ErrorsTest(DaemonTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # A committed baseline every failure must leave in place.
        cls.base_version = 1
        cls.version = 1
        report = cls.pub.publish(1, as_wire(qwen3_batches(seed=11)))
        assert report.committed, report.summary()

    def assertUnchanged(self, failed_version: int, status: str = "ABORTED",
                        reported: bool = True):
        """The daemon is idle, its committed version unchanged, the failed version reported with
        `status` (when `reported`; else if the daemon got that far), and the receiver still
        holds the baseline."""
        s = wait_idle(self.pub)
        self.assertEqual(s.committed_version, self.base_version)
        reports = {r.version: r for r in s.recent_reports}
        if reported:
            self.assertIn(failed_version, reports)
        if failed_version in reports:
            self.assertEqual(reports[failed_version].status, status)
        self.assertEqual(s.receivers[0].last_committed_version, self.base_version)
        _, meta = self.received(0, self.base_version)
        self.assertEqual(meta["version"], str(self.base_version))

    def expert_pair(self, rng, gate_cols=64, up_cols=64):
        return ("decoder.layers.0.mlp.experts.linear_fc1.weight0",
                [(f"{EXPERT}.gate_proj.weight", wpub.Tensor(bf16(rng, (32, gate_cols)), "bfloat16")),
                 (f"{EXPERT}.up_proj.weight", wpub.Tensor(bf16(rng, (32, up_cols)), "bfloat16"))])

    # -- daemon-side rejections ----------------------------------------------------------------

    def test_k_not_multiple_of_16(self):
        rng = np.random.default_rng(1)
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, [self.expert_pair(rng, 40, 40)])
        self.assertIn(f"{EXPERT}.gate_proj.weight", cm.exception.message)
        self.assertIn("16", cm.exception.message)
        self.assertUnchanged(v, "FAILED")

    def test_incomplete_pair(self):
        rng = np.random.default_rng(2)
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, [("decoder.layers.0.mlp.experts.linear_fc1.weight0",
                                  [(f"{EXPERT}.gate_proj.weight",
                                    wpub.Tensor(bf16(rng, (32, 64)), "bfloat16"))])])
        self.assertIn(f"{EXPERT}.gate_proj.weight", cm.exception.message)
        self.assertUnchanged(v, "FAILED")

    def test_non_finite(self):
        rng = np.random.default_rng(3)
        m, ts = self.expert_pair(rng)
        ts[1][1].data[5, 7] = 0x7FC0  # bf16 NaN in up_proj
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, [(m, ts)])
        self.assertIn(f"{EXPERT}.up_proj.weight", cm.exception.message)
        self.assertIn("non-finite", cm.exception.message)
        self.assertUnchanged(v, "FAILED")

    def test_duplicate_tensor(self):
        rng = np.random.default_rng(4)
        norm = "model.layers.0.input_layernorm.weight"
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, [("a", [(norm, wpub.Tensor(bf16(rng, (64,)), "bfloat16"))]),
                                 ("b", [(norm, wpub.Tensor(bf16(rng, (64,)), "bfloat16"))])])
        self.assertIn(norm, cm.exception.message)
        self.assertUnchanged(v, "FAILED")

    def test_version_not_increasing(self):
        with self.assertRaises(wpub.FailedPrecondition) as cm:
            self.pub.publish(self.base_version, as_wire(qwen3_batches(seed=5)))
        self.assertIn(str(self.base_version), cm.exception.message)
        self.assertUnchanged(self.base_version, "COMMITTED", reported=False)

    def test_bad_ignore_regex(self):
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, as_wire(qwen3_batches(seed=6)),
                             quantization_config={"quant_algo": "NVFP4", "ignore": ["re:(unclosed"]})
        self.assertIn("(unclosed", cm.exception.message)
        self.assertUnchanged(v, reported=False)  # refused before the publication opened

    def test_cuda_ipc_on_cpu_daemon(self):
        v = self.next_version()
        ref = wpub.CudaIpc(handle=b"\x01" * 64, device_uuid="GPU-00000000-0000-0000-0000-000000000000",
                           offset=0, shape=(32, 64), dtype="bfloat16")
        with self.assertRaises(wpub.Unimplemented) as cm:
            self.pub.publish(v, [("decoder.layers.0.mlp.router.weight",
                                  [("model.layers.0.mlp.gate.weight", ref)])])
        self.assertIn("model.layers.0.mlp.gate.weight", cm.exception.message)
        self.assertUnchanged(v, "FAILED")

    def test_client_side_tensor_errors(self):
        v = self.next_version()
        with self.assertRaises(wpub.TensorError) as cm:
            self.pub.publish(v, [("a", [("x.weight", np.zeros((4, 4), dtype=np.uint16))])])
        self.assertIn("x.weight", cm.exception.message)
        self.assertIn("bfloat16", cm.exception.message)
        with self.assertRaises(wpub.TensorError) as cm:
            self.pub.publish(v, [("a", [("y.weight", wpub.concat(
                [np.zeros((4, 4), np.float32), np.zeros((4, 8), np.float32)], 0))])])
        self.assertIn("y.weight", cm.exception.message)
        self.assertIsInstance(cm.exception, wpub.WpubError)
        self.assertUnchanged(v, reported=False)

    def test_second_concurrent_publication(self):
        release = threading.Event()
        first_v = self.next_version()
        outcome = {}

        def slow():
            yield from as_wire(qwen3_batches(seed=7))[:2]
            release.wait(20)

        def first():
            try:
                self.pub.publish(first_v, slow())
            except BaseException as e:  # noqa: B902
                outcome["error"] = e

        t = threading.Thread(target=first)
        t.start()
        while self.pub.status().active is None:
            time.sleep(0.02)
        other = wpub.Publisher(self.daemon.target)
        try:
            with self.assertRaises(wpub.FailedPrecondition) as cm:
                other.publish(first_v + 1, as_wire(qwen3_batches(seed=8)))
            self.assertRegex(cm.exception.message, rf"\b{first_v}\b.*active")
        finally:
            other.close()
            self.pub.cancel()  # also ends `first` (the generator then ends on its own)
            release.set()
            t.join(20)
        self.assertIsInstance(outcome.get("error"), wpub.Cancelled)
        self.assertUnchanged(first_v)

    # -- cancellation and deadlines -------------------------------------------------------------

    def test_exception_in_iterable_aborts(self):
        v = self.next_version()

        def broken():
            yield from as_wire(qwen3_batches(seed=9))[:3]
            while self.pub.status().active is None:  # the daemon has opened v
                time.sleep(0.02)
            raise ValueError("converter failed on layer 0")

        with self.assertRaises(ValueError) as cm:
            self.pub.publish(v, broken())
        self.assertIn("converter failed", str(cm.exception))
        self.assertUnchanged(v)

    def test_keyboard_interrupt_aborts(self):
        v = self.next_version()

        def interrupted():
            yield from as_wire(qwen3_batches(seed=10))[:3]
            while self.pub.status().active is None:
                time.sleep(0.02)
            raise KeyboardInterrupt

        with self.assertRaises(KeyboardInterrupt):
            self.pub.publish(v, interrupted())
        self.assertUnchanged(v)

    def test_cancel_from_another_thread(self):
        v = self.next_version()
        rng = np.random.default_rng(12)
        produced = []

        def endless():  # a converter that would go on forever: cancel() must stop it
            yield from as_wire(qwen3_batches(seed=12))[:3]
            while True:
                produced.append(len(produced))
                time.sleep(0.02)
                yield (f"extra.{len(produced)}", [(f"model.extra.{len(produced)}.weight",
                                                   wpub.Tensor(bf16(rng, (4, 16)), "bfloat16"))])

        timer = threading.Timer(0.5, self.pub.cancel)
        timer.start()
        try:
            with self.assertRaises(wpub.Cancelled) as cm:
                self.pub.publish(v, endless())
        finally:
            timer.join()
        self.assertIn("Publisher.cancel()", cm.exception.message)
        self.assertGreater(len(produced), 0)
        self.assertUnchanged(v)

    def test_deadline_exceeded(self):
        v = self.next_version()

        def slow():
            yield from as_wire(qwen3_batches(seed=13))[:3]
            time.sleep(1.5)
            yield from as_wire(qwen3_batches(seed=13))[3:]

        t0 = time.monotonic()
        with self.assertRaises(wpub.DeadlineExceeded):
            self.pub.publish(v, slow(), timeout=0.5)
        self.assertLess(time.monotonic() - t0, 5)
        self.assertUnchanged(v, reported=False)

    def test_daemon_keeps_serving(self):
        v = self.next_version()
        report = self.pub.publish(v, as_wire(qwen3_batches(seed=14)))
        self.assertTrue(report.committed)
        type(self).base_version = v
        self.assertUnchanged(v, "COMMITTED")


class ReceiverFailureTest(DaemonTestCase):
    """A receiver that corrupts every bucket 0 it pulls: its checksum mismatch aborts each
    publication, which the daemon still answers with a report (status ABORTED)."""

    RECEIVER_FLAGS = ("--corrupt_bucket=0",)

    def test_publication_aborted(self):
        v = self.next_version()
        with self.assertRaises(wpub.PublicationAborted) as cm:
            self.pub.publish(v, as_wire(qwen3_batches(seed=30)))
        report = cm.exception.report
        self.assertEqual((report.status, report.version), ("ABORTED", v))
        self.assertEqual(report.receivers[0].name, "recv-0")
        self.assertFalse(report.receivers[0].committed)
        self.assertIn("recv-0", cm.exception.message)
        self.assertEqual(wait_idle(self.pub).committed_version, 0)
        # check=False returns the report instead.
        report = self.pub.publish(self.next_version(), as_wire(qwen3_batches(seed=31)),
                                  check=False)
        self.assertEqual(report.status, "ABORTED")
        self.assertNotEqual(report.receivers[0].failure, "none")


class ConnectionErrorsTest(unittest.TestCase):

    def test_unavailable(self):
        pub = wpub.Publisher("127.0.0.1:1", rpc_timeout=2)
        with self.assertRaises(wpub.Unavailable):
            pub.status()
        with self.assertRaises(wpub.Unavailable):
            pub.wait_ready(timeout=0.5)
        pub.close()

    def test_unauthenticated_and_connect_engines(self):
        import tempfile
        import shutil
        d = tempfile.mkdtemp(prefix="wpub-py-auth-")
        daemon = Daemon(d, token="s3cret")
        try:
            with self.assertRaises(wpub.Unauthenticated):
                wpub.Publisher(daemon.target).status()
            with self.assertRaises(wpub.Unauthenticated):
                wpub.Publisher(daemon.target, token="wrong").publish(1, [])
            ok = wpub.Publisher(daemon.target, token="s3cret")
            self.assertTrue(ok.status().serving)
            with self.assertRaises(wpub.Unauthenticated):
                wpub.Publisher(daemon.target).connect_engines(["http://127.0.0.1:30000"])
            # The CPU-path daemon has no engines to connect.
            with self.assertRaises(wpub.FailedPrecondition) as cm:
                ok.connect_engines(engines=["http://127.0.0.1:30000"])
            self.assertIn("no GPU path", cm.exception.message)
            ok.close()
        finally:
            self.assertEqual(daemon.stop(), 0)
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
