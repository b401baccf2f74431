#!/usr/bin/env python3
"""Publication groups on the CPU path: the wall clock of one version published by 1, 2 and 4
daemons for the same total bytes (each member a 1/N share of a GLM-like MoE, one wpub-recv
subscribed to every member), and the coordination overhead per version (a group of 3 members
publishing one small tensor each, against the same tensor published alone).

    cmake --build build --target wpubd wpub-recv
    WPUBD=build/server/wpubd/wpubd WPUB_RECV=build/clients/recv/wpub-recv \
        /usr/bin/python3 bench/group/group_bench.py [--versions 5] [--json FILE]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from harness import Daemon, as_wire, glm_batches, bf16  # noqa: E402
import numpy as np  # noqa: E402
import wpub  # noqa: E402
from test_group import GroupReceiver  # noqa: E402


def start(workdir, n):
    daemons = [Daemon(workdir, "--min_receivers=1", log_level="error") for _ in range(n)]
    targets = [d.target for d in daemons]
    recv = GroupReceiver(workdir, targets, f"recv-{n}")
    pubs = [wpub.Publisher(t, timeout=120) for t in targets]
    for p in pubs:
        p.wait_ready()
        while len(p.status().receivers) < 1:
            time.sleep(0.02)
    return daemons, recv, pubs


def stop(daemons, recv, pubs):
    for p in pubs:
        p.close()
    recv.stop()
    for d in daemons:
        d.stop()


def group_publish(pubs, targets, version, parts, name="bench", **kwargs):
    n = len(pubs)
    out = [None] * n

    def run(i):
        g = wpub.PublicationGroup(pubs[i], name, n, i, targets[0])
        out[i] = g.publish(version, as_wire(parts[i]), **kwargs)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for i, o in enumerate(out):
        if not o.committed:
            raise RuntimeError(f"member {i}: {o.error}")
    return wall, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--small_versions", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="wpub-group-bench-")
    model = glm_batches(1, hidden=512, inter=256, experts=16, moe_layers=(1, 2, 3, 4),
                        mtp_layer=5)
    total = sum(a.nbytes for _, ts in model for _, a in ts)
    results = {"model_bytes": total, "scaling": {}, "overhead": {}}
    print(f"model: {len(model)} batches, {total / 2**20:.1f} MiB bf16")
    try:
        for n in (1, 2, 4):
            daemons, recv, pubs = start(workdir, n)
            targets = [d.target for d in daemons]
            parts = [model[i::n] for i in range(n)]
            walls, daemon_walls = [], []
            for v in range(1, args.versions + 2):
                wall, out = group_publish(pubs, targets, v, parts)
                if v > 1:  # the first version warms the daemons up
                    walls.append(wall)
                    daemon_walls.append(max(o.report.wall_seconds for o in out))
            stop(daemons, recv, pubs)
            results["scaling"][n] = {"wall_s": statistics.median(walls),
                                     "daemon_wall_s": statistics.median(daemon_walls)}
            print(f"{n} publisher(s): median wall {statistics.median(walls):.3f} s "
                  f"(slowest daemon {statistics.median(daemon_walls):.3f} s) over {len(walls)}")

        # Coordination overhead: one small tensor per member, 3 members vs alone.
        daemons, recv, pubs = start(workdir, 3)
        targets = [d.target for d in daemons]
        rng = np.random.default_rng(0)
        small = [[(f"decoder.layers.{i}.input_layernorm.weight",
                   [(f"model.layers.{i}.input_layernorm.weight", bf16(rng, (64,)))])]
                 for i in range(3)]
        solo, grouped, waits, barrier = [], [], [], []
        v = 0
        for _ in range(args.small_versions):
            v += 1
            r = pubs[0].publish(v, as_wire(small[0]), recipe="bf16")
            solo.append(r.wall_seconds)
            v += 1
            _, out = group_publish(pubs, targets, v, small, recipe="bf16")
            grouped.append(out[0].report.wall_seconds)
            waits.append(out[0].report.phases.group)
            # The barrier's own cost: the leader's wall clock beyond the slowest member's own
            # work (its wall clock less its time waiting for the group).
            own = max(o.report.wall_seconds - o.report.phases.group for o in out)
            barrier.append(out[0].report.wall_seconds - own)
        stop(daemons, recv, pubs)
        overhead = statistics.median(grouped) - statistics.median(solo)
        coordination = out[0].report.group.coordination_seconds  # the last version's
        results["overhead"] = {"solo_s": statistics.median(solo),
                               "leader_bookkeeping_s": coordination,
                               "group_s": statistics.median(grouped),
                               "overhead_s": overhead,
                               "leader_group_phase_s": statistics.median(waits),
                               "barrier_s": statistics.median(barrier)}
        print(f"coordination: leader's wall clock {statistics.median(grouped) * 1e3:.2f} ms in a "
              f"group of 3 vs {statistics.median(solo) * 1e3:.2f} ms alone: overhead "
              f"{overhead * 1e3:.2f} ms per version (leader's group phase "
              f"{statistics.median(waits) * 1e3:.2f} ms); the barrier beyond the slowest "
              f"member's own work {statistics.median(barrier) * 1e3:.2f} ms")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
