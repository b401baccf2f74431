#!/usr/bin/env python3
"""Publication groups over NCCL: two GPU-path wpubd on GPU 0, each with its own weight-update group
(its own TCPStore and group name) to ONE SGLang emulator on harness.engine_gpu() (GPU 1, or GPU 0
itself on a machine of one GPU: every process then its own NCCL host identity, harness.nccl_env)
that joined both; they publish a GLM-like MoE from torch CUDA tensors, half each, as one version.
Checks, per version: every tensor the emulator received equals the CPU reference byte for byte, the
engine's lifecycle calls happened once (pause .. continue, by the leader alone), and no resume
served a mix of versions. Then the follower's daemon is killed mid-publication: the version aborts
on the leader, the emulator is resumed only if none of the version reached it (else it stays paused,
dirty), and the next version -- with the follower restarted, a new daemon incarnation whose group
names the emulator has not seen -- commits byte for byte and resumes it, never on a mix.

Usage (a GPU host, binaries staged; see tests/gpu/run_one_gpu.sh):
    WPUBD=... WPUB_RECV=... WPUB_QUANTIZE_REF=... python3 tests/multi_gpu/group_nccl.py OUT_DIR
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from harness import (Daemon, bf16_cuda, engine_gpu, free_port, glm_batches,  # noqa: E402
                     http_json as get, nccl_env, reference, wait_http)



def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/wpub_group_nccl"
    os.makedirs(out, exist_ok=True)
    expect = os.path.join(out, "expect")
    port = free_port()
    gpu = engine_gpu()
    shared = gpu == 0
    emu_log = open(os.path.join(out, "emulator.log"), "w")
    emu = subprocess.Popen([sys.executable, os.path.join(HERE, "sglang_emulator.py"),
                            f"--port={port}", f"--gpu={gpu}", f"--expect-dir={expect}"],
                           stdout=emu_log, stderr=subprocess.STDOUT, env=nccl_env(shared))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60)
    ports = [free_port(), free_port()]

    def start(i):
        # A short group timeout: a follower killed before it joined the round is noticed by the
        # leader only when the round makes no progress for that long.
        return Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines={url}",
                      f"--nccl_group=wpub_member{i}", "--nccl_store_listen=127.0.0.1:0",
                      "--group_timeout=15s",
                      listen=f"127.0.0.1:{ports[i]}", log_level="info", timeout=60,
                      env=nccl_env(shared))

    daemons = [start(0), start(1)]
    targets = [d.target for d in daemons]
    results = {"versions": [], "ok": True}
    pubs = [wpub.Publisher(t, timeout=300) for t in targets]

    def publish(version, seed, hold=None):
        model = glm_batches(seed, hidden=256, inter=128, experts=8)
        ref = reference(out, model)
        vdir = os.path.join(expect, f"v{version}", "tensors")
        os.makedirs(vdir, exist_ok=True)
        for name, (_, _, raw) in ref.items():
            with open(os.path.join(vdir, name + ".bin"), "wb") as f:
                f.write(raw)
        parts = [model[0::2], model[1::2]]
        wire = [[(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in p] for p in parts]
        res = [None, None]

        def run(i):
            def batches():
                for k, b in enumerate(wire[i]):
                    if hold is not None and i == hold[0] and k == 1:
                        hold[1].set()
                        hold[2].wait(60)
                    yield b
            try:
                res[i] = wpub.PublicationGroup(pubs[i], "nccl", 2, i, targets[0]).publish(
                    version, batches())
            except wpub.WpubError as e:
                res[i] = e
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        return ts, res, len(ref)

    try:
        for version, seed in ((1, 1), (2, 2), (3, 3)):
            ts, res, n = publish(version, seed)
            for t in ts:
                t.join(300)
            stats = get(url + "/stats")
            v = stats["versions"].get(str(version), {})
            entry = {"version": version,
                     "committed": [getattr(r, "committed", False) for r in res],
                     "checked": v.get("checked"), "tensors": n,
                     "mismatches": v.get("mismatches", [])[:5],
                     "pauses": stats["calls"].count("/pause_generation"),
                     "resumes": stats["calls"].count("/continue_generation"),
                     "mixed_resumes": stats["mixed_resumes"],
                     "wall_seconds": [getattr(getattr(r, "report", None), "wall_seconds", None)
                                      for r in res]}
            ok = (all(entry["committed"]) and entry["checked"] == n and not entry["mismatches"]
                  and entry["pauses"] == version and entry["resumes"] == version
                  and entry["mixed_resumes"] == 0)
            entry["ok"] = ok
            results["ok"] &= ok
            results["versions"].append(entry)
            print(json.dumps(entry))
        # The follower killed mid-publication.
        sent, release = threading.Event(), threading.Event()
        ts, res, n = publish(4, 4, hold=(1, sent, release))
        sent.wait(60)
        daemons[1].proc.send_signal(signal.SIGKILL)
        daemons[1].stop()
        release.set()
        for t in ts:
            t.join(300)
        stats = get(url + "/stats")
        leader_committed = getattr(res[0], "committed", False)
        killed = {"leader": str(res[0].error if hasattr(res[0], "error") else res[0])[:300],
                  "leader_committed": leader_committed,
                  "serving_after_abort": stats["serving"], "mixed_resumes": stats["mixed_resumes"]}
        daemons[1] = start(1)
        pubs[1].close()
        pubs[1] = wpub.Publisher(targets[1], timeout=300)
        ts, res, n = publish(5, 5)
        for t in ts:
            t.join(300)
        stats = get(url + "/stats")
        killed["next_committed"] = [getattr(r, "committed", False) for r in res]
        killed["serving_after_next"] = stats["serving"]
        killed["mixed_resumes_after"] = stats["mixed_resumes"]
        v = stats["versions"].get("5", {})
        killed["next_checked"] = v.get("checked")
        killed["next_mismatches"] = v.get("mismatches", [])[:5]
        killed["ok"] = (not leader_committed and all(killed["next_committed"]) and
                        killed["serving_after_next"] and killed["mixed_resumes_after"] == 0 and
                        v.get("checked") == n and not v.get("mismatches"))
        results["killed_follower"] = killed
        results["ok"] &= killed["ok"]
        print(json.dumps(killed))
    finally:
        for p in pubs:
            p.close()
        for d in daemons:
            d.stop()
        emu.send_signal(signal.SIGTERM)
        emu.wait(30)
    with open(os.path.join(out, "group_nccl.json"), "w") as f:
        json.dump(results, f, indent=1)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
