"""Who may join a publication group: a leader without a token takes members on this host only
(loopback, Unix sockets); one reached over another address refuses the join naming the peer and
the flags that authenticate a group, and nothing of the member's reaches a round. With the
daemon's token the same join from that address is taken. The member's side refuses on its own to
join a leader beyond loopback without a token. Needs an address of this host other than
loopback (skips without one)."""

import os
import shutil
import socket
import tempfile
import time
import unittest

import grpc

import wpub
from harness import Daemon, as_wire, glm_batches
from wpub._proto import pb


def host_address():
    """An address of this host that is not loopback, or None."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def join(target, token=""):
    """A member's Join on `target`: the leader's first answer (or the error)."""
    channel = grpc.insecure_channel(target)
    call = channel.stream_stream("/wpub.v1.Group/Join",
                                 request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=pb.GroupLeaderMessage.FromString)

    def messages():
        yield pb.GroupMemberMessage(join=pb.GroupJoin(group="g", members=2, member=1,
                                                      publisher="remote", version=5,
                                                      recipe="nvfp4"))

    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        for reply in call(messages(), timeout=10, metadata=metadata):
            return reply.WhichOneof("kind")
        return "(no answer)"
    except grpc.RpcError as e:
        return e
    finally:
        channel.close()


@unittest.skipIf(host_address() is None, "no address of this host other than loopback")
class GroupAuthTest(unittest.TestCase):

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="wpub_group_auth_")
        self.addr = host_address()

    def tearDown(self):
        shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self, token=""):
        d = Daemon(self.workdir, "--insecure_listen", token=token, listen="0.0.0.0:0")
        self.addCleanup(d.stop)
        return d

    def test_without_a_token_only_this_hosts_members_join(self):
        d = self.start()
        refused = join(f"{self.addr}:{d.port}")
        self.assertIsInstance(refused, grpc.RpcError)
        self.assertEqual(refused.code(), grpc.StatusCode.PERMISSION_DENIED)
        self.assertIn("loopback only", refused.details())
        self.assertIn("--auth_token_file", refused.details())
        self.assertIn(self.addr, refused.details())
        # Nothing of it reached a round; a member on loopback joins.
        self.assertEqual(join(f"127.0.0.1:{d.port}"), "accepted")

    def test_with_the_token_a_member_beyond_loopback_joins(self):
        d = self.start(token="s3cret")
        self.assertEqual(join(f"{self.addr}:{d.port}", token="s3cret"), "accepted")
        wrong = join(f"{self.addr}:{d.port}", token="guess")
        self.assertEqual(wrong.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_a_member_without_a_token_does_not_join_a_leader_beyond_loopback(self):
        leader = self.start(token="s3cret")
        member = self.start()
        pub = wpub.Publisher(member.target, timeout=30)
        self.addCleanup(pub.close)
        g = wpub.PublicationGroup(pub, "g", 2, 1, leader=f"{self.addr}:{leader.port}")
        with self.assertRaises(wpub.WpubError) as cm:
            g.publish(1, as_wire(glm_batches(3)))
        self.assertIn("loopback only", str(cm.exception))


class GroupStreamBoundTest(unittest.TestCase):
    """Parked Group.Join streams hold no thread of the leader: more of them than
    --grpc_max_threads are accepted while Publish/GetStatus keep answering, and the round they
    wait in still times out (no thread waits on it: the service's stall watch ends it)."""

    def test_parked_joins_hold_no_thread_and_still_time_out(self):
        import threading
        workdir = tempfile.mkdtemp(prefix="wpub_group_streams_")
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        d = Daemon(workdir, "--grpc_max_threads=8", "--group_timeout=3s")
        self.addCleanup(d.stop)
        channel = grpc.insecure_channel(d.target)
        self.addCleanup(channel.close)
        call = channel.stream_stream("/wpub.v1.Group/Join",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=pb.GroupLeaderMessage.FromString)
        release = threading.Event()
        self.addCleanup(release.set)

        def parked(member):
            yield pb.GroupMemberMessage(join=pb.GroupJoin(group="g", members=20, member=member,
                                                          publisher=f"p{member}", version=1,
                                                          recipe="nvfp4"))
            release.wait(60)  # then the stream ends

        streams = []
        t0 = time.monotonic()
        for member in range(1, 13):  # 12 members of one pending round, past the 8 threads
            s = call(parked(member), timeout=60)
            self.assertEqual(next(s).WhichOneof("kind"), "accepted")
            streams.append(s)
        pub = wpub.Publisher(d.target, timeout=10)
        self.addCleanup(pub.close)
        self.assertIsNotNone(pub.status())  # the trainer's calls still get threads
        # Nobody stages: the round times out and every parked member is told.
        for s in streams:
            msg = next(s)
            self.assertEqual(msg.WhichOneof("kind"), "decision")
            self.assertFalse(msg.decision.commit)
            self.assertEqual(msg.decision.code, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
            self.assertIn("no progress for 3s", msg.decision.reason)
        self.assertGreaterEqual(time.monotonic() - t0, 3.0)
        release.set()
        for s in streams:
            s.cancel()


if __name__ == "__main__":
    unittest.main()


class ReceiverIdentityTest(unittest.TestCase):
    """Two receiver processes that share a name, one subscribed to each member of a group, are
    two receivers: neither holds the whole version, and the leader refuses to commit, naming
    both (it used to match them by name and report every member committed while no receiver
    applied anything)."""

    def test_a_shared_name_is_not_one_receiver(self):
        import threading
        from harness import Receiver, wait_for_receivers
        workdir = tempfile.mkdtemp(prefix="wpub_group_ident_")
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        daemons = [Daemon(workdir) for _ in range(2)]
        for d in daemons:
            self.addCleanup(d.stop)
        receivers = [Receiver(d, "recv") for d in daemons]  # one per member, one name
        for r in receivers:
            self.addCleanup(r.stop)
        pubs = [wpub.Publisher(d.target, timeout=60) for d in daemons]
        for p in pubs:
            self.addCleanup(p.close)
            wait_for_receivers(p, 1)
        batches = glm_batches(5)
        parts = [batches[0::2], batches[1::2]]
        outcomes = [None, None]

        def run(i):
            g = wpub.PublicationGroup(pubs[i], "ident", 2, i, daemons[0].target, timeout=20)
            outcomes[i] = g.publish(1, as_wire(parts[i]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for o in outcomes:
            self.assertIsNotNone(o)
            self.assertFalse(o.committed, o.error)
        text = outcomes[0].error
        self.assertIn("receivers recv (instance ", text)
        self.assertIn("took part in other members' publications", text)
