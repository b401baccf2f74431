"""Deployment glue of the client: target and version checked before anything is sent,
token_file= and Publisher.from_env() (the variables the Kubernetes manifests set), the
queue_behind_active= flag and its deprecated alias wait=, the shutdown error mapping, the
policy flag allow_nothing_quantized, and the package's version and py.typed marker."""

import os
import shutil
import tempfile
import threading
import time
import unittest
import warnings

import grpc
import numpy as np

from harness import Daemon, DaemonTestCase, as_wire, bf16, qwen3_batches, wait_idle

import wpub
from wpub import _options, errors

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "..", "..", "deploy", "k8s", "base", "trainer-job.yaml")


class TargetAndVersionTest(unittest.TestCase):

    def test_targets(self):
        for ok in ("127.0.0.1:50151", "localhost:1", "trainer-0.wpubd:65535", "[::1]:50151",
                   "unix:/run/wpub.sock", "unix:///run/wpub.sock", "unix-abstract:wpub",
                   "dns:///wpubd.ns.svc:50151", "ipv4:127.0.0.1:50151"):
            self.assertEqual(_options.check_target(ok), ok)
        for bad, why in (("localhost:50161x", "'50161x' is not a number"),
                         ("localhost:0", "'0' is not a number in [1, 65535]"),
                         ("localhost:65536", "[1, 65535]"),
                         ("localhost", "expected host:port"),
                         ("::1:50151", "IPv6 address goes in brackets"),
                         (":50151", "the host is empty"),
                         ("[::1]", "expected [ipv6-address]:port"),
                         ("unix:", "needs a path"),
                         (" 127.0.0.1:50151", "whitespace"),
                         ("", "empty")):
            with self.assertRaises(wpub.InvalidArgument, msg=bad) as cm:
                wpub.Publisher(bad)
            self.assertIn(why, cm.exception.message, bad)
        with self.assertRaises(wpub.InvalidArgument):
            wpub.Publisher(50151)

    def test_versions_checked_before_sending(self):
        # No daemon behind this port: a version error must come before any connection.
        pub = wpub.Publisher("127.0.0.1:9", timeout=5)
        try:
            for bad, why in ((-1, "out of range"), (0, "out of range"), (1 << 64, "out of range"),
                             (1.0, "must be an int"), (True, "must be an int"),
                             ("3", "must be an int")):
                with self.assertRaises(wpub.InvalidArgument, msg=repr(bad)) as cm:
                    pub.publish(bad, [])
                self.assertIn(why, cm.exception.message)
                with self.assertRaises(wpub.InvalidArgument):
                    pub.publish_async(bad, [])
            self.assertEqual(_options.check_version(np.int64(7)), 7)
            self.assertEqual(_options.check_version((1 << 64) - 1), (1 << 64) - 1)
        finally:
            pub.close()

    def test_queue_flag_and_deprecated_wait(self):
        self.assertTrue(_options.queue_flag(True, None))
        self.assertFalse(_options.queue_flag(False, None))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertTrue(_options.queue_flag(False, True))
        self.assertEqual([x.category for x in w], [DeprecationWarning])
        self.assertIn("queue_behind_active", str(w[0].message))
        with self.assertRaises(TypeError):
            _options.queue_flag(True, True)
        h = _options.build_header(3, "nvfp4", {"allow_nothing_quantized": True}, None, "", False,
                                  True, 0)
        self.assertTrue(h.queue)
        self.assertTrue(h.precision_exceptions.allow_nothing_quantized)
        self.assertFalse(h.release_gpu_memory)
        h = _options.build_header(4, "nvfp4", None, None, "", False, False, 0,
                                  release_gpu_memory=True)
        self.assertTrue(h.release_gpu_memory)

    def test_shutdown_mapping(self):
        class FakeCall(grpc.RpcError):
            def __init__(self, code, details):
                self._c, self._d = code, details

            def code(self):
                return self._c

            def details(self):
                return self._d

        fp = grpc.StatusCode.FAILED_PRECONDITION
        e = errors.from_rpc_error(FakeCall(fp, "publication 4 has ended: DEADLINE_EXCEEDED: "
                                               "publication 4 did not finish before the shutdown "
                                               "deadline"))
        self.assertIsInstance(e, wpub.DaemonShuttingDown)
        self.assertIsInstance(e, wpub.Unavailable)
        self.assertIsInstance(e, wpub.PublicationAborted)
        self.assertIsNone(e.report)
        e = errors.from_rpc_error(FakeCall(fp, "publication 4 has ended: ABORTED: recv-0 left"))
        self.assertIs(type(e), wpub.PublicationAborted)
        e = errors.from_rpc_error(FakeCall(grpc.StatusCode.UNAVAILABLE,
                                           "the engine is shutting down"))
        self.assertIsInstance(e, wpub.DaemonShuttingDown)
        e = errors.from_rpc_error(FakeCall(fp, "version 3 is not greater than 5"))
        self.assertIs(type(e), wpub.FailedPrecondition)

    def test_version_and_typed_marker(self):
        import wpub._version
        self.assertEqual(wpub.__version__, wpub._version.__version__)
        self.assertRegex(wpub.__version__, r"^\d+\.\d+\.\d+$")
        self.assertTrue(os.path.isfile(os.path.join(os.path.dirname(wpub.__file__), "py.typed")))


class TokenAndEnvTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix="wpub-py-env-")
        cls.daemon = Daemon(cls.workdir, token="s3cret")

    @classmethod
    def tearDownClass(cls):
        code = cls.daemon.stop()
        shutil.rmtree(cls.workdir, ignore_errors=True)
        assert code == 0, f"wpubd exited with {code}"

    def write(self, name, text):
        path = os.path.join(self.workdir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_token_file(self):
        good = self.write("token", "s3cret\n")  # a Secret's file may end in a newline
        with wpub.Publisher(self.daemon.target, token_file=good) as pub:
            self.assertTrue(pub.status().serving)
        with wpub.Publisher(self.daemon.target, token_file=self.write("wrong", "nope")) as pub:
            with self.assertRaises(wpub.Unauthenticated):
                pub.status()
        for path, why in ((os.path.join(self.workdir, "missing"), "No such file"),
                          (self.write("empty", "\n"), "is empty"),
                          (self.write("two", "a b\n"), "whitespace")):
            with self.assertRaises(wpub.InvalidArgument) as cm:
                wpub.Publisher(self.daemon.target, token_file=path)
            self.assertIn(path, cm.exception.message)
            self.assertIn(why, cm.exception.message)
        with self.assertRaises(wpub.InvalidArgument):
            wpub.Publisher(self.daemon.target, token="x", token_file=good)

    def test_from_env(self):
        good = self.write("token-env", "s3cret")
        env = {"WPUB_TARGET": self.daemon.target, "WPUB_TOKEN_FILE": good}
        with wpub.Publisher.from_env(env) as pub:
            self.assertEqual(pub.target, self.daemon.target)
            self.assertTrue(pub.status().serving)
        with wpub.Publisher.from_env(env, token="nope") as pub:  # keywords override
            with self.assertRaises(wpub.Unauthenticated):
                pub.status()
        with wpub.Publisher.from_env({}) as pub:
            self.assertEqual(pub.target, "127.0.0.1:50151")
        with self.assertRaises(wpub.InvalidArgument):
            wpub.Publisher.from_env({"WPUB_TARGET": "localhost:50161x"})

    def test_manifest_sets_the_variables_from_env_reads(self):
        with open(MANIFEST) as f:
            text = f.read()
        for var in ("WPUB_TARGET", "WPUB_TOKEN_FILE"):
            self.assertIn(f"name: {var}", text)
            self.assertIn(var, wpub.publisher.ENV_VARS)


class NothingQuantizedTest(DaemonTestCase):
    """A quantizing recipe whose plan quantizes nothing is refused at commit, naming the
    recipe and tensors; the policy flag publishes it; HF names are quantized."""

    def unrecognized(self, seed):
        rng = np.random.default_rng(seed)
        return [("layers.0.moe.w_in.0", [("layers.0.moe.expert0.w_in",
                                          wpub.Tensor(bf16(rng, (32, 64)), "bfloat16"))]),
                ("layers.0.norm", [("layers.0.norm.weight",
                                    wpub.Tensor(bf16(rng, (64,)), "bfloat16"))])]

    def test_refused_then_allowed(self):
        v = self.next_version()
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.publish(v, self.unrecognized(1))
        msg = cm.exception.message
        self.assertIn("recipe nvfp4", msg)
        self.assertIn("layers.0.moe.expert0.w_in", msg)
        self.assertIn("allow_nothing_quantized", msg)
        s = wait_idle(self.pub)
        self.assertLess(s.committed_version, v)
        report = self.pub.publish(v, self.unrecognized(2),
                                  policy={"allow_nothing_quantized": True})
        self.assertTrue(report.committed)
        self.assertEqual(report.tensors_quantized, 0)
        # recipe bf16 never needs the flag.
        self.assertTrue(self.pub.publish(self.next_version(), self.unrecognized(3),
                                         recipe="bf16").committed)


class ShutdownMidStreamTest(unittest.TestCase):
    """SIGTERM while a publication is being streamed (drain deadline 0): the trainer gets a
    DaemonShuttingDown (a PublicationAborted and an Unavailable), not FailedPrecondition."""

    def test_shutdown_mid_stream(self):
        workdir = tempfile.mkdtemp(prefix="wpub-py-shutdown-")
        daemon = Daemon(workdir, "--drain_deadline=0s", "--shutdown_grace=5s")
        pub = wpub.Publisher(daemon.target, timeout=60)
        base = as_wire(qwen3_batches(seed=40))
        rng = np.random.default_rng(41)
        signalled = threading.Event()

        def endless():  # yields until the RPC ends (put() then stops consuming it)
            yield from base[:2]
            while pub.status().active is None:
                time.sleep(0.02)
            daemon.proc.terminate()
            signalled.set()
            n = 0
            while True:
                n += 1
                time.sleep(0.01)
                yield (f"extra.{n}", [(f"model.extra.{n}.weight",
                                       wpub.Tensor(bf16(rng, (4, 16)), "bfloat16"))])

        try:
            with self.assertRaises(wpub.WpubError) as cm:
                pub.publish(1, endless())
            self.assertTrue(signalled.is_set())
            # Whichever the daemon got to first (the publication's abort, or the server's
            # shutdown), the trainer learns that the daemon is going away.
            self.assertIsInstance(cm.exception, wpub.Unavailable, repr(cm.exception))
            self.assertIsInstance(cm.exception, wpub.PublicationAborted, repr(cm.exception))
        finally:
            pub.close()
            code = daemon.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        self.assertEqual(code, 0)


if __name__ == "__main__":
    unittest.main()
