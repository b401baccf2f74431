"""Publication groups end to end: three wpubd processes (one per "node"), each publishing a third
of a GLM-like MoE under one version, and two wpub-recv processes subscribed to all three. Every
committed version is checked byte for byte against the CPU reference on both receivers; every
failure (a tensor claimed twice, a part missing from the declared manifest, a member with
another version, a follower killed mid-publication, the leader killed) aborts the version on
every member, leaves the previous version intact on every receiver, and the next version
commits."""

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import unittest

import wpub
from harness import (Daemon, Receiver, as_wire, free_port, glm_batches, read_safetensors,
                     reference)

MEMBERS = 3
RECEIVERS = 2


class GroupReceiver(Receiver):
    """A wpub-recv subscribed to every member."""

    def __init__(self, workdir: str, targets, name: str):
        self.output = os.path.join(workdir, f"{name}.safetensors")
        self._start([os.environ["WPUB_RECV"], f"--target={','.join(targets)}", f"--name={name}",
                     f"--output={self.output}", "--log_level=warn",
                     "--resubscribe_timeout=120s"],
                    os.path.join(workdir, f"{name}.log"))


class CuttableProxy:
    """A TCP proxy to `target` whose connections can all be cut at once (a network between
    daemons that drops); it keeps accepting new ones. `delay` (seconds) holds back every chunk
    from the target to the client that long (a slow link: what the target says arrives late)."""

    def __init__(self, target: str):
        self.delay = 0.0
        host, port = target.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.target = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.conns = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            with self.lock:
                self.conns += [c, u]
                self.accepted += 1
            for a, b, slow in ((c, u, False), (u, c, True)):
                threading.Thread(target=self._pump, args=(a, b, slow), daemon=True).start()

    def _pump(self, a, b, slow):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if slow and self.delay > 0:
                    time.sleep(self.delay)
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.cut()
        self.sock.close()


def split(batches, members=MEMBERS):
    """Whole conversion batches dealt round-robin: member i holds batches i, i+n, ..."""
    return [batches[i::members] for i in range(members)]


def names_of(batches):
    return [n for _, ts in batches for n, _ in ts]


class GroupTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix="wpub-py-group-")
        cls.ports = [free_port() for _ in range(MEMBERS)]
        cls.daemons = [cls.start_daemon(i) for i in range(MEMBERS)]
        cls.targets = [d.target for d in cls.daemons]
        cls.receivers = [GroupReceiver(cls.workdir, cls.targets, f"recv-{i}")
                         for i in range(RECEIVERS)]
        cls.pubs = [wpub.Publisher(t, timeout=60) for t in cls.targets]
        for p in cls.pubs:
            p.wait_ready()
        cls.wait_subscribed()
        cls.version = 0
        cls.held = None  # (version, expected contents) every receiver must hold

    @classmethod
    def start_daemon(cls, i):
        return Daemon(cls.workdir, f"--min_receivers={RECEIVERS}", "--group_timeout=20s",
                      "--group_join_timeout=5s", listen=f"127.0.0.1:{cls.ports[i]}")

    @classmethod
    def wait_subscribed(cls, timeout=30.0):
        deadline = time.monotonic() + timeout
        for p in cls.pubs:
            while len(p.status().receivers) < RECEIVERS:
                if time.monotonic() > deadline:
                    raise RuntimeError("receivers did not subscribe to every member")
                time.sleep(0.05)

    @classmethod
    def tearDownClass(cls):
        for p in cls.pubs:
            p.close()
        codes = [r.stop() for r in cls.receivers]
        dcodes = [d.stop() for d in cls.daemons]
        if not os.environ.get("WPUB_TEST_KEEP"):
            shutil.rmtree(cls.workdir, ignore_errors=True)
        assert all(c == 0 for c in dcodes), f"wpubd exit codes {dcodes}"
        assert all(c == 0 for c in codes), f"wpub-recv exit codes {codes}"

    def publish(self, version, parts, *, versions=None, expected=None, timeout=0.0,
                hold=None, leader=None):
        """Every member publishes its part at once; returns their outcomes by member.
        versions: per-member versions (default: all `version`). hold: {member: (sent, release)}
        events -- that member's batches stop after the first until `release` is set."""
        outcomes = [None] * MEMBERS

        def batches(i):
            items = as_wire(parts[i])
            if hold and i in hold:
                sent, release = hold[i]
                yield items[0]
                sent.set()
                release.wait(60)
                items = items[1:]
            yield from items

        def run(i):
            g = wpub.PublicationGroup(self.pubs[i], "glm", MEMBERS, i, leader or self.targets[0],
                                      timeout=timeout)
            try:
                outcomes[i] = g.publish(versions[i] if versions else version, batches(i),
                                        expected_tensors=expected if i == 0 else None,
                                        bucket_bytes=16384)
            except wpub.WpubError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(MEMBERS)]
        for t in threads:
            t.start()
        return threads, outcomes

    def run_group(self, version, parts, **kw):
        threads, outcomes = self.publish(version, parts, **kw)
        for t in threads:
            t.join(120)
        return outcomes

    def next_version(self):
        cls = type(self)
        cls.version += 1
        return cls.version

    def assertAllHold(self, version, expected, timeout=20.0):
        for r in self.receivers:
            deadline = time.monotonic() + timeout
            while True:
                meta = {}
                if os.path.exists(r.output):
                    got, meta = read_safetensors(r.output)
                    if meta.get("version") == str(version):
                        break
                if time.monotonic() > deadline:
                    self.fail(f"{r.output} holds {meta.get('version')}, not v{version}")
                time.sleep(0.05)
            self.assertEqual(sorted(got), sorted(expected))
            for name, (dtype, shape, raw) in expected.items():
                self.assertEqual((got[name][0], tuple(got[name][1])), (dtype, tuple(shape)), name)
                self.assertTrue(got[name][2] == raw, f"{name}: bytes differ from the reference")

    def commit_version(self, seed):
        """A group version that must commit; checked on every receiver."""
        v = self.next_version()
        model = glm_batches(seed)
        outcomes = self.run_group(v, split(model), expected=names_of(model))
        for i, o in enumerate(outcomes):
            self.assertIsInstance(o, wpub.GroupOutcome, f"member {i}: {o}")
            self.assertTrue(o.committed, f"member {i}: {o.error}")
        expected = reference(self.workdir, model)
        self.assertAllHold(v, expected)
        type(self).held = (v, expected)
        return v, outcomes

    def assertAbortedEverywhere(self, outcomes, *needles):
        for i, o in enumerate(outcomes):
            if isinstance(o, wpub.WpubError):
                text = str(o)
            else:
                self.assertFalse(o.committed, f"member {i} committed")
                text = o.error
            for n in needles:
                self.assertIn(n, text, f"member {i}")
        # Nothing changed on any receiver.
        v, expected = type(self).held
        self.assertAllHold(v, expected)

    def test_01_versions_commit_on_every_receiver(self):
        for seed in (11, 12, 13):
            v, outcomes = self.commit_version(seed)
        g = outcomes[0].report.group
        self.assertEqual((g.group, g.members, g.member, g.outcome), ("glm", 3, 0, "committed"))
        self.assertEqual([m.state for m in g.members_detail], ["committed"] * MEMBERS)
        self.assertTrue(all(m.tensors > 0 and m.bytes_out > 0 for m in g.members_detail))
        self.assertIn(g.slowest_member, range(MEMBERS))
        self.assertEqual(outcomes[2].report.group.member, 2)
        st = self.pubs[0].status()
        self.assertEqual(st.raw.publication_group.version, v)
        self.assertEqual(st.raw.publication_group.outcome, "committed")

    def test_02_a_tensor_claimed_twice_fails_naming_it_and_both_members(self):
        model = glm_batches(21)
        parts = split(model)
        parts[2] = parts[2] + [parts[1][0]]  # member 2 also claims member 1's first batch
        dup = parts[1][0][1][0][0]
        outcomes = self.run_group(self.next_version(), parts)
        self.assertAbortedEverywhere(outcomes, dup, "member 1", "member 2")
        self.commit_version(22)

    def test_03_a_part_missing_from_the_declared_manifest_fails_naming_it(self):
        v = self.next_version()
        model = glm_batches(31)
        parts = split(model)
        missing = parts[1][-1][1][0][0]
        parts[1] = parts[1][:-1]
        outcomes = self.run_group(v, parts, expected=names_of(model))
        self.assertAbortedEverywhere(outcomes, missing, "declared manifest")
        self.commit_version(32)

    def test_04_a_member_with_another_version_is_refused(self):
        v = self.next_version()
        model = glm_batches(41)
        outcomes = self.run_group(v, split(model), versions=[v, v + 1, v], timeout=5)
        # Refused when the leader's round was there first; aborted by the leader's version when
        # the member's round was: either way naming both versions, and nothing commits.
        o = outcomes[1]
        if isinstance(o, wpub.WpubError):
            self.assertIsInstance(o, wpub.FailedPrecondition)
            text = str(o)
        else:
            self.assertFalse(o.committed)
            text = o.error
        self.assertIn(f"version {v + 1}", text)
        self.assertIn(f"version {v}", text)
        self.assertAbortedEverywhere(outcomes)
        self.next_version()  # v + 1 may have been taken by member 1's refused attempt
        self.commit_version(42)

    def kill_and_restart(self, member, seed, *needles):
        v = self.next_version()
        sent, release = threading.Event(), threading.Event()
        threads, outcomes = self.publish(v, split(glm_batches(seed)), hold={member: (sent, release)})
        self.assertTrue(sent.wait(30))
        # The others finished their streams and wait for the group; the member is mid-stream.
        time.sleep(0.5)
        cls = type(self)
        cls.daemons[member].proc.send_signal(signal.SIGKILL)
        cls.daemons[member].stop()
        release.set()
        for t in threads:
            t.join(120)
        self.assertAbortedEverywhere([o for i, o in enumerate(outcomes) if i != member],
                                     *needles)
        cls.daemons[member] = cls.start_daemon(member)
        cls.pubs[member].close()
        cls.pubs[member] = wpub.Publisher(cls.targets[member], timeout=60)
        cls.pubs[member].wait_ready()
        cls.wait_subscribed()
        self.commit_version(seed + 1)

    def test_04b_a_connection_between_daemons_dropped_aborts_the_version(self):
        # The members reach the leader through a proxy; the leader's own trainer is slow, so
        # the others have joined and wait at the parts check when the network drops.
        proxy = CuttableProxy(self.targets[0])
        try:
            v = self.next_version()
            sent, release = threading.Event(), threading.Event()
            threads, outcomes = self.publish(v, split(glm_batches(45)), hold={0: (sent, release)},
                                             leader=proxy.target)
            self.assertTrue(sent.wait(30))
            deadline = time.monotonic() + 30
            while True:  # both members' joins went through the proxy
                s = self.pubs[0].status().raw.publication_group
                joined = [m.state for m in s.members_detail[1:]] if s.version == v else []
                if joined and all(st != "waiting" for st in joined):
                    break
                self.assertLess(time.monotonic(), deadline, f"members did not join: {s}")
                time.sleep(0.02)
            proxy.cut()
            release.set()
            for t in threads:
                t.join(120)
            self.assertAbortedEverywhere(outcomes)
            texts = [str(o) if isinstance(o, wpub.WpubError) else o.error for o in outcomes[1:]]
            self.assertIn("connection", " ".join(texts))
            # The network is back (the proxy accepts again): the next version commits.
            model = glm_batches(46)
            v = self.next_version()
            outcomes = self.run_group(v, split(model), leader=proxy.target)
            for i, o in enumerate(outcomes):
                self.assertTrue(o.committed, f"member {i}: {o.error}")
            expected = reference(self.workdir, model)
            self.assertAllHold(v, expected)
            type(self).held = (v, expected)
        finally:
            proxy.close()

    def test_04c_a_member_cannot_make_the_leader_hold_unbounded_names(self):
        # A hostile or broken member on the daemon-to-daemon API: an oversized tensor name is
        # refused naming the bound, its round aborts, the leader keeps serving.
        import grpc
        from wpub._proto import pb
        v = self.next_version()
        channel = grpc.insecure_channel(self.targets[0])
        join = channel.stream_stream("/wpub.v1.Group/Join",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=pb.GroupLeaderMessage.FromString)

        def messages():
            yield pb.GroupMemberMessage(join=pb.GroupJoin(group="glm", members=MEMBERS, member=1,
                                                          publisher="hostile", version=v,
                                                          recipe="nvfp4"))
            yield pb.GroupMemberMessage(parts=pb.GroupParts(tensors=["x" * 2000], last=True))

        with self.assertRaises(grpc.RpcError) as cm:
            replies = list(join(messages(), timeout=20))
            self.assertEqual(replies[0].WhichOneof("kind"), "accepted")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("2000 bytes (1 to 1024 allowed)", cm.exception.details())
        channel.close()
        # The member joined before any leader: its round was pending and died with it; the
        # leader's status still shows the leader's own last round.
        s = self.pubs[0].status().raw.publication_group
        self.assertNotEqual(s.version, v)
        self.commit_version(47)

    def test_05_a_follower_killed_mid_publication_aborts_the_version(self):
        self.kill_and_restart(2, 51, "member 2", "connection")

    def test_06_the_leader_killed_mid_publication_never_commits(self):
        self.kill_and_restart(0, 61, "leader")


