"""Publication groups under chaos (docs/DESIGN.md, "One decision per version"): two wpubd (the
leader and one member, each with its decision log) publish each version together to two
wpub-recv processes subscribed to both. Every link goes through a proxy that can cut it: the
member's stream to the leader, and each receiver's subscription to each daemon. Each round (200
by default, WPUB_CHAOS_ROUNDS) cuts links at random instants of the publication (the leader's
messages to the member slowed at random, so that cuts fall between a vote and the decision
too), and now and then kills a receiver (SIGKILL) and starts it again. Invariant, every round: both members report
the same outcome, and once the round settles every receiver holds the version the reports name
-- the new one when they say committed, the previous one otherwise -- byte for byte against the
CPU reference at checkpoints. The seed is printed; WPUB_CHAOS_SEED replays a run."""

import os
import random
import shutil
import signal
import tempfile
import threading
import time
import unittest

import wpub
from harness import ChildProcess, Daemon, as_wire, binary, glm_batches, read_safetensors, reference
from test_group import CuttableProxy, names_of, split

MEMBERS = 2
RECEIVERS = 2


class ChaosReceiver(ChildProcess):
    """A wpub-recv subscribed to every member through its own proxies."""

    def __init__(self, workdir, targets, name):
        self.workdir, self.targets, self.name = workdir, targets, name
        self.output = os.path.join(workdir, f"{name}.safetensors")
        self.start()

    def start(self):
        self._start([binary("WPUB_RECV"), f"--target={','.join(self.targets)}",
                     f"--name={self.name}", f"--output={self.output}", "--log_level=info",
                     "--resubscribe_timeout=300s"],
                    os.path.join(self.workdir, f"{self.name}.log"))

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def version(self):
        if not os.path.exists(self.output):
            return 0
        try:
            return int(read_safetensors(self.output)[1].get("version", "0"))
        except (OSError, ValueError):
            return -1  # being replaced: read again


