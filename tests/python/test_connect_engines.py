"""Publisher.connect_engines and status().engine_group without a GPU: the CPU-path daemon's
FAILED_PRECONDITION and INVALID_ARGUMENT naming the entry (real wpubd), the client's own
checks of the engine forms it accepts, and, against an in-process fake Publisher service, the
request it sends (entries, group name, timeout, RPC deadline), the result object, and every
daemon error mapped to its exception class with the daemon's message."""

import shutil
import tempfile
import unittest
from concurrent import futures

import grpc

from harness import Daemon

import wpub
from wpub._proto import pb


class CpuDaemonTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix="wpub-py-connect-")
        cls.daemon = Daemon(cls.workdir)
        cls.pub = wpub.Publisher(cls.daemon.target)
        cls.pub.wait_ready()

    @classmethod
    def tearDownClass(cls):
        cls.pub.close()
        code = cls.daemon.stop()
        shutil.rmtree(cls.workdir, ignore_errors=True)
        assert code == 0, f"wpubd exited with {code}"

    def test_no_gpu_path(self):
        with self.assertRaises(wpub.FailedPrecondition) as cm:
            self.pub.connect_engines(["http://127.0.0.1:30000", ("http://127.0.0.1:30001", 2)])
        self.assertIn("this daemon has no GPU path", cm.exception.message)
        s = self.pub.status()
        self.assertIsNone(s.engine_group)
        self.assertEqual(s.engines, [])

    def test_daemon_names_the_bad_entry(self):
        cases = [
            (["http://127.0.0.1:30000", "ftp://127.0.0.1:30001"],
             "engines[1] 'ftp://127.0.0.1:30001'"),
            (["http://a:1", {"url": "http://a:1", "gpus": 2}], "engines[1] 'http://a:1': the URL "
                                                               "is given twice"),
            (["http://:80"], "engines[0] 'http://:80': the URL has no host"),
            (["http://a:70000"], "port"),
            (["trt+http://a:1"], "engines[0]: engine 'trt+http://a:1': unknown engine kind 'trt+'"),
            ([{"url": "vllm+http://a:1", "kind": "sglang"}],
             "engines[0]: kind 'sglang' but the URL says 'vllm'"),
            (["vllm+ftp://a:1"], "engines[0] 'ftp://a:1'"),
        ]
        for engines, expect in cases:
            with self.subTest(engines=engines):
                with self.assertRaises(wpub.InvalidArgument) as cm:
                    self.pub.connect_engines(engines)
                self.assertIn(expect, cm.exception.message)
        with self.assertRaises(wpub.InvalidArgument) as cm:
            self.pub.connect_engines(["http://a:1"], group_name="no spaces please")
        self.assertIn("group_name", cm.exception.message)
        # A pause policy the daemon cannot read is refused naming it (before the GPU path).
        for pause, expect in [("drain", "pause in-flight mode 'drain'"),
                              ("abort:maybe", "pause cache action 'maybe'")]:
            with self.subTest(pause=pause):
                with self.assertRaises(wpub.InvalidArgument) as cm:
                    self.pub.connect_engines(["http://a:1"], pause=pause)
                self.assertIn(expect, cm.exception.message)

    def test_client_checks_the_forms(self):
        for engines, expect in [([], "no engine"), ([("http://a:1", 0)], "engines[0] 'http://a:1'"),
                                ([("http://a:1", "2")], "gpus='2'"),
                                ([{"url": "http://a:1", "gpu": 2}], "engines[0]"),
                                ([42], "engines[0] 42"), ([("http://a:1", 1, 2)], "engines[0]"),
                                ([{"url": "http://a:1", "kind": "trt"}], "kind='trt'"),
                                (["http://a:1=two"], "GPU count"),
                                (["http://a:1=0"], "gpus=0")]:
            with self.subTest(engines=engines):
                with self.assertRaises(wpub.InvalidArgument) as cm:
                    self.pub.connect_engines(engines)
                self.assertIn(expect, cm.exception.message)
        with self.assertRaises(wpub.InvalidArgument):
            self.pub.connect_engines(["http://a:1"], timeout=0)
        for pause in ("", 3):
            with self.assertRaises(wpub.InvalidArgument):
                self.pub.connect_engines(["http://a:1"], pause=pause)


class FakePublisher:
    """A Publisher service answering ConnectEngines with `result` (a response message) or
    aborting with `error` = (grpc.StatusCode, message); records the requests and the deadline
    left when each arrived."""

    def __init__(self):
        self.requests, self.time_left = [], []
        self.result, self.error = None, None
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler("wpub.v1.Publisher", {
            "ConnectEngines": grpc.unary_unary_rpc_method_handler(
                self._connect, request_deserializer=pb.ConnectEnginesRequest.FromString,
                response_serializer=lambda m: m.SerializeToString()),
        })
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _connect(self, request, context):
        self.requests.append(request)
        self.time_left.append(context.time_remaining())
        if self.error is not None:
            context.abort(*self.error)
        return self.result

    def stop(self):
        self.server.stop(None)