if __name__ == "__main__":
    unittest.main()


class GroupTorchTest(unittest.TestCase):
    """wpub.PublicationGroup.from_torch on gloo: two ranks, each publishing its pipeline stage
    to its own daemon (examples/publication_group.py); rank 0 learns every member's outcome and
    the receiver holds the whole model of each version."""

    def test_example_two_ranks_on_gloo(self):
        try:
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        except ImportError:
            self.skipTest("needs torch (Debian 12: python3-torch)")
        workdir = tempfile.mkdtemp(prefix="wpub-py-group-torch-")
        daemons = [Daemon(workdir, "--min_receivers=1") for _ in range(2)]
        targets = [d.target for d in daemons]
        recv = GroupReceiver(workdir, targets, "recv-t")
        try:
            for t in targets:
                p = wpub.Publisher(t)
                p.wait_ready()
                deadline = time.monotonic() + 20
                while len(p.status().receivers) < 1:
                    self.assertLess(time.monotonic(), deadline, "receiver did not subscribe")
                    time.sleep(0.05)
                p.close()
            result = os.path.join(workdir, "result.json")
            here = os.path.dirname(os.path.abspath(__file__))
            example = os.path.join(here, "..", "..", "examples", "publication_group.py")
            env = dict(os.environ)
            env["PYTHONPATH"] = os.path.join(here, "..", "..", "clients", "python")
            import subprocess
            import sys
            out = subprocess.run([sys.executable, example, f"--targets={','.join(targets)}",
                                  "--steps=2", f"--result={result}"], env=env, timeout=300,
                                 capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            import json
            with open(result) as f:
                outcomes = json.load(f)
            self.assertEqual(len(outcomes), 2)
            for o in outcomes:
                self.assertTrue(o["committed"], o)
                self.assertEqual([r["member"] for r in o["reports"]], [0, 1])
                self.assertTrue(all(r["bytes_out"] > 0 for r in o["reports"]), o)
            last = outcomes[-1]
            deadline = time.monotonic() + 20
            while True:
                got, meta = read_safetensors(recv.output) if os.path.exists(recv.output) else ({}, {})
                if meta.get("version") == str(last["version"]):
                    break
                self.assertLess(time.monotonic(), deadline, f"receiver holds {meta}")
                time.sleep(0.05)
            # Every tensor of both stages, quantized experts as three outputs each.
            experts = 4 * 4 * 3
            self.assertEqual(len(got), last["tensors"] + 2 * experts)
        finally:
            self.assertEqual(recv.stop(), 0)
            for d in daemons:
                self.assertEqual(d.stop(), 0)
            if not os.environ.get("WPUB_TEST_KEEP"):
                shutil.rmtree(workdir, ignore_errors=True)


class GroupSpecTest(unittest.TestCase):
    """The client's checks, before anything is sent."""

    def test_bad_specs_and_declarations_are_refused(self):
        from wpub._proto import pb
        from wpub.group import group_preamble
        for spec, needle in ((wpub.GroupSpec("", 2, 0), "name"),
                             (wpub.GroupSpec("g", 0, 0), "members"),
                             (wpub.GroupSpec("g", 2, 2), "member 2"),
                             (wpub.GroupSpec("g", 2, 1), "leader"),
                             (wpub.GroupSpec("g", 2, 0, timeout=-1), "timeout")):
            with self.assertRaises(wpub.InvalidArgument) as cm:
                group_preamble(pb.PublicationHeader(version=1), spec, None)
            self.assertIn(needle, str(cm.exception))
        with self.assertRaises(wpub.InvalidArgument):
            group_preamble(pb.PublicationHeader(version=1), None, ["a"])
        with self.assertRaises(wpub.InvalidArgument) as cm:
            group_preamble(pb.PublicationHeader(version=1), wpub.GroupSpec("g", 2, 1, "l:1"), ["a"])
        self.assertIn("only the leader", str(cm.exception))
        h = pb.PublicationHeader(version=1)
        msgs = group_preamble(h, wpub.GroupSpec("g", 2, 0), [f"t{i}" for i in range(5000)])
        self.assertEqual((h.group.group, h.group.members, h.group.member), ("g", 2, 0))
        self.assertEqual(len(msgs), 2)  # 4096 names per message
        names = [n for m in msgs for n in pb.PublishRequest.FromString(m).expected.names]
        self.assertEqual(names, [f"t{i}" for i in range(5000)])