class GroupChaosTest(unittest.TestCase):

    def setUp(self):
        self.seed = int(os.environ.get("WPUB_CHAOS_SEED", random.randrange(1 << 30)))
        self.rounds = int(os.environ.get("WPUB_CHAOS_ROUNDS", "200"))
        print(f"chaos seed {self.seed}, {self.rounds} rounds", flush=True)
        self.rng = random.Random(self.seed)
        self.workdir = tempfile.mkdtemp(prefix="wpub-group-chaos-")
        self.daemons = [
            Daemon(self.workdir, f"--min_receivers={RECEIVERS}", "--group_timeout=4s",
                   "--group_join_timeout=4s",
                   f"--group_decision_log={os.path.join(self.workdir, f'decisions-{i}.jsonl')}",
                   log_level="info")
            for i in range(MEMBERS)]
        # The member reaches its leader through a proxy; each receiver each daemon through one.
        self.member_link = CuttableProxy(self.daemons[0].target)
        self.receiver_links = [[CuttableProxy(d.target) for d in self.daemons]
                               for _ in range(RECEIVERS)]
        self.receivers = [ChaosReceiver(self.workdir, [p.target for p in self.receiver_links[r]],
                                        f"recv-{r}") for r in range(RECEIVERS)]
        self.pubs = [wpub.Publisher(d.target, timeout=120) for d in self.daemons]
        for p in self.pubs:
            p.wait_ready()

    def tearDown(self):
        for p in self.pubs:
            p.close()
        for r in self.receivers:
            r.stop()
        codes = [d.stop() for d in self.daemons]
        for p in [self.member_link] + [p for row in self.receiver_links for p in row]:
            p.close()
        if not os.environ.get("WPUB_TEST_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.assertEqual(codes, [0] * MEMBERS)

    def wait_subscribed(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        for p in self.pubs:
            while len(p.status().receivers) < RECEIVERS:
                self.assertLess(time.monotonic(), deadline, "receivers did not subscribe")
                time.sleep(0.02)

    def publish(self, version, parts):
        outcomes = [None] * MEMBERS

        def run(i):
            g = wpub.PublicationGroup(self.pubs[i], "chaos", MEMBERS, i,
                                      self.daemons[0].target if i == 0
                                      else self.member_link.target)
            try:
                outcomes[i] = g.publish(version, as_wire(parts[i]), bucket_bytes=8192)
            except wpub.WpubError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(MEMBERS)]
        for t in threads:
            t.start()
        return threads, outcomes

    def faults(self):
        """This round's faults: (delay in seconds, what) pairs. The leader's messages to the
        member are slowed at random too, so that a cut often falls between the member's vote
        and the decision reaching it (the member then holds the version in doubt)."""
        self.member_link.delay = self.rng.choice([0.0, 0.0, 0.05, 0.2])
        plan = []
        if self.rng.random() < 0.35:
            plan.append((self.rng.uniform(0, 0.8), "member link"))
        if self.rng.random() < 0.35:
            plan.append((self.rng.uniform(0, 0.4),
                         ("receiver link", self.rng.randrange(RECEIVERS),
                          self.rng.randrange(MEMBERS))))
        if self.rng.random() < 0.04:
            plan.append((self.rng.uniform(0, 0.25), ("kill receiver",
                                                     self.rng.randrange(RECEIVERS))))
        return sorted(plan, key=lambda p: p[0])

    def apply(self, what, killed):
        if what == "member link":
            self.member_link.cut()
        elif what[0] == "receiver link":
            self.receiver_links[what[1]][what[2]].cut()
        else:
            self.receivers[what[1]].kill()
            killed.append(what[1])

    def wait_holding(self, version, why, timeout=60.0):
        deadline = time.monotonic() + timeout
        for r in self.receivers:
            while r.version() != version:
                if time.monotonic() > deadline:
                    self.fail(f"{r.name} holds v{r.version()}, not v{version} ({why}); "
                              f"seed {self.seed}")
                time.sleep(0.02)

    def test_every_receiver_holds_what_every_report_names(self):
        held, held_model = 0, None
        stats = {"committed": 0, "aborted": 0, "cuts": 0, "kills": 0}
        for v in range(1, self.rounds + 1):
            self.wait_subscribed()
            model = glm_batches(v, experts=2)
            plan = self.faults()
            threads, outcomes = self.publish(v, split(model, MEMBERS))
            killed, t0 = [], time.monotonic()
            for delay, what in plan:
                time.sleep(max(0.0, t0 + delay - time.monotonic()))
                self.apply(what, killed)
            for t in threads:
                t.join(120)
                self.assertFalse(t.is_alive(), f"v{v}: a member's publish hung; seed {self.seed}")
            for r in killed:
                self.receivers[r].start()
            stats["cuts"] += sum(1 for _, w in plan if w == "member link" or w[0] != "kill receiver")
            stats["kills"] += len(killed)
            committed = [isinstance(o, wpub.GroupOutcome) and o.committed for o in outcomes]
            self.assertEqual(committed[0], committed[1],
                             f"v{v}: the members disagree: {outcomes}; faults {plan}; "
                             f"seed {self.seed}")
            if committed[0]:
                held, held_model = v, model
                stats["committed"] += 1
            else:
                stats["aborted"] += 1
            self.wait_holding(held, f"v{v} {'committed' if committed[0] else 'aborted'}, "
                                    f"faults {plan}")
            if held_model is not None and (v % 50 == 0 or v == self.rounds) and committed[0]:
                expected = reference(self.workdir, held_model)
                for r in self.receivers:
                    got, _ = read_safetensors(r.output)
                    self.assertEqual(sorted(got), sorted(expected), r.name)
                    for name, (dtype, shape, raw) in expected.items():
                        self.assertTrue(got[name][2] == raw, f"{r.name} {name} v{v}")
        # How often a cut fell between the member's vote and the decision (the member in doubt).
        stats["in doubt"] = sum(open(d.log_path, errors="replace").read().count("in doubt here")
                                for d in self.daemons)
        print(f"chaos: {stats}", flush=True)
        self.assertGreater(stats["committed"], self.rounds // 4)


if __name__ == "__main__":
    unittest.main()