class FakeDaemonTest(unittest.TestCase):

    def setUp(self):
        self.fake = FakePublisher()
        self.pub = wpub.Publisher(f"127.0.0.1:{self.fake.port}")

    def tearDown(self):
        self.pub.close()
        self.fake.stop()

    def test_request_and_result(self):
        r = pb.ConnectEnginesResponse(group_name="trainer_3", world_size=6, generation=3)
        r.engines.add(url="http://h0:30000", gpus=1, rank_offset=1, state="idle")
        r.engines.add(url="http://h1:30000", gpus=2, rank_offset=2, state="idle")
        r.engines.add(url="http://h2:30000", gpus=2, rank_offset=4, state="idle")
        self.fake.result = r
        group = self.pub.connect_engines(
            ["http://h0:30000", ("http://h1:30000", 2), {"url": "http://h2:30000", "gpus": 2}],
            group_name="trainer", timeout=45)
        req = self.fake.requests[-1]
        self.assertEqual([(e.url, e.gpus) for e in req.engines],
                         [("http://h0:30000", 1), ("http://h1:30000", 2), ("http://h2:30000", 2)])
        self.assertEqual(req.group_name, "trainer")
        self.assertEqual(req.timeout_seconds, 45.0)
        # The RPC outlives the daemon's join budget.
        self.assertGreater(self.fake.time_left[-1], 45)
        self.assertIsInstance(group, wpub.EngineGroup)
        self.assertEqual((group.group_name, group.world_size, group.generation),
                         ("trainer_3", 6, 3))
        self.assertEqual([(e.url, e.gpus, e.rank_offset) for e in group.engines],
                         [("http://h0:30000", 1, 1), ("http://h1:30000", 2, 2),
                          ("http://h2:30000", 2, 4)])
        self.assertEqual(group.engines[1], wpub.ConnectedEngine("http://h1:30000", 2, 2, "idle"))
        # vLLM engines: by URL scheme (passed as given: the daemon reads it) or by kind.
        self.pub.connect_engines(["vllm+http://v0:8000", {"url": "http://v1:8000", "kind": "vllm",
                                                           "gpus": 2}])
        req = self.fake.requests[-1]
        self.assertEqual([(e.url, e.gpus, e.kind) for e in req.engines],
                         [("vllm+http://v0:8000", 1, ""), ("http://v1:8000", 2, "vllm")])
        # "url=gpus", the form of wpubd --engines and the deploy README's example.
        self.pub.connect_engines(["http://sglang-engine-0:30000=2",
                                  "vllm+http://vllm-engine-0:8000=4"])
        req = self.fake.requests[-1]
        self.assertEqual([(e.url, e.gpus, e.kind) for e in req.engines],
                         [("http://sglang-engine-0:30000", 2, ""),
                          ("vllm+http://vllm-engine-0:8000", 4, "")])
        # Defaults: the daemon's group name, join timeout and pause policy (the RPC still waits
        # longer).
        self.pub.connect_engines("http://h0:30000")
        req = self.fake.requests[-1]
        self.assertEqual((req.group_name, req.timeout_seconds, len(req.engines)), ("", 0.0, 1))
        self.assertFalse(req.HasField("pause"))
        self.assertGreater(self.fake.time_left[-1], 120)
        # A pause policy: its two halves; each engine's, as its kind carries it out, comes back.
        r.engines[0].pause = "retract:keep"
        group = self.pub.connect_engines("http://h0:30000", pause="retract:keep")
        req = self.fake.requests[-1]
        self.assertEqual((req.pause.in_flight, req.pause.cache), ("retract", "keep"))
        self.assertEqual(group.engines[0].pause, "retract:keep")
        self.pub.connect_engines("http://h0:30000", pause="keep")
        req = self.fake.requests[-1]
        self.assertEqual((req.pause.in_flight, req.pause.cache), ("keep", ""))

    def test_every_error_maps_to_its_class(self):
        codes = {
            grpc.StatusCode.INVALID_ARGUMENT: wpub.InvalidArgument,
            grpc.StatusCode.FAILED_PRECONDITION: wpub.FailedPrecondition,
            grpc.StatusCode.UNAVAILABLE: wpub.Unavailable,
            grpc.StatusCode.DEADLINE_EXCEEDED: wpub.DeadlineExceeded,
            grpc.StatusCode.ABORTED: wpub.Aborted,
            grpc.StatusCode.UNAUTHENTICATED: wpub.Unauthenticated,
            grpc.StatusCode.INTERNAL: wpub.Internal,
        }
        for code, cls in codes.items():
            with self.subTest(code=code):
                msg = f"engine http://h1:30000 did not join ({code.name})"
                self.fake.error = (code, msg)
                with self.assertRaises(cls) as cm:
                    self.pub.connect_engines(["http://h1:30000"], timeout=5)
                self.assertEqual(cm.exception.code, code)
                self.assertEqual(cm.exception.message, msg)


if __name__ == "__main__":
    unittest.main()
